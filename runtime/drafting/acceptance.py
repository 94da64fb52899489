"""What drafting delivers, learned from the recent steps: the chance that depth d of a draft is
accepted (``P(k >= d)``, per beam width, and given the draft's own confidence), how many beams a
draft of width w keeps alive, and how long steps took against their forecast.

Pure bookkeeping, no model calls and no clock: all of it depends on the tokens and the timings
it is shown, so the controller (``controller.py``) stays a few small functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

Floats = Union[Sequence[float], np.ndarray]  # per-depth values, as a list or an array


# What a depth's readings keep per verified draft that did not reach it (one of its width that
# stopped short of it, or one of another width): about 35 such drafts halve them, so a depth or a
# width read low long ago leans back towards what the depths before predict (or the prior) and is
# drafted, and measured, again; one drafted all along keeps what it measured.
STALE_DECAY = 0.98
# Upper edges of the bins of the best beam's cumulative log q (the confidence model).
CONF_EDGES = (-4.0, -2.0, -1.0, -0.5, -0.2, 0.0)
PROBE_FIRST = 8  # plain steps before the controller's first probe (and after any drafting step)


def _conf_bin(cum_logq: float) -> int:
    return next((i for i, edge in enumerate(CONF_EDGES) if cum_logq <= edge), len(CONF_EDGES) - 1)


@dataclass
class _Rate:
    """A decaying success rate with a Beta-like prior."""

    hits: float = 0.0
    tries: float = 0.0

    def add(self, hit: bool, decay: float) -> None:
        self.hits = self.hits * decay + (1.0 if hit else 0.0)
        self.tries = self.tries * decay + 1.0

    def fade(self, decay: float) -> None:
        """Older readings count for less, their rate unchanged: the value leans towards what it is
        shrunk to (``Acceptance.survivals``)."""
        self.hits *= decay
        self.tries *= decay

    def value(self, prior: float, weight: float) -> float:
        return (self.hits + prior * weight) / (self.tries + weight)


@dataclass
class Delivered:
    """How long steps of one kind (drafting, or plain) took against their forecast: decayed sums
    of seconds, realised (the aux's catch-up left out) and forecast for the step as made. The
    cost tables and overheads are medians, so they forecast a typical step; a step's mean is what
    tokens per second pay, and near a tie between drafting and plain steps the gap decides (it
    differs between the two kinds of call). ``factor`` scales that kind's forecast rate by
    forecast/realised, within ``DELIVERED_CLAMP`` and shrunk towards 1 while few steps back it.
    Tokens are left to the acceptance model, which learns them directly: counted here too, the
    prior's guesses in a request's first drafts would hold drafting back long after."""

    decay: float = 0.97  # about the last thirty steps of its kind
    sums: list[float] = field(default_factory=lambda: [0.0] * 3)  # seconds, forecast seconds, steps

    def add(self, seconds: float, forecast: float) -> None:
        if seconds > 0 and forecast > 0:
            self.sums = [x * self.decay + y for x, y in zip(self.sums, (seconds, forecast, 1.0))]

    def factor(self) -> float:
        seconds, forecast, n = self.sums
        if n <= 0:
            return 1.0
        lo, hi = DELIVERED_CLAMP
        ratio = min(max(forecast / seconds, lo), hi)
        return float(ratio ** (n / (n + DELIVERED_PRIOR)))


DELIVERED_PRIOR = 5.0  # steps' worth of trust in the forecast itself
DELIVERED_CLAMP = (0.67, 1.5)  # how far what steps delivered may move their forecast (a stall is not a regime)


@dataclass
class Beams:
    """How many beams a draft of width w keeps alive, depth by depth: the rows of its aux calls
    after the first (the call at depth d runs the beams picked at depth d - 1). Top-k / top-p
    filtering of a peaked aux leaves fewer candidates than w, and the next call evaluates only the
    beams picked; one flat spot re-opens them, so deeper calls run more beams, and one pooled count
    would make long drafts look cheap and short ones dear. Decayed counts of each row count, per
    width and depth."""

    decay: float = 0.95
    counts: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (width, depth) -> rows 0..w

    def observe(self, width: int, rows: Sequence[int]) -> None:
        """A draft's aux calls after its first (depths 2, 3, ...) evaluated these rows."""
        for depth, r in enumerate(rows, start=2):
            counts = self.counts.setdefault((width, depth), [0.0] * (width + 1))
            counts[:] = [c * self.decay for c in counts]
            counts[min(max(r, 1), width)] += 1.0

    def readings(self, width: int, last: int) -> list[Optional[list[float]]]:
        """P(rows = r) for r = 0..w at depths 2..``last``, in one pass: a depth's own counts read
        towards the depth before's reading (``BEAMS_PRIOR`` calls' worth), so a depth drafted once
        does not decide alone; a depth never drafted continues the one before; None before any."""
        out: list[Optional[list[float]]] = []
        reading: Optional[list[float]] = None
        for depth in range(2, last + 1):
            counts = self.counts.get((width, depth))
            if counts is not None:
                total = sum(counts)
                if reading is None:
                    reading = [c / total for c in counts]
                else:
                    reading = [(c + BEAMS_PRIOR * p) / (total + BEAMS_PRIOR) for c, p in zip(counts, reading)]
            out.append(reading)
        return out


BEAMS_PRIOR = 2.0  # calls' worth of trust in the depth before's reading of a depth's live beams


@dataclass
class Acceptance:
    """P(k >= d) per beam width from recent steps (each observation decays the older ones by
    ``decay``), P(a depth is accepted | the best beam's cumulative log q through it), and what
    else one method at one set of sampling settings learns: the beams its drafts keep alive, the
    probe schedule, its steps' seconds against their forecasts."""

    decay: float = 0.95
    prior: float = 0.6  # optimistic enough that unexplored depths get tried
    weight: float = 1.0
    depth: dict[tuple[int, int], _Rate] = field(default_factory=dict)  # (width, d) -> rate
    conf: dict[tuple[int, int], _Rate] = field(default_factory=dict)  # (width, bin) -> rate
    # The probe schedule while plain steps win (Controller.plan): kept with the acceptance it
    # measures, so a chat or a server does not start probing afresh with every request.
    since_draft: int = 0
    probe_every: int = PROBE_FIRST
    since_stretch: int = 0  # drafting steps since the last stretch (Controller._stretch)
    plain_s: float = 0.0  # seconds of plain steps since the last draft: what pays for the next probe (Controller.pot)
    earned: bool = False  # the last probe beat a plain step clearly: the next one needs no budget
    delivered: Delivered = field(default_factory=Delivered)  # drafting's time forecasts, as they fared
    plain_delivered: Delivered = field(default_factory=Delivered)  # and plain steps'
    beams: Beams = field(default_factory=Beams)  # the live beams of a draft's aux calls
    # Whether a barely drafted depth is read towards what the depths before it predict (True)
    # or towards ``prior`` alone. Controller sets it: only where every option drafts.
    follow: bool = False

    def observe(self, width: int, k: int, cum_logq: Floats) -> None:
        """A verified draft of len(cum_logq) tokens of which k were accepted. The depths it did not
        reach, at its width and at every other, fade (``STALE_DECAY``): measured in a request's
        first drafts, where the aux and the target agreed least, a depth or a width read low could
        keep the plans off it for good, since nothing drafted it again (seen on x4 at T = 0: sd
        planning one token 411 of 445 steps, P(k >= 2) read 0.07, where drafts of 4 kept 2 or more
        at 0.46 of steps; mtad at width 3 for 322 of 333 steps after one width-1 draft kept none)."""
        n = len(cum_logq)
        for d, c in enumerate(cum_logq, start=1):
            self.depth.setdefault((width, d), _Rate()).add(k >= d, self.decay)
            self.conf.setdefault((width, _conf_bin(c)), _Rate()).add(k >= d, self.decay)
        for (w, d), rate in self.depth.items():
            if w != width or d > n:
                rate.fade(STALE_DECAY)

    def survival(self, width: int, d: int) -> float:
        """P(k >= d) (see ``survivals``)."""
        return self.survivals(width, d)[d]

    def survivals(self, width: int, d: int, borrow: bool = True) -> list[float]:
        """P(k >= j) for j = 0..d, depth by depth. What the depths before predict is the last
        depth-to-depth ratio continued (before any: ``prior``) or, where another width is measured
        (``borrow``), that width's ratio from j - 1 to j continued from this width's j - 1 (at
        j = 1: its P(k >= 1)). A depth never drafted gets that prediction; a drafted one its own
        rate, shrunk towards it (a borrowed prediction is a measurement: as it stands) or towards
        the lower of ``prior`` and the ratio's guess or, with ``follow``, the higher. The lower one
        reads a barely drafted depth low where nearly every drafted token is kept; where plain
        steps are an option that caution is kept, since optimism there makes drafting lose to
        plain steps (a depth whose readings faded would otherwise read ``prior`` deep in a draft
        where the depths before predict far less). Borrowing lets a width read low in a few early
        drafts, then faded, lean back towards what the width drafted since keeps, and be tried again
        (seen on x4 at T = 0: width 1 read as the prior's ratio continued, 0.50, 0.20, 0.07, beside
        width 3's measured 0.78, 0.67, 0.56, and mtad drafted at width 3 for good)."""
        other = self._reference(width) if borrow else None
        ref = self.survivals(other, d, borrow=False) if other is not None else None
        out = [1.0]
        s, before = 1.0, 1.0  # P(k >= j - 1), P(k >= j - 2)
        for j in range(1, d + 1):
            rate = self.depth.get((width, j))
            if ref is not None:
                toward = s * ref[j] / max(ref[j - 1], 1e-9)
                if self.follow:
                    toward = max(self.prior, toward)
                guess = toward
            else:
                guess = s * min(s / max(before, 1e-9), 1.0) if j > 1 else self.prior
                toward = max(self.prior, guess) if self.follow else min(self.prior, guess)
            before, s = s, rate.value(toward, self.weight) if rate else guess
            out.append(s)
        return out

    def _reference(self, width: int) -> Optional[int]:
        """The other width drafted most (decayed tries at depth 1), if any."""
        tries = {w: rate.tries for (w, d), rate in self.depth.items() if d == 1 and w != width}
        return max(tries, key=lambda w: (tries[w], -w)) if tries else None

    def tries(self, width: int, d: int) -> float:
        """How often (decayed) depth d was drafted at ``width``."""
        rate = self.depth.get((width, d))
        return rate.tries if rate else 0.0

    def given_confidence(self, width: int, cum_logq: float) -> float:
        """P(a drafted depth is accepted | the best beam's cumulative log q through it)."""
        rate = self.conf.get((width, _conf_bin(cum_logq)))
        return rate.value(self.prior, self.weight) if rate else self.prior
