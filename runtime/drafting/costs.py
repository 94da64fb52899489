"""What a model call costs on the machine at hand: seconds by rows evaluated, read through the
machine's pace.

The machine's speed drifts (other processes, the OS, heat: a shared VM's plain decoding ran 67 ms
a token, then 88, minutes apart), and the rows one decision compares do not run at the same
moments: plain steps run the target's one row, drafting steps the aux's beams and a verify. Timed
at different moments (a one-row call in a fast spell, a verify in a slow one) they make drafting
look dearer than it is, and a controller that then stops drafting never learns otherwise. So what
an entry learns, it learns from calls made at the same moment as what it is compared with:

- A *moment* is a target call with the aux calls made since the one before: a step's draft and
  its verify, milliseconds apart, at one speed of the machine.
- ``Pace``: the machine's speed now (the last few moments' calls), and the aux's level against the
  target's, learned only from the two models' calls of one moment.
- ``Costs``: one table (target, aux, tree verify): an entry per row count, at pace 1. A new row
  is timed against the calls of its own moment; an aux row learns how it differs from the other aux
  calls of its moment. The target's one-row entry (plain steps') is the anchor: another target row
  learns how it differs from it where it runs between plain steps (a probe), against their mean,
  which a steady drift of the speed cancels. A row run over and over (plain steps) teaches the pace
  alone: nothing beside it tells a change of that row from one of the machine.

All of it in log space, through medians, so one call disturbed by a stall moves nothing.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

PACE_MOMENTS = 3  # moments whose calls' median is the pace: a change of speed shows after two
PACE_READINGS = 3  # readings the pace (and the aux's level) need before they move: one stall moves nothing
AGREE = 0.15  # log difference between readings beyond which they tell of a change, not noise
GAP_WINDOW = 5  # moments whose aux-against-target difference (their median) sets the aux's level
SHAPE_ALPHA = 0.2  # the share of its row's median difference from its neighbours an entry takes, once settled
ROW_WINDOW = 3  # a row's first timings (their median sets it), its last differences (their median moves it)
ONE_POINT_SLOPE = 0.1  # from one timing alone, each further row is guessed to add this share of it
MAX_PENDING = 64  # aux calls kept for the target call that closes their moment

Call = tuple["Costs", int, float]  # a table, the rows, log seconds


class Pace:
    """The machine's speed now (``log``, read through by the target's entries) and the aux's level
    against the target's (``aux``: the aux's entries are read through ``log + aux``).

    ``log`` is the median of the last ``PACE_MOMENTS`` moments' readings (each call's log seconds
    less its entry's, an aux call's less ``aux`` too), or of the target's alone where the two
    models part by more than noise: then one model changed, not the machine. ``aux`` is the median
    of the last ``GAP_WINDOW`` moments' differences between the aux's calls and the target's call
    of the moment, so a change of the machine's speed never moves it, and a change of one model (a
    longer context, a process that slows one more than the other) moves it within three moments."""

    def __init__(self, log: float = 0.0, frozen: bool = False, aux: float = 0.0):
        self.log, self.aux, self.frozen = log, aux, frozen
        # each moment's readings: the target's, the aux's
        self.moments: deque[tuple[list[float], list[float]]] = deque(maxlen=PACE_MOMENTS)
        # per moment: the target's table and rows, and the aux's readings less the target's
        self.gaps: deque[tuple[tuple[str, int], float]] = deque(maxlen=GAP_WINDOW)
        self.pending: list[Call] = []  # this moment's aux calls so far
        self.calls: deque[tuple[int, float]] = deque(maxlen=ROW_WINDOW)  # the last target calls: rows, reading
        self.waiting: Optional[tuple[Costs, int, float, float]] = None  # a row run after plain steps, and their level

    @property
    def factor(self) -> float:
        """The machine's pace: what the target's entries are read through."""
        return math.exp(self.log)

    def level(self, model: str) -> float:
        """The log factor ``model``'s entries are read through."""
        return self.log + self.aux if model == "aux" else self.log

    def gap(self) -> None:
        """The calls before this were made at another time (a previous request: between two requests
        a bench runs other tools): none of the calls to come is compared with them."""
        if not self.frozen:
            self.close(None)
            self.calls.clear()
            self.waiting = None

    def close(self, call: Optional[Call]) -> None:
        """The moment ends with the target's ``call`` (None: with no target call, as when the tables
        are read with aux calls pending): what its calls teach."""
        aux, self.pending = self.pending, []
        if self.frozen or (call is None and not aux):
            return
        settled = [(t, r, x - math.log(t.table[r])) for t, r, x in aux if r in t.table and not t.young(r)]
        target = None  # the target call's reading, where its entry is settled
        if call is not None and call[1] in call[0].table and not call[0].young(call[1]):
            target = call[2] - math.log(call[0].table[call[1]])
        aux_level = None
        if settled:
            # The moment's most called aux row is its reference: the other aux rows learn how they
            # differ from it, and the aux's level against the target's is the gap to it.
            counts: dict[tuple[int, int], int] = {}
            for t, r, _ in settled:
                counts[(id(t), r)] = counts.get((id(t), r), 0) + 1
            ref = max(counts, key=lambda k: (counts[k], -k[1]))
            aux_level = median([y for t, r, y in settled if (id(t), r) == ref])
            for t, r, y in settled:
                if (id(t), r) != ref:
                    t.learn(r, y - aux_level)
            if target is not None:
                gaps = self.gaps
                key = (call[0].kind, call[1]) if call is not None else ("", 0)
                others = [g for k, g in gaps if k != key]
                if call is not None and call[1] != 1 and len(others) >= 2 and max(others) - min(others) <= AGREE:
                    # While the other target rows' gaps to the aux hold still (the aux's level against
                    # the target's), a row whose gap differs differs from them (at this very moment).
                    target -= call[0].learn(call[1], target - (aux_level - median(others)), often=True)
                gaps.append((key, aux_level - target))
                if len(gaps) >= PACE_READINGS:
                    self.aux = median([g for _, g in gaps])
        # This moment's levels, for the entries still set by their first timings, from the calls of
        # this very moment where they tell it: the aux's settled calls (once its level against the
        # target's is measured), its calls on rows the calibration timed (against those timings),
        # the target's settled call; else the pace, a step ago.
        seeded = [x - math.log(t.seed[r]) for t, r, x in aux if r in t.seed]
        if aux_level is not None and len(self.gaps) >= PACE_READINGS:
            target_level = aux_level - self.aux
        elif seeded:
            target_level = median(seeded) - self.aux
        else:
            target_level = target if target is not None else self.log
        own_aux = aux_level if aux_level is not None else target_level + self.aux
        for t, r, x in aux:
            if r not in t.table or t.young(r):
                t.first(r, x - own_aux)
        if call is not None and target is None:
            call[0].first(call[1], call[2] - target_level)
        if call is not None:
            self._bracket(call[0], call[1], target)
        if target is not None or settled:
            self.moments.append(([target] if target is not None else [], [y for _, _, y in settled]))
            self._settle()

    def _bracket(self, costs: Costs, rows: int, reading: Optional[float]) -> None:
        """The one-row entry, plain steps', is the anchor the other target rows are learned against:
        a row run between plain steps (a probe) is compared with the mean of the plain steps on
        either side (a steady drift of the machine's speed cancels), where they agree (no stall or
        change of speed among them)."""
        waiting, self.waiting = self.waiting, None
        calls = self.calls
        if reading is None:
            calls.clear()  # a young entry's call: the calls before it are no longer the ones just before
            return
        if waiting is not None and rows == 1 and abs(reading - waiting[3]) <= AGREE:
            table, r, y, level = waiting
            table.learn(r, y - (level + reading) / 2)
        plain = [y for r, y in calls if r == 1]
        if rows != 1 and len(plain) >= 2 and calls[-1][0] == 1 and max(plain) - min(plain) <= AGREE:
            self.waiting = (costs, rows, reading, median(plain))
        calls.append((rows, reading))

    def _settle(self) -> None:
        """The pace from the last moments' readings: the median of both models' (the aux's in the
        target's frame), while the two agree; where they part by more than noise, one model
        changed (its level is the aux's to learn) and the target's own readings set the pace."""
        mine = [r for own, _ in self.moments for r in own]
        aux = [r - self.aux for _, other in self.moments for r in other]  # in the target's frame
        if len(mine) + len(aux) < PACE_READINGS:
            return
        if len(mine) >= 2 and aux and abs(median(mine) - median(aux)) > AGREE:
            self.log = median(mine)
        else:
            self.log = median(mine + aux)

    def copy(self, frozen: bool) -> Pace:
        """The speed and what it is learned from (the moment in progress ended first)."""
        self.close(None)
        out = Pace(self.log, frozen, self.aux)
        out.moments = deque(((list(a), list(b)) for a, b in self.moments), maxlen=PACE_MOMENTS)
        out.gaps = deque(self.gaps, maxlen=GAP_WINDOW)
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
        self.kind = model  # which table it is ("target", "aux", "tree"): what its rows are told apart by
        self.pace = pace if pace is not None else Pace()
        self.table: dict[int, float] = {}  # seconds by rows, at pace 1
        self._recent: dict[int, deque[float]] = {}  # a row's last log differences from its neighbours
        self._first: dict[int, list[float]] = {}  # a row's first ROW_WINDOW timings, log at pace 1 (fewer: young)
        self._learned: dict[int, int] = {}  # how often a row has learned from its neighbours
        self.seed = dict(seed or {})
        self.prior = _line(self.seed)
        # The calibration's rows are settled entries from the start, so the pace is read against them
        # through the median of a few moments. Anchored on one call before (a calibrated pair's
        # first, how fast the machine ran against the calibration), a request's first verify, which
        # can take twice a settled one (the bundled pair's: 50 ms where it settled at 27), read
        # every row but the one-row call 1.9x dear for the engine's life, and sd seldom drafted.
        for r in self.seed:
            seconds = self._calibrated(r)
            self.table[r], self._first[r] = seconds, [math.log(seconds)] * ROW_WINDOW
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
        out.table, out.frozen, out.kind = dict(self.table), frozen, self.kind
        out._recent = {r: deque(xs, maxlen=ROW_WINDOW) for r, xs in self._recent.items()}
        out._first = {r: list(xs) for r, xs in self._first.items()}
        out._learned = dict(self._learned)
        return out

    def observe(self, rows: int, seconds: float) -> None:
        """A call on ``rows`` took ``seconds``: an aux call waits for the target call that closes
        its moment (the step's verify), a target call closes it."""
        if self.frozen or rows < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        call = (self, rows, math.log(max(seconds, 1e-9)))
        if self.model == "aux":
            self.pace.pending.append(call)
            del self.pace.pending[:-MAX_PENDING]
        else:
            self.pace.close(call)

    def first(self, rows: int, level: float) -> None:
        """One of a row's first timings, ``level`` (log, at pace 1): the first is its entry, then the
        median of three (a stall among them dropped)."""
        first = self._first.setdefault(rows, [])
        if len(first) < ROW_WINDOW:
            first.append(level)
        if rows not in self.table or len(first) == ROW_WINDOW:
            self.table[rows] = math.exp(median(first))

    def learn(self, rows: int, diff: float, often: bool = False) -> float:
        """The row's timing differed by ``diff`` (log) from what it was compared with at its moment:
        its entry moves by the median of its last few such differences, by ``alpha``; fully while
        it has learned little, unless ``often`` (compared at every step, not at rare probes).
        Returns the log shift applied (the differences kept are re-read against the new entry)."""
        if self.frozen or rows not in self.table or self.young(rows):  # its first timings set it
            return 0.0
        recent = self._recent.setdefault(rows, deque(maxlen=ROW_WINDOW))
        recent.append(diff)
        n = self._learned[rows] = self._learned.get(rows, 0) + 1
        alpha = self.alpha if often else max(self.alpha, 1.0 / max(n - 1, 1))
        shift = alpha * median(list(recent) + [0.0] * (ROW_WINDOW - len(recent)))
        if shift:
            self.table[rows] *= math.exp(shift)
            self._recent[rows] = deque((d - shift for d in recent), maxlen=ROW_WINDOW)
        return shift

    def young(self, rows: int) -> bool:
        """Whether the row was timed, but fewer than ``ROW_WINDOW`` times (its entry: its first timing)."""
        return 0 < len(self._first.get(rows, ())) < ROW_WINDOW

    def __call__(self, rows: int) -> float:
        if self.pace.pending:
            self.pace.close(None)  # aux calls with no target call after them: their moment ends
        return self.at_pace_1(max(1, rows)) * math.exp(self.pace.level(self.model))

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
        if entry is not None and not self.young(rows):
            return entry  # measured: the line is not read
        a, b, floor = self._fill()
        line = max(floor, a + b * rows)
        return line if entry is None else min(entry, line)

    def _calibrated(self, rows: int) -> float:
        """What the calibration says a call of ``rows`` costs at pace 1 (it has one): its timing of
        the row, no dearer than the robust line through its timings (a disturbed one), and cheaper
        where it was (the one-row call off a concave shape: 17.7 ms beside the line's 23.1 there);
        the line for a row it did not time. A seeded entry starts here, so its drift from here is
        what the rows run say of the machine against the calibration (``_fill``)."""
        assert self.prior is not None
        a, b = self.prior
        line = max(a + b * rows, 1e-9)
        timed = self.seed.get(rows)
        return line if timed is None else min(timed, line)

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
            # catch-up feeds lie far beyond its beam rows), each against its own timing there (a
            # target's one-row call can lie well off the line through a concave shape); without
            # such rows, any.
            near = [r for r in self.table if r <= self._seed_top] or list(self.table)
            scale = median([self.table[r] / self._calibrated(r) for r in near]) if near else 1.0
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
