"""The aux model drafts: beam sampling over its joint q (MTAD; one beam for sd), in its own
vocabulary where it speaks another (drafting/cross.py), and with ``--draft-ahead on`` the next block
while the target verifies (drafting/ahead.py). Its controller chooses (gamma, width) each step
from measured costs and acceptance, or answers the request's fixed gamma and width."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from ..backend import Backend
from ..errors import OptionError
from .ahead import Behind, DraftingAhead
from .base import AUTO, AUTO_WIDTH_MAX, Draft, Drafter, Kept, Offer, Run, learn_step
from .beams import BeamDrafter, KeepGoing
from .controller import Controller, FixedController, Plan
from .cross import CrossVocab

# Plain plans in a row after which the aux counts as idle beside a free drafter, and a request
# leaves its prompt unfed until it drafts (fed up front, it doubled the time to the first token of
# the tiny pair, whose aux never pays; at x4, where it does, waiting cost a plain step a request).
AUX_IDLE_PLANS = 8


def aux_rows(shape: str, aux: Backend, width: int) -> int:
    """The rows of every aux call for aux_shape ``shape`` and beams up to ``width`` (0: free):
    'fixed' pads each call to max(width, 2) rows (a depth's beams, and the two tokens pending after
    a draft kept whole); 'auto' is 'fixed' where the aux's calls run as CUDA graphs (llama.cpp's,
    ``graphs``: keeping one shape keeps its graph) and 'free' elsewhere (on a CPU a filler row
    costs what a real one does, and nothing is replayed)."""
    if shape == AUTO:
        shape = "fixed" if getattr(aux, "graphs", False) else "free"
    return max(width, 2) if shape == "fixed" else 0


class AuxDrafter(Drafter):
    name = "aux"

    def __init__(self, run: Run, beside_free: bool = False):
        super().__init__(run)
        assert run.aux is not None
        cfg = run.cfg
        self.beside_free = beside_free  # a free drafter is asked first (its plain steps may leave the aux idle)
        self.ctrl = self._controller()
        self.adaptive = isinstance(self.ctrl, Controller)
        cross = CrossVocab(run.vocab, run.target, run.aux) if run.vocab is not None else None
        self.rows = aux_rows(cfg.aux_shape, run.aux, self.width)
        self.beams = BeamDrafter(
            run.aux,
            cfg.sampling,
            run.rng(0),
            self.width,
            run.clock,
            cross,
            cfg.no_repeat,
            run.shape,
            self.rows,
            self.counters,
        )
        self.synced = 0  # committed tokens when it last drafted (or was fed the prompt)
        self.continues = cross is None  # it drafts after a span in its own first call (the target's tokens)
        self.ahead: Optional[DraftingAhead] = None
        if cfg.draft_ahead == "on" and not run.method.tree:
            if cross is not None:
                raise OptionError("draft_ahead needs an aux that shares the target's vocabulary", "draft_ahead")
            self.ahead = DraftingAhead(self.beams, run, self.counters)

    def _controller(self) -> FixedController | Controller:
        """``--gamma N`` with a fixed width is a controller that always answers (N, w); 'auto' gamma
        or width gets the adaptive one, choosing from the ranges the method allows."""
        run, cfg, m = self.run, self.run.cfg, self.run.method
        fixed_width = 1 if not m.uses_beams else cfg.beam_width if isinstance(cfg.beam_width, int) else None
        # Greedy, the text is ar's whatever the width, so a width only sets the speed: up to the one
        # given, the controller picks it (x4 at T = 0, MTAD's 4 beams kept as much as sd's greedy
        # draft, 54.9 % against 54.8 %, for an aux call of 22 ms a depth against 9).
        width_cap = fixed_width if cfg.sampling.greedy and m.uses_beams and fixed_width else None
        fixed_width = None if width_cap else fixed_width
        self.width = fixed_width or width_cap or self._capacity()
        self.gamma_floor: Optional[int] = None  # gamma 'auto': the shortest draft allowed
        if not cfg.adaptive:
            return FixedController(cfg.max_gamma, self.width)
        gammas = range(cfg.max_gamma, cfg.max_gamma + 1)
        if cfg.gamma == AUTO:
            # MTAD's joint floor keeps its joint test joint (``mtad-edge tune`` may measure a lower
            # one for a pair: gamma_min); greedy, every length gives ar's text.
            floor = cfg.gamma_min if cfg.gamma_min is not None else 0 if cfg.sampling.greedy else m.min_auto_gamma
            self.gamma_floor = min(floor, cfg.gamma_max)
            gammas = range(self.gamma_floor, cfg.gamma_max + 1)
        widths = [fixed_width] if fixed_width else list(range(1, self.width + 1))
        return Controller(run.model, run.key, gammas, widths, tree=m.tree)

    def _capacity(self) -> int:
        """The widest beam the loaded contexts hold ('auto' width picks up to it)."""
        run = self.run
        assert run.aux is not None
        w = (run.aux.n_seq_max - 1) // 2
        if run.method.tree:
            w = min(w, run.target.n_seq_max - 1)
        return max(1, min(w, AUTO_WIDTH_MAX))

    @property
    def keep_going(self) -> Optional[KeepGoing]:
        return self.ctrl.keep_going if self.adaptive else None

    def start(self, tokens: list[int]) -> None:
        unfed = self.beams.start(tokens, prefill=self._prefill())
        self.synced = max(0, len(tokens) - unfed)

    def _prefill(self) -> bool:
        """Whether it is fed the prompt up front: unless, beside a free drafter, its controller has
        planned no draft for ``AUX_IDLE_PLANS`` steps (where the aux does not pay it may never draft
        in this request; its first draft then feeds it, a catch-up priced like any other)."""
        if not self.beside_free or not isinstance(self.ctrl, Controller):
            return True
        return self.ctrl.acc.since_draft < AUX_IDLE_PLANS

    def offer(self, tokens: Sequence[int], cap: int, step: int, after: tuple[int, ...] = ()) -> Offer:
        plan = self.ctrl.plan(cap, len(tokens) - self.synced + len(after))  # a span is fed as a catch-up
        if self.beams.lagging:  # the aux waits for a whole character
            plan = Plan(0, plan.width)
        return Offer(self, plan, after=after)

    def draft(self, offer: Offer, tokens: Sequence[int], step: int) -> Draft:
        plan, after = offer.plan, offer.after
        made = None
        if self.ahead is not None and after:  # a draft made ahead continued the text alone, not a span
            self.ahead.drop()
        elif self.ahead is not None:
            made = self.ahead.take(plan, self.keep_going)
        if made is not None:
            draft, offer.hidden = made
        else:
            rng = self.run.rng(step)
            draft = self.beams.propose(tokens, plan.longest, plan.width, self.run.q_rows, self.keep_going, rng, after)
        if plan.alone:  # a tree method verifies the best beam alone where its tree does not pay
            draft = draft.best_only()
        return draft

    def overlap(self, offer: Offer, draft: Draft, tokens: Sequence[int], step: int) -> Optional[Behind]:
        if self.ahead is None:
            return None
        return self.ahead.start(offer.plan, draft, tokens, step + 1, self.keep_going)

    def passed(self) -> None:
        if self.ahead is not None:
            self.ahead.drop()

    def commit(self, offer: Offer, draft: Draft, kept: Kept, tokens: Sequence[int]) -> None:
        k = kept.accepted
        assert k is not None
        if self.ahead is None or not self.ahead.settle(draft, k, kept.tokens[-1]):
            self.beams.commit(k, kept.beam)
        self.synced = len(tokens) + len(kept.tokens)  # it has seen all but the bonus, which it feeds next

    def observe_calls(self, offer: Offer, draft: Draft) -> float:
        m, calls_s = self.run.model, 0.0
        self.ctrl.observe_beams(offer.plan.width, [n for n, _ in draft.calls[1:]])
        for i, (rows, secs) in enumerate(draft.calls):
            if i == 0:  # after plain steps the first call feeds the committed tokens the aux skipped
                m.observe_catchup(rows, secs)
            m.aux.observe(rows, secs)
            calls_s += secs
        return calls_s

    def learn(self, offer: Offer, draft: Optional[Draft], kept: Kept, seconds: float, calls_s: float) -> None:
        learn_step(self.ctrl, offer.plan, draft, kept, seconds, calls_s)

    def idle(self, seconds: float, timed: bool) -> None:
        if isinstance(self.ctrl, Controller):
            self.ctrl.observe_plain(seconds, timed)

    def room(self, cells: int) -> Optional[tuple[int, str]]:
        aux = self.run.aux
        assert aux is not None
        cells += self.rows  # calls of one shape: a call's filler rows
        return aux.n_ctx - cells, f"the aux's {aux.n_ctx} cells less {cells} for the draft's beams"

    def clear(self) -> None:
        assert self.run.aux is not None
        self.run.aux.clear()

    def finish(self, generated: Sequence[int]) -> None:
        if self.ahead is not None:
            self.ahead.close()
        cross = self.beams.cross
        if cross is not None:
            self.counters["vocab_resyncs"] = cross.resyncs  # target tokens re-tokenised for the aux
            self.counters["vocab_mapped_share"] = cross.vmap.coverage_of(generated)  # the share it could draft
