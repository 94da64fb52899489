"""The decoding loop: prefill, then one step at a time (plan, draft, verify, commit), clipped at
EOS and max_tokens.

Invariant (gpt-fast style): ``tokens`` is the committed text; the target's sequence 0 holds all
of it but the last token, which is "pending" and fed at the next step together with any draft.
A method's step returns what it did (methods/base.py: StepResult); the loop alone commits it,
cuts the caches to what was accepted, updates the stats and teaches the controller. The backends
record what each sequence holds, so reusing a cached prefix across runs (a chat's next turn)
needs no bookkeeping here.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from . import methods
from .backend import Backend, common_prefix, feed
from .config import DecodeConfig
from .drafting.aux import Ahead, BeamDrafter, Draft
from .drafting.controller import Controller, FixedController, Model, Plan
from .drafting.lookup import MATCH_EDGES, Lookup, NgramDrafter, match_class
from .errors import ContextOverflowError, OptionError
from .methods import StepResult, StepView
from .options import AUTO, AUTO_WIDTH_MAX, REPEAT_N
from .rules.repeats import Seen
from .text.vocab import CrossVocab, VocabMap

TIMED_FIELDS = ("prefill_s", "draft_s", "verify_s")

# Plain plans in a row after which the aux counts as idle beside prompt lookup, and a request
# leaves its prompt unfed until it drafts (fed up front, it doubled the time to the first token of
# the tiny pair, whose aux never pays; at x4, where it does, waiting cost a plain step a request).
AUX_IDLE_PLANS = 8

DRAFT_STREAM = 0x6472616674  # "draft": the aux's random streams, apart from the run's own


@dataclass
class Stats:
    method: str = ""
    seed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens already in the target's cache (reused, not prefilled)
    generated: int = 0
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    target_s: float = 0.0  # of draft_s + verify_s: the target's calls (a beam window's on the target too)
    other_s: float = 0.0
    wall_s: float = 0.0
    ttft_s: Optional[float] = None  # start of the run to its first committed block
    finish_reason: str = ""
    gamma_hist: dict[int, int] = field(default_factory=dict)  # drafted length -> steps (0: plain target steps)
    width_hist: dict[int, int] = field(default_factory=dict)  # beam width -> drafting steps
    alone_steps: int = 0  # MMTAD: drafting steps that verified the best beam alone, not the tree
    predicted_tokens: float = 0.0  # the controller's expected committed tokens, summed over steps
    predicted_s: float = 0.0  # and its expected seconds
    controller_s: float = 0.0  # time spent choosing (gamma, width) and learning
    gamma_min: Optional[int] = None  # gamma 'auto': the shortest draft it could choose
    lookup_drafted: int = 0  # of ``drafted``: the tokens prompt lookup drafted (--drafter ngram...)
    lookup_accepted: int = 0  # and those of them the target kept
    vocab_resyncs: int = 0  # aux vocabulary differs: target tokens re-tokenised for the aux
    vocab_mapped_share: Optional[float] = None  # and the share of generated tokens the aux could draft
    ahead_drafts: int = 0  # draft_ahead: the next blocks drafted while the target verified
    ahead_hits: int = 0  # and those the next step took (the draft it would have made)

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def block_efficiency(self) -> Optional[float]:
        """Generated tokens per target call (1.0 for ar)."""
        return self.generated / self.target_calls if self.target_calls else None

    @property
    def predicted_tokens_per_s(self) -> Optional[float]:
        """What the adaptive controller expected (None with a fixed gamma and width)."""
        return self.predicted_tokens / self.predicted_s if self.predicted_s > 0 else None

    @property
    def decode_s(self) -> float:
        return self.wall_s - self.prefill_s

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Generated tokens per second of decoding (prompt prefill excluded, as llama-bench tg)."""
        return self.generated / self.decode_s if self.decode_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("acceptance_rate", "block_efficiency", "tokens_per_s", "predicted_tokens_per_s"):
            d[k] = getattr(self, k)
        return d

    def summary(self) -> str:
        def fmt(v: Optional[float], spec: str) -> str:
            return "n/a" if v is None else format(v, spec)

        return (
            f"{self.method}: {self.generated} tokens, {fmt(self.tokens_per_s, '.1f')} tok/s, "
            f"prompt {self.prompt_tokens} ({self.cached_tokens} cached), "
            f"{self.target_calls} target calls, block efficiency {fmt(self.block_efficiency, '.2f')}, "
            f"acceptance {fmt(self.acceptance_rate, '.1%')} ({self.accepted}/{self.drafted}), "
            f"draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s other {self.other_s:.2f}s, "
            f"finish {self.finish_reason}"
        )


