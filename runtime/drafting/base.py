"""The drafting protocol: what every drafter does for a step of the loop.

A step (runtime/decoding.py) asks its drafters, through ``Drafters`` (drafting/__init__.py), for
one ``Offer``: a plan for the step (gamma tokens at beam width w, or gamma 0: a plain target
step) with its expected rate. The chosen drafter then

    draft(offer)                    -> the Draft the method verifies
    overlap(offer, draft)           -> work it does while the target verifies (drafting ahead)
    commit(offer, draft, kept)      the target kept ``kept.accepted`` tokens: follow it
    learn(offer, draft, kept, s)    its controller learns what the step cost and delivered

and the drafters it passed over hear ``passed()`` (and ``idle()`` after a plain step). Each
drafter owns its controller(s) and its counters (``Stats.drafters[name]``). Adding one is one
module with a ``Drafter`` subclass and one line in the registry (drafting/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional, Protocol

import numpy as np

from ..backend import Backend
from ..rules.sampling import Filter, KeptRows
from ..rules.shape import Shape
from ..text.constraint import Matcher
from ..text.vocab import VocabMap
from .controller import Controller, FixedController, Model, Plan

AUTO = "auto"  # a gamma or width the controller chooses step by step; the drafter option's default
AUTO_WIDTH_MAX = 4  # the widest beam 'auto' width may pick when nothing larger was loaded
DRAFT_STREAM = 0x6472616674  # "draft": the drafters' random streams, apart from the run's own


@dataclass
class Draft:
    tokens: np.ndarray  # (gamma,) the best beam x*_1..x*_gamma
    logq_x: np.ndarray  # (gamma,) log q_d(x*_d) along it
    q: Optional[KeptRows] = None  # (gamma rows) filtered log q_d along it, when asked for (lossless SD)
    beams: Optional[np.ndarray] = None  # (n, gamma) every final beam (MMTAD's tree)
    beams_logq: Optional[np.ndarray] = None  # (n, gamma) per-token log q along each
    best: int = 0  # index of the best beam in ``beams``
    calls: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds) of each aux step
    dead: Optional[np.ndarray] = None  # (m, gamma) beams that died before the last depth, -1 padded
    deterministic: bool = False  # q one-hot on the tokens (prompt lookup): log q = 0, no q rows

    @classmethod
    def certain(cls, tokens: np.ndarray) -> Draft:
        """A deterministic draft (a function of the text alone): q is one-hot on it, log q = 0."""
        logq_x = np.zeros(len(tokens))
        return cls(tokens, logq_x, None, tokens[None], logq_x[None], deterministic=True)

    def then(self, more: Draft) -> Draft:
        """This deterministic span followed by ``more`` (a draft made after it), verified as one:
        q is one-hot on the span (log q 0, a one-hot q row where ``more`` carries q rows), and
        every beam of ``more`` starts with the span."""
        span, n = np.asarray(self.tokens, dtype=np.int64), len(self.tokens)

        def prefixed(rows: Optional[np.ndarray], pad: float | int) -> Optional[np.ndarray]:
            if rows is None:
                return None
            lead = np.broadcast_to(span if isinstance(pad, int) else np.full(n, pad), (len(rows), n))
            return np.concatenate([lead, rows], axis=1)

        return Draft(
            np.concatenate([span, more.tokens]),
            np.concatenate([np.zeros(n), more.logq_x]),
            None if more.q is None else _one_hot_rows(span, more.q).stacked(more.q),
            prefixed(more.beams, 0),
            prefixed(more.beams_logq, 0.0),
            more.best,
            more.calls,
            prefixed(more.dead, 0),
        )

    def paths(self, full: bool) -> np.ndarray:
        """The beams MMTAD verifies: the final ones, or with ``full`` also those that died earlier
        (the authors' TreeMTADStrategy_v2 verifies every beam alive at every depth)."""
        assert self.beams is not None
        if not full or self.dead is None or not len(self.dead):
            return self.beams
        return np.concatenate([self.beams, self.dead[:, : self.beams.shape[1]]])

    def best_only(self) -> Draft:
        """The best beam alone, for a tree method verifying it as MTAD does (the drafter keeps its
        own index of that beam for ``commit``)."""
        return replace(self, beams=self.tokens[None], beams_logq=self.logq_x[None], best=0, dead=None)

    @property
    def cum_logq(self) -> np.ndarray:
        """Cumulative log q along the best beam, per depth (the draft's own confidence)."""
        return np.cumsum(self.logq_x)


def _one_hot_rows(span: np.ndarray, like: KeptRows) -> KeptRows:
    """q rows one-hot on each token of a span, laid out as ``like`` (whole rows, or as many kept
    ids a row: the span's token and others at -inf)."""
    n = len(span)
    if like.ids is None:
        rows = np.full((n, like.n_vocab), -np.inf)
        rows[np.arange(n), span] = 0.0
        return KeptRows(None, rows, like.n_vocab)
    k = like.ids.shape[-1]
    others = [int(t) for t in like.ids[0]]
    ids = np.array([[t, *[o for o in others if o != t][: k - 1]] for t in span.tolist()], dtype=np.int64)
    logp = np.full(ids.shape, -np.inf)
    logp[:, 0] = 0.0
    return KeptRows(ids, logp, like.n_vocab)


class Verifier(Protocol):
    """What a drafter reads of the method it drafts for (methods/base.py ``Method`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def drafts(self) -> bool: ...

    @property
    def uses_beams(self) -> bool: ...

    @property
    def tree(self) -> bool: ...

    @property
    def wants_q_rows(self) -> bool: ...

    @property
    def min_auto_gamma(self) -> int: ...

    def fixed_plan(self, gamma: int | str, width: int | str) -> tuple[int, int]: ...


class Request(Protocol):
    """What a drafter reads of the request (config.DecodeConfig is one)."""

    @property
    def gamma(self) -> int | str: ...

    @property
    def gamma_max(self) -> int: ...

    @property
    def gamma_min(self) -> Optional[int]: ...

    @property
    def beam_width(self) -> int | str: ...

    @property
    def max_gamma(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    @property
    def adaptive(self) -> bool: ...

    @property
    def sampling(self) -> Filter: ...

    @property
    def no_repeat(self) -> int: ...

    @property
    def draft_ahead(self) -> str: ...

    @property
    def aux_shape(self) -> str: ...

    @property
    def accept_threshold(self) -> float: ...

    @property
    def verify(self) -> str: ...

    @property
    def drafter(self) -> str: ...


class Kept(Protocol):
    """What a drafter reads of a verified step (methods/base.py ``StepResult`` is one)."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def accepted(self) -> Optional[int]: ...

    @property
    def beam(self) -> Optional[int]: ...

    @property
    def tree_nodes(self) -> Optional[list[int]]: ...

    @property
    def alone_accepted(self) -> Optional[int]: ...


def acceptance_key(method: str, cfg: Request) -> str:
    """What the acceptance a controller learns depends on: the method and its settings."""
    s = cfg.sampling
    return f"{method} T={s.temperature} k={s.top_k} p={s.top_p} a={cfg.accept_threshold} v={cfg.verify}"


@dataclass
class Run:
    """What the drafters of one run share: the models, the request, the method it drafts for, what
    is learned about the pair (``model``), the clock and the run's seed."""

    target: Backend
    aux: Optional[Backend]
    cfg: Request
    method: Verifier
    model: Model
    clock: Callable[[], float]
    seed: int
    vocab: Optional[VocabMap] = None  # the aux speaks another vocabulary
    budget: Callable[[], int] = lambda: 0  # tokens the run may still generate (max_tokens)
    space: Callable[[], int] = lambda: 0  # and committed tokens its contexts may still take
    constraint: Optional[Matcher] = None  # a grammar the answer follows (its forced spans)
    shape: Shape = field(default_factory=Shape)  # penalties and the grammar's mask on every row drafted

    @property
    def key(self) -> str:
        return acceptance_key(self.method.name, self.cfg)

    @property
    def q_rows(self) -> bool:
        """Whether a draft carries its full q rows: for lossless sd when sampling (at temperature
        0 every rule keeps the leading run of the target's argmax and reads no q)."""
        return self.method.wants_q_rows and not self.cfg.sampling.greedy

    def rng(self, step: int) -> np.random.Generator:
        """The draws of a drafter at a step: a stream of their own, seeded by the run's seed and
        the step, so that a draft is one function of the seed, the step and the text, whenever it
        is made (drafting ahead makes it a step early). Streams that overlapped (a Philox counter
        at the step, which each draw advances into the next step's) failed the chi-square test of sd."""
        return np.random.default_rng([self.seed, DRAFT_STREAM, step])


@dataclass
class Offer:
    """A drafter's plan for the next step (``plan.gamma`` 0: a plain target step) and, for a draft
    found while planning (prompt lookup), its tokens. ``drafter`` None: nobody drafts (ar, beam)."""

    drafter: Optional[Drafter]
    plan: Plan
    found: Optional[np.ndarray] = None
    hidden: float = 0.0  # seconds of this draft made behind the last verify (drafting ahead), set by draft()
    after: tuple[int, ...] = ()  # a span it continues (drafted by another drafter, verified with it)
    then: Optional[Offer] = None  # a certain span's offer: the offer that continues it in the same verify

    @property
    def drafts(self) -> bool:
        return self.drafter is not None and self.plan.gamma > 0


class Overlap(Protocol):
    """Work a drafter does while the target verifies (drafting ahead): ``join`` waits for it."""

    def join(self) -> None: ...


class Drafter:
    """One source of drafts. ``free``: its drafts cost no model call (it is asked first, and its
    plans are priced by their verify alone). ``adaptive``: its plans carry expected rates, so a
    later drafter's plan can be compared with them (a fixed plan is taken wherever it drafts).
    ``width``: the widest beam it drafts (the contexts' layout)."""

    name: ClassVar[str]
    free: ClassVar[bool] = False
    certain: ClassVar[bool] = False  # its drafts are kept unless the target disagrees (a grammar's forced span)
    continues: bool = False  # it can draft after a certain span in the same step (``offer(after=...)``)
    adaptive: bool = False
    width: int = 1

    def __init__(self, run: Run):
        self.run = run
        self.counters: dict[str, Any] = {"drafted": 0, "accepted": 0, "steps": 0}

    def start(self, tokens: list[int]) -> None:
        """A run begins on committed ``tokens`` (the prompt; the target is prefilled)."""

    def offer(self, tokens: Sequence[int], cap: int, step: int, after: tuple[int, ...] = ()) -> Offer:
        """Its plan for the next step, drafting at most ``cap`` tokens (after the span ``after``,
        for a drafter that ``continues`` one)."""
        raise NotImplementedError

    def draft(self, offer: Offer, tokens: Sequence[int], step: int) -> Draft:
        """The draft of an offer it made and the step took (``offer.plan.gamma`` > 0)."""
        raise NotImplementedError

    def overlap(self, offer: Offer, draft: Draft, tokens: Sequence[int], step: int) -> Optional[Overlap]:
        """Start work beside the target's verify of ``draft`` (None: nothing to do)."""
        return None

    def passed(self) -> None:
        """It drafts nothing this step (another drafter's offer, or a plain step, was taken)."""

    def commit(self, offer: Offer, draft: Draft, kept: Kept, tokens: Sequence[int]) -> None:
        """The target kept ``kept.accepted`` drafted tokens (its cache already cut to them); the
        committed ``tokens`` have not grown by ``kept.tokens`` yet: follow it."""

    def observe_calls(self, offer: Offer, draft: Draft) -> float:
        """Learn what its own calls for ``draft`` cost; their seconds."""
        return 0.0

    def learn(self, offer: Offer, draft: Optional[Draft], kept: Kept, seconds: float, calls_s: float) -> None:
        """The step it planned took ``seconds`` (``calls_s`` of them in model calls)."""

    def idle(self, seconds: float, timed: bool) -> None:
        """A plain step planned by another drafter, where this one too had planned none."""

    def room(self, cells: int) -> Optional[tuple[int, str]]:
        """Committed tokens its model's context can hold beside ``cells`` for a step (None: no bound)."""
        return None

    def clear(self) -> None:
        """Drop its caches (a run stopped inside a step, or one that starts afresh)."""

    def finish(self, generated: Sequence[int]) -> None:
        """The run ended; ``generated``: its tokens (for counters that read them)."""


def learn_step(
    ctrl: FixedController | Controller, plan: Plan, draft: Optional[Draft], kept: Kept, seconds: float, calls_s: float
) -> None:
    """A controller learns what the step it planned delivered: a tree's size, what its best beam
    alone would have kept, the accepted length against the draft's confidence, the seconds."""
    if kept.tree_nodes is not None:
        ctrl.observe_tree(plan.width, kept.tree_nodes)
    if kept.alone_accepted is not None and draft is not None:
        ctrl.observe_alone(plan.width, kept.alone_accepted, draft.cum_logq)
    if draft is not None:
        ctrl.observe_step(plan, kept.accepted, draft.cum_logq, seconds, calls_s)
    else:
        ctrl.observe_step(plan, None, [], seconds, calls_s)
