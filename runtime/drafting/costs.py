"""What a model call costs on the machine at hand: seconds by rows evaluated, read through the
machine's pace.

- ``Pace``: how fast the machine runs now against the moment the entries describe, shared by a
  pair's tables. The tables learn only the rows the current mode runs (a plain step: one target
  row; a draft: aux beams and the verify), so without it the rows a mode does not run keep the
  timings of another moment: when the machine slows during plain steps (another process, the OS,
  a longer context), drafting looks cheap, and the other way round.
- ``Costs``: one table (target, aux, tree verify): an entry per row count, at pace 1.

Both learn in log space, through medians, so one call disturbed by a stall moves neither (see
``Pace`` for how the two models' timings combine). An entry learns how its row differs from the
machine's pace (the median of its last three such differences), and only where other rows ran
lately: where one row runs alone (plain steps) nothing tells a change of that row from one of the
machine, and the pace alone follows it. The split between the two therefore cannot wander while the
machine is steady, which would carry the rows not run along with it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

PACE_WINDOW = 7  # calls per model: a change of the machine's speed shows in the pace after four
SHAPE_ALPHA = 0.2  # the share of its row's median difference from the others an entry takes, per call
ROW_WINDOW = 3  # a row's last differences from the other rows, whose median moves its entry
ONE_POINT_SLOPE = 0.1  # from one timing alone, each further row is guessed to add this share of it


Key = tuple[str, int, int]  # (the model timed: "target" or "aux", the table, rows): an entry


class Pace:
    """The machine's speed now, as the log of a factor every entry is read through.

    Per model (the target's tables, the aux's), the median of its last ``PACE_WINDOW`` calls' log
    ratio of what they took to what their entry says at pace 1, once three calls say so. Where both
    models ran lately, the pace is what they agree on (the smaller of the two where both say
    slower, or both faster; else 1): the machine slows both, while a change of one model's calls (a
    longer context, a new kernel path) is that model's entries' to learn. Where one model runs alone
    (plain steps), it alone sets the pace."""

    def __init__(self, log: float = 0.0, frozen: bool = False):
        self.log, self.frozen = log, frozen
        self.recent: dict[str, deque[tuple[Key, float]]] = {}
        self.last: dict[str, int] = {}  # the call count at each model's latest timing
        self.calls = 0

    @property
    def factor(self) -> float:
        return math.exp(self.log)

    def observe(self, key: Key, log_ratio: float) -> None:
        if self.frozen:
            return
        self.calls += 1
        self.recent.setdefault(key[0], deque(maxlen=PACE_WINDOW)).append((key, log_ratio))
        self.last[key[0]] = self.calls
        says = [median([r for _, r in q]) for q in self._live() if len(q) >= 3]
        if says:
            self.log = max(says) if max(says) < 0 else min(says) if min(says) > 0 else 0.0

    def alone(self, key: Key) -> bool:
        """Whether no other entry's timing is among the recent ones (nothing to tell that row
        from the machine)."""
        return all(k == key for q in self._live() for k, _ in q)

    def _live(self) -> list[deque[tuple[Key, float]]]:
        """The models' recent timings, less those of a model not run lately."""
        return [q for m, q in self.recent.items() if self.calls - self.last[m] < 2 * PACE_WINDOW]

    def copy(self, frozen: bool) -> Pace:
        out = Pace(self.log, frozen)
        out.recent = {m: deque(q, maxlen=PACE_WINDOW) for m, q in self.recent.items()}
        out.last, out.calls = dict(self.last), self.calls
        return out


