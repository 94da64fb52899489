"""What every decoding method shares: the step contract and the plain target step.

A method's ``step`` gets a narrow view of the run (``StepView``: the target, the committed tokens,
the request's sampling and acceptance settings, the run's random generator and clock) and the
draft the loop made for it, does its target call and returns a ``StepResult``. It never commits:
the loop (runtime/decoding.py) alone extends the text, cuts the caches to what was accepted,
updates the stats and feeds the controller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Optional, TypeVar

import numpy as np

from ..backend import Backend, TokenIds, feed
from ..drafting.aux import Draft
from ..rules.repeats import Seen
from ..rules.sampling import Columns, Filter, KeptRows, sample_logits
from ..rules.verify import greedy_accept_length

R = TypeVar("R")  # what a step reads from a target call's logits


@dataclass(frozen=True)
class Layout:
    """What one step needs of each model's context, for gamma and width at most as given.
    ``*_cells``: KV cells a step may fill beyond the committed text."""

    target_seqs: int = 1
    target_cells: int = 1
    aux_seqs: int = 0
    aux_cells: int = 0

    def union(self, other: Layout) -> Layout:
        return Layout(*(max(a, b) for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.target_seqs, self.target_cells, self.aux_seqs, self.aux_cells)


@dataclass(frozen=True)
class StepView:
    """What a step may read: ``tokens`` is the committed text (the target's sequence 0 holds all
    of it but the last token, the pending one), never to be changed by a method."""

    target: Backend
    tokens: list[int]
    sampling: Filter
    accept_threshold: float
    tree: str  # MMTAD: "final" or "full"
    verify: str  # sd: "block" or "token"
    repeat_penalty: float  # MTAD: the bar's factor per repeated n-gram (1: off)
    rng: np.random.Generator
    clock: Callable[[], float]
    seen: Optional[Seen] = None  # the text's n-grams, where repeat_penalty asks for them


def repeat_bars(run: StepView, paths: np.ndarray) -> Optional[np.ndarray]:
    """MTAD's extra log bar at each depth of each path (repeat_penalty), or None when off."""
    if run.seen is None or run.repeat_penalty <= 1:
        return None
    paths = np.atleast_2d(paths)
    counts = np.zeros(paths.shape)
    for b, path in enumerate(paths):
        live = path[path >= 0]  # a dead end (the full tree) stops early
        counts[b, : len(live)] = run.seen.repeats(run.tokens, live)
    return np.asarray(np.log(run.repeat_penalty) * counts)


@dataclass(frozen=True)
class Call:
    """One target call: the rows it evaluated and the seconds it took (logits filtered);
    ``tree``: a tree verify (MMTAD), priced in a table of its own."""

    rows: int
    seconds: float
    tree: bool = False


@dataclass
class StepResult:
    """What a step did. ``tokens``: the text it adds (accepted drafted tokens, then the target's
    own token; at least one). ``accepted``: how many drafted tokens were kept (None: no draft).
    ``beam``: the draft beam they came from (None: the best). ``calls``: its target calls.
    ``tree_nodes``: MMTAD's verified tree, nodes per depth. ``alone_accepted``: what the tree's best
    beam would have kept verified alone (MTAD's test), which the controller weighs the tree against."""

    tokens: list[int]
    accepted: Optional[int] = None
    beam: Optional[int] = None
    calls: list[Call] = field(default_factory=list)
    tree_nodes: Optional[list[int]] = None
    alone_accepted: Optional[int] = None


class Method:
    name: ClassVar[str]
    summary: ClassVar[str]  # one line for --help
    needs_aux: ClassVar[bool] = True
    uses_beams: ClassVar[bool] = False  # the beam width applies
    tree: ClassVar[bool] = False  # the target verifies every beam's tree nodes (its rows grow with the width)
    wants_q_rows: ClassVar[bool] = False  # the draft must carry the full q rows along it (lossless sd)
    # The shortest draft gamma 'auto' may choose: 0 (a plain target step) only where skipping the
    # draft leaves the output distribution as it is (lossless sd); MTAD sets 4, a joint draft.
    # Greedy decoding gives ar's text at any length, so there 'auto' starts at 0 for every method.
    min_auto_gamma: ClassVar[int] = 1

    def layout(self, gamma: int, width: int, tree: Optional[str] = None) -> Layout:
        """What one step needs at gamma and width with MMTAD's ``tree`` mode (None: any mode,
        the upper bound the loader sizes contexts for)."""
        raise NotImplementedError

    def fixed_plan(self, gamma: int | str, width: int | str) -> tuple[int, int]:
        """(gamma, width) of every step of a method without an aux, which no controller adapts,
        from the request's gamma and beam width (each an int or 'auto')."""
        return 0, 1

    def step(self, run: StepView, gamma: int, width: int, draft: Optional[Draft]) -> StepResult:
        """One target call on ``draft`` (None: a plain step, or a method drafting on the target)."""
        raise NotImplementedError


def target_call(run: StepView, read: Callable[[np.ndarray], R], draft: TokenIds = ()) -> tuple[R, Call]:
    """One target call on the pending token plus ``draft`` (logits of every draft position plus
    one; the last row alone without a draft), read by ``read`` within the call's timing: what a
    step makes of the rows is part of the call's price."""
    t0, rows = run.clock(), len(run.tokens) - len(run.target.held(0)) + len(draft)
    logits = feed(run.target, run.tokens, draft, logits="all" if len(draft) else "last")
    return read(logits), Call(rows, run.clock() - t0)


def target_columns(run: StepView, draft: np.ndarray, *also: KeptRows) -> tuple[Columns, Call]:
    """Filtered log p for every draft position plus one, on the columns they and ``also`` (the
    draft's own q rows) keep, and the call."""
    return target_call(run, lambda logits: Columns.shared(draft, KeptRows.of(logits, run.sampling), *also), draft)


def greedy_step(run: StepView, draft: Draft) -> StepResult:
    """Temperature 0, one drafted path (sd, mtad): the drafted tokens up to the first that is not
    the target's argmax, then the target's own token there."""
    top, call = target_call(run, lambda logits: np.argmax(logits, axis=-1), draft.tokens)  # p is one-hot
    k = greedy_accept_length(draft.tokens, top)
    return StepResult([*map(int, draft.tokens[:k]), int(top[k])], k, calls=[call])


def plain_step(run: StepView) -> StepResult:
    """One target call on the pending token, one sampled token (ar, and a drafting method's step
    where its controller chose gamma 0)."""
    token, call = target_call(run, lambda logits: sample_logits(logits[-1], run.sampling, run.rng))
    return StepResult([token], calls=[call])
