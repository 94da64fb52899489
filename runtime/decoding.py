"""The decoding loop: prefill, then one step at a time (choose an offer, draft, verify, commit,
learn), clipped at EOS and max_tokens.

Invariant (gpt-fast style): ``tokens`` is the committed text; the target's sequence 0 holds all
of it but the last token, which is "pending" and fed at the next step together with any draft.
Who drafts is the drafters' business (drafting/: one protocol, a registry, a composite that picks
each step's offer); how a draft is verified is the method's (methods/: the step contract). The
loop alone commits what a step kept, cuts the target's cache to it, updates the stats and lets
the drafters learn. The backends record what each sequence holds, so reusing a cached prefix
across runs (a chat's next turn) needs no bookkeeping here.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import numpy as np

from . import methods
from .backend import Backend, common_prefix, feed
from .config import DecodeConfig
from .drafting import Drafters
from .drafting.base import Draft, Offer, Run
from .drafting.controller import Model
from .errors import ContextOverflowError, OptionError
from .methods import StepResult, StepView
from .options import REPEAT_N
from .rules.repeats import Seen
from .rules.shape import Penalties, Shape
from .stats import Stats
from .text.constraint import DONE, OPEN, Compiled, Grammar, Matcher, compile
from .text.vocab import VocabMap

TIMED_FIELDS = ("prefill_s", "draft_s", "verify_s")


class Generation:
    """A lazy run: iterate for blocks of new token ids; ``stats`` is complete after the last one.

    ``reuse``: keep the longest prefix the caches already hold (else start from a cleared cache,
    laid out exactly as in a fresh context). ``model``: what the adaptive controllers have learned
    about this pair (an engine shares one between requests). ``clock``: seconds, for timings.
    ``vocab``: the map when the aux speaks another vocabulary (runtime/text/vocab.py). ``learn``: a
    seeded run too plans from ``model`` and teaches it (else from a frozen copy). A drafting method
    drafts as ``cfg.drafter`` says (drafting/__init__.py: the registry, and what 'auto' takes).
    ``constraint``: a grammar the answer follows (runtime/text/constraint.py), compiled or to be
    compiled; the run ends with finish reason "stop" where it is complete and "dead_end" where
    nothing it allows can follow."""

    def __init__(
        self,
        target: Backend,
        aux: Optional[Backend],
        prompt: Sequence[int],
        cfg: DecodeConfig,
        reuse: bool = True,
        model: Optional[Model] = None,
        clock: Callable[[], float] = time.perf_counter,
        vocab: Optional[VocabMap] = None,
        learn: bool = False,
        constraint: Optional[Compiled | Grammar] = None,
    ):
        if not prompt:
            raise OptionError("the prompt must contain at least one token", "prompt")
        self.method = methods.get(cfg.method)
        self.target, self.cfg, self.reuse, self.clock = target, cfg, reuse, clock
        model = model if model is not None else Model()
        # A seeded adaptive run plans from a frozen copy (its text then depends on the seed only),
        # unless the caller wants it to learn like an unseeded one (``learn``: bench).
        self.model = model.copy(frozen=True) if cfg.seed is not None and cfg.adaptive and not learn else model
        cfg, why = cfg.resolved(self.model, aux is not None)  # method 'auto': mtad or sd, for this pair
        self.cfg, self.method = cfg, methods.get(cfg.method)
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
        self.tokens = list(prompt)
        if isinstance(constraint, Grammar):
            constraint = compile(constraint, target)
        self.constraint: Optional[Matcher] = constraint.start(len(prompt)) if constraint is not None else None
        self.stats = Stats(method=cfg.method, prompt_tokens=len(prompt), seed=self.seed, auto=why)
        budget = lambda: cfg.max_tokens - self.stats.generated  # noqa: E731
        space = lambda: self._room() - len(self.tokens)  # noqa: E731
        shape = Shape(Penalties.of(cfg.sampling), self.constraint)
        run = Run(
            target, aux, cfg, self.method, self.model, clock, self.seed, vocab, budget, space, self.constraint, shape
        )
        self.drafters = Drafters.build(run)
        self.stats.gamma_min, self.stats.drafters = self.drafters.gamma_floor, self.drafters.counters
        self.layout = self.method.layout(self.drafters.max_gamma, self.drafters.max_width, cfg.tree)
        if self.layout.target_seqs > target.n_seq_max:
            raise OptionError(
                f"{cfg.method} with {self.drafters.max_width} beams needs a target context with "
                f"{self.layout.target_seqs} sequences",
                "beam_width",
            )
        room = self._room()
        if len(prompt) > room:
            raise ContextOverflowError(
                f"prompt has {len(prompt)} tokens but the context holds {room} ({self._room_why()}); "
                "shorten it or raise --ctx-size"
            )
        self.rng = np.random.default_rng(self.seed)
        self._steps = 0
        seen = Seen(REPEAT_N) if cfg.repeat_bar > 1 and self.method.drafts else None
        self.view = StepView(
            target,
            self.tokens,
            cfg.sampling,
            cfg.accept_threshold,
            cfg.tree,
            cfg.verify,
            cfg.repeat_bar,
            self.rng,
            clock,
            seen,
            shape,
        )

    # -- the loop ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        st, clock = self.stats, self.clock
        t0 = clock()
        between_steps = False  # caches match the bookkeeping only between steps
        try:
            self._prefill()
            st.prefill_s = clock() - t0
            while True:
                between_steps = True
                if len(self.tokens) > self._room():
                    st.finish_reason = "context"
                    return
                if self._constraint_ends():
                    return
                between_steps = False
                new = self._step()
                between_steps = True
                new, dead = self._follow(new)
                out, stop = self._clip(new)
                if dead:
                    st.finish_reason, stop = "dead_end", True
                st.generated += len(out)
                if out:
                    if st.ttft_s is None:
                        st.ttft_s = clock() - t0
                    yield out
                if stop:
                    return
        finally:
            self.drafters.finish(self.tokens[st.prompt_tokens :])
            if not between_steps:  # stopped inside a step: drop what it left half done
                self._drop_caches()
            if self.constraint is not None:
                st.mask_s = self.constraint.seconds
            st.wall_s = clock() - t0
            st.other_s = st.wall_s - sum(getattr(st, f) for f in TIMED_FIELDS)

    def _constraint_ends(self) -> bool:
        """Whether the constraint ends the run before the next step: the answer is complete
        (only the end of generation may follow: "stop") or nothing may follow ("dead_end")."""
        if self.constraint is None:
            return False
        state = self.constraint.state()
        if state == OPEN:
            return False
        self.stats.finish_reason = "stop" if state == DONE else "dead_end"
        return True

    def _follow(self, new: list[int]) -> tuple[list[int], bool]:
        """The constraint consumes a committed block; a token it does not allow (drawn from a row
        past a dead end, which no mask could constrain) cuts the block there and ends the run, as
        a dead end unless the answer was complete before it."""
        if self.constraint is None:
            return new, False
        n = self.constraint.commit(new)
        if n == len(new) or any(self.target.is_eog(t) for t in new[:n]):
            return new, False
        del self.tokens[len(self.tokens) - len(new) + n :]  # the run ends here: the caches are cut by the next one
        return new[:n], self.constraint.state() != DONE

    def _step(self) -> list[int]:
        """Choose the step's offer, let its drafter draft, let the method verify (with the
        drafter's work beside it), commit what it kept, learn."""
        st, clock, drafters, step = self.stats, self.clock, self.drafters, self._steps + 1
        self._steps = step
        t0 = clock()
        offer = drafters.choose(self.tokens, self._draft_cap(), step)
        t1 = clock()
        draft = drafters.draft(offer, self.tokens, step)
        t2 = clock()
        if self.view.seen is not None and draft is not None:
            self.view.seen.sync(self.tokens)
        beside = drafters.overlap(offer, draft, self.tokens, step)  # None for most drafters
        try:
            result = self.method.step(self.view, offer.plan.gamma, offer.plan.width, draft)
        finally:
            if beside is not None:  # done before anything touches the drafter's cache
                beside.join()
        t3 = clock()
        new = self._commit(offer, draft, result)
        t4 = clock()
        calls = [(call.rows, call.seconds, call.tree) for call in result.calls]
        drafters.learn(offer, draft, result, calls, t4 - t0 + offer.hidden)
        self._count(offer, draft)
        st.controller_s += (t1 - t0) + (clock() - t4)
        st.draft_s += t2 - t1
        st.verify_s += t3 - t2
        return new

    def _draft_cap(self) -> int:
        """The longest draft worth making now: a step commits at most its draft and one token more,
        so a drafting method drafts at most one token fewer than max_tokens leaves (as llama.cpp's
        server caps its drafts); beam's windows are its search, not drafts, and keep their length."""
        if not self.method.drafts:
            return self.drafters.max_gamma
        left = min(self.cfg.max_tokens - self.stats.generated, self.target.n_positions - len(self.tokens))
        return max(0, min(self.drafters.max_gamma, left - 1))

    def _commit(self, offer: Offer, draft: Optional[Draft], result: StepResult) -> list[int]:
        """Keep what the step accepted: the target's sequence 0 keeps the pending token and the k
        accepted drafted tokens, then the drafter follows, then the text grows by the step's tokens."""
        st = self.stats
        st.target_calls += len(result.calls)
        st.target_s += sum(call.seconds for call in result.calls)
        if draft is not None:
            k = result.accepted
            assert k is not None
            self.target.rollback(0, len(self.tokens) + k)
            st.drafted += len(draft.tokens)
            st.accepted += k
            st.accept_lengths.append(k)
            self.drafters.commit(offer, draft, result, self.tokens)
        self.tokens.extend(result.tokens)
        return result.tokens

    def _count(self, offer: Offer, draft: Optional[Draft]) -> None:
        """The step's plan in the stats: drafted length, width, what the controller expected."""
        st, plan = self.stats, offer.plan
        drafted = len(draft.tokens) if draft is not None else 0
        st.gamma_hist[drafted] = st.gamma_hist.get(drafted, 0) + 1
        if drafted:
            st.width_hist[plan.width] = st.width_hist.get(plan.width, 0) + 1
            st.alone_steps += plan.alone
        st.predicted_tokens += plan.tokens
        st.predicted_s += plan.seconds

    def _prefill(self) -> None:
        """Evaluate all prompt tokens but the last, reusing the cached prefix they share."""
        if not self.reuse:
            self._drop_caches()
        context, target = self.tokens[:-1], self.target
        for s in range(1, target.n_seq_max):  # tree branches a stopped run may have left
            target.rollback(s, 0)
        target.rollback(0, common_prefix(target.held(0), context))
        self.stats.cached_tokens = len(target.held(0))
        feed(target, context, logits="none")
        self.drafters.start(self.tokens)

    def _drop_caches(self) -> None:
        self.target.clear()
        self.drafters.clear()

    def _room(self) -> int:
        """Committed tokens the contexts can hold with room for one more step, which adds one
        token at least to a run of at most ``n_positions`` (the context size asked for: llama.cpp
        pads a context to 256 cells, and --ctx-size 40 ran 138 tokens)."""
        room = min(self.target.n_positions - 1, self.target.n_ctx - self.layout.target_cells)
        bound = self.drafters.room(self.layout.draft_cells)
        return room if bound is None else min(room, bound[0])

    def _room_why(self) -> str:
        """Which context sets ``_room``, and what a step keeps of it (for a refusal's message)."""
        room, target = self._room(), self.target
        if room == target.n_positions - 1:
            return f"--ctx-size {target.n_positions} less 1 for the answer"
        bound = self.drafters.room(self.layout.draft_cells)
        if bound is not None and room < target.n_ctx - self.layout.target_cells:
            return bound[1]
        return f"the target's {target.n_ctx} cells less {self.layout.target_cells} for a step"

    def _clip(self, new: list[int]) -> tuple[list[int], bool]:
        """Cut a committed block at an end-of-generation token or the max_tokens budget."""
        budget = self.cfg.max_tokens - self.stats.generated
        positions = self.target.n_positions - (len(self.tokens) - len(new))  # the context size asked for
        for i, t in enumerate(new):
            if self.target.is_eog(t):
                self.stats.finish_reason = "stop"
                return new[:i][: min(budget, positions)], True
        if len(new) >= min(budget, positions):
            self.stats.finish_reason = "length" if budget <= positions else "context"
            return new[: min(budget, positions)], True
        return new, False