class Costs:
    """Seconds of one call by rows evaluated, read at the current ``pace``.

    Rows decoding has run: an entry per row count, at pace 1. Other rows: the calibration's shape
    (a robust straight line through its points, so one disturbed timing does not matter) scaled by
    how the observed rows compare with it; without a calibration, a robust line through the
    observed rows. A ``Model``'s tables share one pace; a table alone has its own."""

    def __init__(
        self,
        alpha: float = SHAPE_ALPHA,
        seed: Optional[dict[int, float]] = None,
        pace: Optional[Pace] = None,
        model: str = "target",
    ):
        self.alpha, self.model = alpha, model  # model: which the table times, "target" or "aux"
        self.pace = pace if pace is not None else Pace()
        self.table: dict[int, float] = {}  # seconds by rows, at pace 1
        self._recent: dict[int, deque[float]] = {}  # a row's last log differences from the others
        self._first: dict[int, list[float]] = {}  # a row's first ROW_WINDOW timings, log at pace 1 (fewer: young)
        self.seed = dict(seed or {})
        self.prior = _line(self.seed)
        self._seed_top = max(self.seed, default=0)  # the most rows the calibration timed
        self.frozen = False  # a frozen table ignores observations (seeded, reproducible runs)
        self._filled: Optional[tuple[tuple[int, float], tuple[float, float, float]]] = None  # _fill's memo

    @property
    def known(self) -> bool:
        """Whether any timing (observed or calibrated) backs the estimates."""
        return bool(self.table) or self.prior is not None

    def copy(self, frozen: bool, pace: Optional[Pace] = None) -> Costs:
        """The same seed and entries, read through ``pace`` (else a copy of this one's);
        ``frozen``: ignoring further observations."""
        out = Costs(self.alpha, self.seed, pace if pace is not None else self.pace.copy(frozen), self.model)
        out.table, out.frozen = dict(self.table), frozen
        out._recent = {r: deque(xs, maxlen=ROW_WINDOW) for r, xs in self._recent.items()}
        out._first = {r: list(xs) for r, xs in self._first.items()}
        return out

    def observe(self, rows: int, seconds: float) -> None:
        if self.frozen or rows < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        x = math.log(max(seconds, 1e-9))
        old = self.table.get(rows)
        first = self._first.setdefault(rows, [])
        young = len(first) < ROW_WINDOW
        if young:
            first.append(x - self.pace.log)
        if old is None:  # a new row: its entry at pace 1
            self.table[rows] = math.exp(x - self.pace.log)
            return
        key, entry = (self.model, id(self), rows), math.log(old)
        self.pace.observe(key, x - entry)
        if self.pace.alone(key):
            return
        recent = self._recent.setdefault(rows, deque(maxlen=ROW_WINDOW))
        recent.append(x - entry - self.pace.log)
        if young:  # the median of its timings so far: a stall among the first three is dropped
            self.table[rows] = math.exp(median(first))
            return
        shift = median(list(recent) + [0.0] * (ROW_WINDOW - len(recent)))
        self.table[rows] = math.exp(entry + self.alpha * shift)

    def __call__(self, rows: int) -> float:
        return self.at_pace_1(max(1, rows)) * self.pace.factor

    def entries(self) -> dict[int, float]:
        """The observed rows' seconds as they are read now."""
        return {r: self(r) for r in sorted(self.table)}

    def at_pace_1(self, rows: int) -> float:
        """A row's entry, else the line's reading. A young entry (timed fewer than ``ROW_WINDOW``
        times) reads no dearer than the line: an entry first timed in a stall would otherwise keep
        the plans off its row, and so keep itself, for good (seen on x4 at T = 0: 4 rows read
        538 ms beside 3 rows' 337 and 5 rows' 289, and sd drafted 3 tokens at 9 of 271 steps). A
        row timed often keeps what it measured, a kernel's dear shape included."""
        entry = self.table.get(rows)
        if entry is not None and not 0 < len(self._first.get(rows, ())) < ROW_WINDOW:
            return entry  # measured: the line is not read
        a, b, floor = self._fill()
        line = max(floor, a + b * rows)
        return line if entry is None else min(entry, line)

    def _fill(self) -> tuple[float, float, float]:
        """The line rows not in the table (and young entries) are read from, (a, b, floor):
        seconds = max(floor, a + b x rows); robust, so one disturbed entry hardly moves it.
        Recomputed only when the table has changed (controller plans read many rows per step)."""
        key = (len(self.table), sum(self.table.values()))
        if self._filled is not None and self._filled[0] == key:
            return self._filled[1]
        if self.prior is not None:
            a, b = self.prior
            # Rows the calibration covered say how the machine compares with it (an aux's long
            # catch-up feeds lie far beyond its beam rows); without such rows, any.
            near = [r for r in self.table if r <= self._seed_top] or list(self.table)
            scale = median([self.table[r] / max(a + b * r, 1e-12) for r in near]) if near else 1.0
            fill = (a * scale, b * scale, -math.inf)
        else:
            line = _line(self.table)
            # no data at all: proportional, so only ratios matter
            fill = (0.0, 1.0, -math.inf) if line is None else (line[0], line[1], min(self.table.values()))
        self._filled = (key, fill)
        return fill


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _line(points: dict[int, float]) -> Optional[tuple[float, float]]:
    """Theil-Sen: the median of pairwise slopes (never negative) and the median intercept; a
    single point gives a guess of ``ONE_POINT_SLOPE`` of it per row."""
    if not points:
        return None
    xs = sorted(points)
    if len(xs) == 1:
        y = points[xs[0]]
        return y * (1 - ONE_POINT_SLOPE * xs[0]), ONE_POINT_SLOPE * y
    slope = max(0.0, median([(points[b] - points[a]) / (b - a) for i, a in enumerate(xs) for b in xs[i + 1 :]]))
    return median([points[x] - slope * x for x in xs]), slope