class Generation:
    """A lazy run: iterate for blocks of new token ids; ``stats`` is complete after the last one.

    ``reuse``: keep the longest prefix the caches already hold (else start from a cleared cache,
    laid out exactly as in a fresh context). ``model``: what the adaptive controller has learned
    about this pair (an engine shares one between requests). ``clock``: seconds, for timings.
    ``vocab``: the map when the aux speaks another vocabulary (runtime/vocab.py). ``learn``: a
    seeded run too plans from ``model`` and teaches it (else from a frozen copy). A drafting method
    drafts with ``aux`` and/or prompt lookup, as ``cfg.drafter`` says ('auto': the aux when given,
    with lookup beside it under gamma 'auto'; lookup alone without an aux)."""

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
    ):
        if not prompt:
            raise OptionError("the prompt must contain at least one token", "prompt")
        self.method = methods.get(cfg.method)
        self.target, self.cfg, self.reuse, self.clock = target, cfg, reuse, clock
        use_aux, use_lookup = cfg.draft_sources if self.method.needs_aux else (False, False)
        if cfg.drafter == AUTO and aux is None:
            use_aux, use_lookup = False, self.method.needs_aux
        if use_aux and aux is None:
            raise OptionError(f"drafter {cfg.drafter} needs an aux model (or use drafter ngram)", "drafter")
        self.aux = aux if use_aux else None
        self.lookup = NgramDrafter() if use_lookup else None
        model = model if model is not None else Model()
        # A seeded adaptive run plans from a frozen copy (its text then depends on the seed only),
        # unless the caller wants it to learn like an unseeded one (``learn``: bench).
        self.model = model.copy(frozen=True) if cfg.seed is not None and cfg.adaptive and not learn else model
        self.gamma_floor: Optional[int] = None  # gamma 'auto': the shortest draft allowed
        self.controller = self._controller()
        # Prompt lookup's controllers, one per match class (ngram.MATCH_EDGES): a copied passage and
        # a chance bigram are accepted at very different rates, so each learns its own.
        self.lookup_controllers = (
            [self._lookup_controller(c) for c in range(len(MATCH_EDGES) + 1)] if self.lookup is not None else []
        )
        self.layout = self.method.layout(self.max_gamma, self.max_width, cfg.tree)
        if self.layout.target_seqs > target.n_seq_max:
            raise OptionError(
                f"{cfg.method} with {self.max_width} beams needs a target context with "
                f"{self.layout.target_seqs} sequences",
                "beam_width",
            )
        room = self._room()
        if len(prompt) > room:
            raise ContextOverflowError(
                f"prompt has {len(prompt)} tokens but the context holds {room} ({self._room_why()}); "
                "shorten it or raise --ctx-size"
            )
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
        self.rng = np.random.default_rng(self.seed)
        self._steps = 0
        self.tokens = list(prompt)
        self.stats = Stats(method=cfg.method, prompt_tokens=len(prompt), seed=self.seed, gamma_min=self.gamma_floor)
        self.drafter: Optional[BeamDrafter] = None
        if self.aux is not None:
            cross = CrossVocab(vocab, target, self.aux) if vocab is not None else None
            self.drafter = BeamDrafter(self.aux, cfg.sampling, self.rng, self.max_width, clock, cross, cfg.no_repeat)
        seen = Seen(REPEAT_N) if cfg.repeat_penalty > 1 and self.method.needs_aux else None
        self.view = StepView(
            target,
            self.tokens,
            cfg.sampling,
            cfg.accept_threshold,
            cfg.tree,
            cfg.verify,
            cfg.repeat_penalty,
            self.rng,
            clock,
            seen,
        )
        self._synced = len(self.tokens)  # committed tokens when the aux last drafted (or was fed the prompt)
        self._ahead: Optional[Ahead] = None  # the next step's draft, made while this one verified
        self._pool: Optional[ThreadPoolExecutor] = None  # draft_ahead's thread
        self.drafts_ahead = cfg.draft_ahead == "on" and self.drafter is not None and not self.method.tree
        if self.drafts_ahead and vocab is not None:
            raise OptionError("draft_ahead needs an aux that shares the target's vocabulary", "draft_ahead")

    def _controller(self) -> Optional[FixedController | Controller]:
        """The aux's: ``--gamma N`` with a fixed width is a controller that always answers (N, w);
        'auto' gamma or width gets the adaptive one, choosing from the ranges the method allows.
        None where no aux drafts (ar, beam's own windows on the target, prompt lookup alone)."""
        cfg, m = self.cfg, self.method
        fixed_width = 1 if not m.uses_beams else cfg.beam_width if isinstance(cfg.beam_width, int) else None
        # Greedy, the text is ar's whatever the width, so a width only sets the speed: up to the one
        # given, the controller picks it (x4 at T = 0, MTAD's 4 beams kept as much as sd's greedy
        # draft, 54.9 % against 54.8 %, for an aux call of 22 ms a depth against 9).
        width_cap = fixed_width if cfg.sampling.greedy and m.uses_beams and fixed_width else None
        fixed_width = None if width_cap else fixed_width
        if not m.needs_aux:  # nothing drafts, so nothing adapts: ar, or beam's own windows on the target
            self.max_gamma, self.max_width = m.fixed_plan(cfg.gamma, cfg.beam_width)
            return FixedController(self.max_gamma, self.max_width)
        if self.aux is None:
            self.max_gamma, self.max_width = cfg.max_gamma, 1
            return None
        self.max_gamma = cfg.max_gamma
        self.max_width = fixed_width or width_cap or self._width_capacity()
        if not cfg.adaptive:
            return FixedController(cfg.max_gamma, self.max_width)
        gammas = range(cfg.max_gamma, cfg.max_gamma + 1)
        if cfg.gamma == AUTO:
            # MTAD's joint floor keeps its joint test joint (``mtad-edge tune`` may measure a lower
            # one for a pair: gamma_min); greedy, every length gives ar's text.
            floor = cfg.gamma_min if cfg.gamma_min is not None else 0 if cfg.sampling.greedy else m.min_auto_gamma
            self.gamma_floor = min(floor, cfg.gamma_max)
            gammas = range(self.gamma_floor, cfg.gamma_max + 1)
        widths = [fixed_width] if fixed_width else list(range(1, self.max_width + 1))
        return Controller(self.model, self._key(), gammas, widths, tree=m.tree)

    def _lookup_controller(self, match: int) -> FixedController | Controller:
        """Prompt lookup's, for lookups of match class ``match``: a free draft of one beam, as long
        as the match allows; 'auto' prices it by its verify alone and may take a plain step where
        its drafts do not pay."""
        cfg = self.cfg
        if not cfg.adaptive:
            return FixedController(cfg.max_gamma, 1)
        gammas = range(0, cfg.max_gamma + 1)
        key = f"{self._key()} lookup m{match}"
        return Controller(self.model, key, gammas, [1], tree=self.method.tree, free=True)

    def _key(self) -> str:
        """What the acceptance a controller learns depends on: the method and its settings."""
        s, cfg = self.cfg.sampling, self.cfg
        return f"{self.method.name} T={s.temperature} k={s.top_k} p={s.top_p} a={cfg.accept_threshold} v={cfg.verify}"

    def _width_capacity(self) -> int:
        """The widest beam the loaded contexts hold ('auto' width picks up to it)."""
        w = (self.aux.n_seq_max - 1) // 2 if self.aux is not None else 1
        if self.method.tree:
            w = min(w, self.target.n_seq_max - 1)
        return max(1, min(w, AUTO_WIDTH_MAX))

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
                between_steps = False
                new = self._step()
                between_steps = True
                out, stop = self._clip(new)
                st.generated += len(out)
                if out:
                    if st.ttft_s is None:
                        st.ttft_s = clock() - t0
                    yield out
                if stop:
                    return
        finally:
            if self._pool is not None:  # a step waits for its draft ahead: the thread is idle here
                self._pool.shutdown()
                self._pool = None
            if not between_steps:  # stopped inside a step: drop what it left half done
                self._drop_caches()
            if self.drafter is not None and self.drafter.cross is not None:
                cross = self.drafter.cross
                st.vocab_resyncs = cross.resyncs
                st.vocab_mapped_share = cross.vmap.coverage_of(self.tokens[st.prompt_tokens :])
            st.wall_s = clock() - t0
            st.other_s = st.wall_s - sum(getattr(st, f) for f in TIMED_FIELDS)

    def _step(self) -> list[int]:
        """Plan (gamma, width) and who drafts, draft, let the method verify, commit what it kept,
        learn."""
        st, clock = self.stats, self.clock
        t0 = clock()
        self._steps += 1
        plan, ctrl, found, idle_lookup = self._plan()
        t1 = clock()
        draft, hidden = None, 0.0
        ahead, self._ahead = self._ahead, None
        if found is not None:
            self._drop(ahead)
            draft = self._lookup_draft(found[: plan.gamma])
        elif plan.gamma and self.drafter is not None:
            hidden = ahead.seconds if ahead is not None else 0.0  # drafted while the last step verified
            draft = self._take(ahead, plan)  # (the rest of it drafted now, in this step's time)
            if draft is None:
                hidden, draft = 0.0, self._draft(plan)
            if plan.alone:  # a tree method verifies the best beam alone where its tree does not pay
                draft = draft.best_only()
                st.alone_steps += 1
        else:
            self._drop(ahead)
        t2 = clock()
        if self.view.seen is not None and draft is not None:
            self.view.seen.sync(self.tokens)
        stop = threading.Event()  # set when the verify is done: the draft ahead pauses at its next depth
        pending = self._draft_ahead(plan, draft, stop)  # None for a lookup draft (deterministic)
        try:
            result = self.method.step(self.view, plan.gamma, plan.width, draft)
        finally:
            stop.set()
            if pending is not None:  # the aux's thread is done before anything touches its cache
                wait([pending])
        t3 = clock()
        nxt = pending.result() if pending is not None else None
        t3b = clock()
        new = self._commit(result, draft, found is not None, nxt)
        t4 = clock()
        self._learn(plan, ctrl, draft, result, t4 - t0 + hidden, idle_lookup)
        st.controller_s += (t1 - t0) + (clock() - t4)
        st.draft_s += t2 - t1 + t3b - t3
        st.verify_s += t3 - t2
        return new

    def _plan(
        self,
    ) -> tuple[Plan, Optional[FixedController | Controller], Optional[np.ndarray], Optional[Controller]]:
        """The step's plan, the controller that made it and, when prompt lookup drafts, its draft:
        lookup where it found a continuation and chose to draft it (a free draft), unless the aux
        plans a draft expected to be faster (with a fixed gamma: wherever it found one); the aux's
        plan otherwise, with the lookup controller it passed over (a plain step teaches it too)."""
        ctrl = self.controller
        cap = self._draft_cap()  # 0 with one token left: the controllers plan a plain step
        found: Optional[Lookup] = None
        lookup: Optional[FixedController | Controller] = None
        if self.lookup is not None:  # a step with no match is planned by the weakest class's controller
            found = self.lookup.lookup(self.tokens, cap)
            lookup = self.lookup_controllers[match_class(found.matched) if found is not None else 0]
        free = lookup.plan(len(found.tokens) if found is not None else 0) if lookup is not None else None
        if free is not None and (ctrl is None or (free.gamma and not isinstance(ctrl, Controller))):
            return free, lookup, found.tokens if found is not None and free.gamma else None, None
        assert ctrl is not None
        plan = ctrl.plan(cap, len(self.tokens) - self._synced)
        if self.drafter is not None and self.drafter.lagging:  # the aux waits for a whole character
            plan = Plan(0, plan.width)
        # Lookup chose to draft over a plain step by its own measure; an aux draft it must outpace.
        if free is not None and free.gamma and (plan.gamma == 0 or free.rate >= plan.rate):
            assert found is not None
            return free, lookup, found.tokens, None
        return plan, ctrl, None, lookup if isinstance(lookup, Controller) else None

    def _draft_cap(self) -> int:
        """The longest draft worth making now: a step commits at most its draft and one token more,
        so a drafting method drafts at most one token fewer than max_tokens leaves (as llama.cpp's
        server caps its drafts); beam's windows are its search, not drafts, and keep their length."""
        if not self.method.needs_aux:
            return self.max_gamma
        left = min(self.cfg.max_tokens - self.stats.generated, self.target.n_positions - len(self.tokens))
        return max(0, min(self.max_gamma, left - 1))

    def _draft(self, plan: Plan) -> Draft:
        assert self.drafter is not None
        return self.drafter.propose(
            self.tokens, plan.gamma, plan.width, self._q_rows, self._keep_going, self._draft_rng(self._steps)
        )

    @property
    def _keep_going(self) -> Optional[Callable[[int, float], bool]]:
        return self.controller.keep_going if isinstance(self.controller, Controller) else None

    def _draft_rng(self, step: int) -> np.random.Generator:
        """The aux's draws at a step: a stream of their own, seeded by the run's seed and the step,
        so that a draft is one function of the seed, the step and the text, whenever it is made
        (draft_ahead makes it a step early). Streams that overlapped (a Philox counter at the step,
        which each draw advances into the next step's) failed the chi-square test of sd."""
        return np.random.default_rng([self.seed, DRAFT_STREAM, step])

    def _draft_ahead(self, plan: Plan, draft: Optional[Draft], stop: threading.Event) -> Optional[Future[Ahead]]:
        """draft_ahead: on the aux's thread, while the target verifies ``draft``, the next step's
        draft as if the target kept all of it (``BeamDrafter.ahead``), planned as this step was;
        None where no next step could take it."""
        if not self.drafts_ahead or draft is None or draft.deterministic or plan.alone:
            return None
        left = self.cfg.max_tokens - self.stats.generated - len(draft.tokens) - 1
        if left < 2 or len(self.tokens) + len(draft.tokens) + 1 > self._room():
            return None
        assert self.drafter is not None
        # Where the costs are known, an aux call that would end after the verify is expected to is
        # not started (the loop would wait for it), and where the guess's call alone would, none is.
        m, until = self.model, None
        if m.target.known and m.aux.known:
            verify = m.target(len(draft.tokens) + 1)
            if verify < m.aux(1):
                return None
            until = (self.clock, self.clock() + verify, m.aux)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mtad-draft-ahead")
        gamma, width = plan.gamma, plan.width
        rng = self._draft_rng(self._steps + 1)
        return self._pool.submit(
            self.drafter.ahead, self.tokens, draft, gamma, width, self._q_rows, self._keep_going, rng, stop, until
        )

    def _take(self, ahead: Optional[Ahead], plan: Plan) -> Optional[Draft]:
        """The draft made ahead, finished, if it is the one this step would make: the same plan,
        and the controller's keep-going questions answered as they were (it has learned since);
        the questions of the depths drafted now are asked now."""
        if ahead is None:
            return None
        keep_going = self._keep_going
        if (plan.gamma, plan.width, plan.alone) != (ahead.gamma, ahead.width, False) or (
            keep_going is not None and any(keep_going(d, cum) != yes for d, cum, yes in ahead.asked)
        ):
            self._drop(ahead)
            return None
        self.stats.ahead_hits += 1
        return ahead.finish()

    def _drop(self, ahead: Optional[Ahead]) -> None:
        """A draft ahead this step does not take: the aux back as the last step's commit leaves it."""
        if ahead is not None and self.drafter is not None:
            self.drafter.drop_ahead(ahead)

    @property
    def _q_rows(self) -> bool:
        """Whether a draft carries its full q rows: for lossless sd when sampling (at temperature
        0 every rule keeps the leading run of the target's argmax and reads no q)."""
        return self.method.wants_q_rows and not self.cfg.sampling.greedy

    def _lookup_draft(self, tokens: np.ndarray) -> Draft:
        """A prompt-lookup draft: deterministic, so q is one-hot on it (log q = 0)."""
        logq_x = np.zeros(len(tokens))
        return Draft(tokens, logq_x, None, tokens[None], logq_x[None], deterministic=True)

    def _commit(
        self, result: StepResult, draft: Optional[Draft], looked_up: bool, ahead: Optional[Ahead] = None
    ) -> list[int]:
        """Keep what the step accepted: the target's sequence 0 keeps the pending token and the k
        accepted drafted tokens, the aux follows, the text grows by the step's tokens. A draft
        made ahead is kept for the next step where its bet came true (the whole draft kept, then
        the guessed token), else undone."""
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
            if looked_up:
                st.lookup_drafted += len(draft.tokens)
                st.lookup_accepted += k
            elif ahead is not None:
                assert self.drafter is not None
                st.ahead_drafts += 1
                if k == len(draft.tokens) and result.tokens[-1] == ahead.guess:
                    self._ahead = ahead  # the aux already holds the text and the next draft's beams
                else:
                    self.drafter.drop_ahead(ahead, k)
            else:
                assert self.drafter is not None
                self.drafter.commit(k, result.beam)
        self.tokens.extend(result.tokens)
        if draft is not None and not looked_up:
            self._synced = len(self.tokens)  # the aux has seen all but the bonus, which it feeds next
        return result.tokens

    def _learn(
        self,
        plan: Plan,
        ctrl: Optional[FixedController | Controller],
        draft: Optional[Draft],
        result: StepResult,
        seconds: float,
        idle_lookup: Optional[Controller] = None,
    ) -> None:
        """Teach the cost tables and the controller that planned the step what its calls took and
        what it delivered."""
        m, st = self.model, self.stats
        calls_s = 0.0
        if draft is not None and ctrl is not None:
            ctrl.observe_beams(plan.width, [n for n, _ in draft.calls[1:]])
            for i, (rows, secs) in enumerate(draft.calls):
                if i == 0:  # after plain steps the first call feeds the committed tokens the aux skipped
                    m.observe_catchup(rows, secs)
                m.aux.observe(rows, secs)
                calls_s += secs
        for call in result.calls:
            (m.tree if call.tree else m.target).observe(call.rows, call.seconds)
            calls_s += call.seconds
        if ctrl is not None:
            if result.tree_nodes is not None:
                ctrl.observe_tree(plan.width, result.tree_nodes)
            if result.alone_accepted is not None and draft is not None:
                ctrl.observe_alone(plan.width, result.alone_accepted, draft.cum_logq)
            k, cum = (result.accepted, draft.cum_logq) if draft is not None else (None, np.zeros(0))
            ctrl.observe_step(plan, k, cum, seconds, calls_s)
        if draft is None and idle_lookup is not None:
            idle_lookup.observe_plain(seconds, plan.timed)  # lookup planned none and the aux stepped plainly
        drafted = len(draft.tokens) if draft is not None else 0
        st.gamma_hist[drafted] = st.gamma_hist.get(drafted, 0) + 1
        if drafted:
            st.width_hist[plan.width] = st.width_hist.get(plan.width, 0) + 1
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
        if self.drafter is not None:
            unfed = self.drafter.start(self.tokens, prefill=self._aux_prefill())
            self._synced = max(0, len(self.tokens) - unfed)

    def _aux_prefill(self) -> bool:
        """Whether the aux is fed the prompt up front: unless, beside prompt lookup, its controller
        has planned no draft for ``AUX_IDLE_PLANS`` steps (where the aux does not pay it may never
        draft in this request; its first draft then feeds it, a catch-up priced like any other)."""
        ctrl = self.controller
        if self.lookup is None or not isinstance(ctrl, Controller):
            return True
        return ctrl.acc.since_draft < AUX_IDLE_PLANS

    def _drop_caches(self) -> None:
        self.target.clear()
        if self.aux is not None:
            self.aux.clear()

    def _room(self) -> int:
        """Committed tokens the contexts can hold with room for one more step, which adds one
        token at least to a run of at most ``n_positions`` (the context size asked for: llama.cpp
        pads a context to 256 cells, and --ctx-size 40 ran 138 tokens)."""
        room = min(self.target.n_positions - 1, self.target.n_ctx - self.layout.target_cells)
        if self.aux is not None:
            room = min(room, self.aux.n_ctx - self.layout.aux_cells)
        return room

    def _room_why(self) -> str:
        """Which context sets ``_room``, and what a step keeps of it (for a refusal's message)."""
        room = self._room()
        if room == self.target.n_positions - 1:
            return f"--ctx-size {self.target.n_positions} less 1 for the answer"
        if self.aux is not None and room < self.target.n_ctx - self.layout.target_cells:
            return f"the aux's {self.aux.n_ctx} cells less {self.layout.aux_cells} for the draft's beams"
        return f"the target's {self.target.n_ctx} cells less {self.layout.target_cells} for a step"

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
