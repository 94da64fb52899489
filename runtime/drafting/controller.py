"""Adaptive drafting: how long a draft (and how wide a beam) pays for itself, step by step.

Pure logic, no model calls. Three small parts:

- ``Costs`` (``costs.py``): wall seconds of one call as a function of the rows it evaluates (one
  table for the target, one for the aux, one for MMTAD's tree verify), learned from the calls
  decoding makes anyway, optionally seeded by a calibration at load time, and read through the
  machine's shared ``Pace``;
- ``Acceptance`` (``acceptance.py``): from the recent steps, the chance that depth d of a draft is
  accepted (``P(k >= d)``, per beam width), the same given the draft's own confidence (the best
  beam's cumulative log q, as llama.cpp's p_min and SpecDec++'s stopping rule use it), and the
  beams a draft keeps alive (what its aux calls cost);
- ``Controller``: before each step, the (gamma, width) that maximises expected committed tokens
  per second, with gamma 0 meaning one plain target step; while drafting, whether one more depth
  is expected to pay for its aux call and its extra verified row.

``FixedController`` always answers the configured gamma and width: ``--gamma N`` is that special
case, not a second loop.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Optional

from .acceptance import PROBE_FIRST, Acceptance, Delivered, Floats
from .costs import Costs, Pace, median

__all__ = ["Acceptance", "Controller", "Costs", "Delivered", "FixedController", "Model", "Pace", "Plan"]


@dataclass
class Plan:
    gamma: int
    width: int
    tokens: float = 0.0  # expected committed tokens (0: no prediction)
    seconds: float = 0.0  # expected wall seconds
    timed: bool = True  # whether timings backed the forecast (else its costs are in rows, not seconds)
    alone: bool = False  # a tree method verifies the best beam alone (MTAD's straight verify)
    reach: int = 0  # the longest the draft may run while keep_going says it pays (0: gamma)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def longest(self) -> int:
        """The most tokens the draft may have: ``gamma``, or its ``reach`` where that is further."""
        return max(self.gamma, self.reach)


class FixedController:
    """Always the configured gamma and width (``--gamma N``): today's behaviour, exactly."""

    def __init__(self, gamma: int, width: int):
        self.gamma, self.width = gamma, width

    def plan(self, max_gamma: int, lag: int = 0) -> Plan:
        return Plan(min(self.gamma, max_gamma), self.width)

    def keep_going(self, depth: int, cum_logq: float) -> bool:
        return True

    def observe_step(
        self, plan: Plan, k: Optional[int], cum_logq: Floats, seconds: float, calls_s: Optional[float] = None
    ) -> None:
        pass

    def observe_beams(self, width: int, rows: Sequence[int]) -> None:
        pass

    def observe_tree(self, width: int, per_depth: Sequence[int]) -> None:
        pass

    def observe_alone(self, width: int, k: int, cum_logq: Floats) -> None:
        pass


@dataclass
class Model:
    """What the controller learns about one loaded pair: call costs, acceptance, the time a step
    spends outside model calls. An engine keeps one, so a chat or a server keeps learning."""

    target: Costs = field(default_factory=Costs)
    aux: Costs = field(default_factory=Costs)
    # MMTAD's tree verify by rows (pending + nodes): a tree mask costs a backend more than a
    # straight draft of as many rows, so it keeps its own table.
    tree: Costs = field(default_factory=Costs)
    acceptance: dict[str, Acceptance] = field(default_factory=dict)  # per method and sampling settings
    overhead: float = 0.0  # seconds a plain step spends outside model calls
    draft_overhead: float = 0.0  # and a drafting step (sampling rows, verifying)
    # The last few steps' seconds outside model calls, plain and drafting: each overhead is their
    # median, so one step disturbed by the OS or the collector does not make drafting look cheap.
    residuals: tuple[deque[float], deque[float]] = field(default_factory=lambda: (_window(), _window()))
    # MMTAD: a tree's nodes at each depth, per (width, depth), learned from every tree that reached
    # it (per draft length, a length reached mostly by drafts cut short was read from their trees)
    nodes: dict[tuple[int, int], float] = field(default_factory=dict)
    frozen: bool = False  # learns no timings: plans depend only on the seed tables and the tokens
    catchup: Optional[float] = None  # seconds per token the aux feeds when it drafts after plain steps, at its pace 1
    pace: Pace = field(default_factory=Pace)  # the machine's speed now, shared by the three tables

    def __post_init__(self) -> None:
        for costs, timed, kind in (
            (self.target, "target", "target"),
            (self.aux, "aux", "aux"),
            (self.tree, "target", "tree"),
        ):
            costs.pace, costs.model, costs.kind = self.pace, timed, kind

    def catchup_s(self, lag: int) -> float:
        """Seconds the aux spends feeding ``lag`` committed tokens it has not seen (the plain steps
        since its last draft) before it can draft: measured, else the slope of its cost line."""
        if lag <= 0:
            return 0.0
        if self.catchup is not None:
            return lag * self.catchup * math.exp(self.pace.level("aux"))
        return lag * max(self.aux(2) - self.aux(1), 0.0)

    def observe_catchup(self, rows: int, seconds: float) -> None:
        """A draft's first aux call fed ``rows`` committed tokens: a catch-up when it fed more than
        steady drafting does (the bonus token, and the last drafted one when all were kept)."""
        if self.frozen or rows < CATCHUP_ROWS or not math.isfinite(seconds):
            return
        # Less the one-row call it includes, once that is measured (else all of it: a bit dear).
        per = max(0.0, seconds - self.aux(1)) / (rows - 1) if 1 in self.aux.table else seconds / rows
        per /= math.exp(self.pace.level("aux"))
        self.catchup = per if self.catchup is None else self.catchup + EMA_ALPHA * (per - self.catchup)

    def observe_overhead(self, drafting: bool, seconds: float) -> None:
        """A step spent ``seconds`` outside its model calls."""
        window = self.residuals[drafting]
        window.append(max(0.0, seconds))
        if drafting:
            self.draft_overhead = median(list(window))
        else:
            self.overhead = median(list(window))

    def for_key(self, key: str) -> Acceptance:
        return self.acceptance.setdefault(key, Acceptance())

    def copy(self, frozen: bool) -> Model:
        """The cost tables as they stand and no acceptance history. Frozen, it is what a seeded
        run plans with, so that its choices (and text) depend on the seed and the tokens only."""
        pace = self.pace.copy(frozen)
        return Model(
            self.target.copy(frozen, pace),
            self.aux.copy(frozen, pace),
            self.tree.copy(frozen, pace),
            pace=pace,
            overhead=self.overhead,
            draft_overhead=self.draft_overhead,
            residuals=(_window(self.residuals[0]), _window(self.residuals[1])),
            frozen=frozen,
            catchup=self.catchup,
        )


def _window(items: Sequence[float] = ()) -> deque[float]:
    return deque(items, maxlen=OVERHEAD_WINDOW)


OVERHEAD_WINDOW = 31  # steps whose time outside model calls sets each overhead (their median)
CATCHUP_ROWS = 3  # a first aux call of at least this many rows fed tokens the aux skipped (steady: 1 or 2)
EMA_ALPHA = 0.2  # the weight of a new reading in the catch-up and tree-size averages (about the last five)
TREE_FILL_GUESS = 0.75  # an unmeasured tree's nodes as a share of gamma x width (beams share prefixes)
PROBE_WIN = 1.25  # a probe re-arms the next one soon when its step ran this much faster than a plain step
SWITCH_HORIZON = 8  # drafting steps over which a switch from plain steps must earn the aux's catch-up
PROBE_BUDGET = 0.015  # and probes may lose at most this share of the time plain steps take between them
PROBE_MAX = 32  # the longest wait between probes; each probe that loses doubles the wait up to it
PROBE_GAMMA = 2  # the shortest probe: one aux call as steady drafting makes it, after the catch-up
PROBE_SOON = 2  # the wait after a probe that beat a plain step clearly (PROBE_WIN)
STRETCH_EVERY = 16  # drafting steps between stretches: one token more than the plan, where that depth is new
STRETCH_TRIES = 8.0  # a depth drafted this often (decayed) is measured: no more stretching to it
# MMTAD: trees verified at a width (decayed) before the best beam alone may replace them there. The
# priors make a tree and its best beam look alike, so unmeasured the cheaper straight verify would win.
TREE_TRIES = 8.0


class Controller:
    """Picks (gamma, width) each step to maximise expected committed tokens per second.

    A step with gamma g >= 1 and width w costs one aux call on the pending token or two
    (``first_aux_s``), g - 1 aux calls of a row per live beam (``beam_calls_s``), one target call on
    ``verify_rows(g, w)`` rows and the per-step overhead; it commits 1 + sum_{d<=g} P(k >= d)
    tokens. Gamma 0 is one target row for one token. A drafting plan's gamma is the best length for
    a draft of average confidence: the draft may run on to the longest allowed (``Plan.reach``)
    while ``keep_going`` finds, from its confidence so far, that another depth pays. Plain and
    drafting steps learn their own overhead (time outside model calls). When gamma 0 wins it still
    drafts now and then, so that acceptance stays measured and a change of regime is noticed: after
    ``PROBE_FIRST`` plain steps, doubling while probes lose, at most every ``PROBE_MAX``, and only
    once the plain steps since the last draft have earned the probe's expected loss at
    ``PROBE_BUDGET``. That loss counts the aux feeding the tokens it skipped (``lag``), which is
    what a probe costs most where drafting does not pay: probes then come early in a request, or not
    at all in a long one, and cost at most a few per cent. A probe drafts ``PROBE_GAMMA`` tokens at
    least, so that an aux call as drafting on would make it is timed beside its verify. One that
    beat a plain step clearly refuted the forecast its loss was priced by: the next comes after
    ``PROBE_SOON`` plain steps, unpriced, and so on while they win, so a controller that stopped
    drafting where drafting now pays is back within a few dozen steps (the forecast alone would wait
    for the budget a long request may never earn).

    A tree method (MMTAD) also weighs, at each width, verifying the best beam alone (``Plan.alone``:
    MTAD's straight verify, fewer rows) against the tree, from what each tree's best beam would
    have kept alone; once ``TREE_TRIES`` trees are measured at that width.
    """

    def __init__(
        self,
        model: Model,
        key: str,
        gammas: range,
        widths: Sequence[int],
        tree: bool,
        free: bool = False,
        pot: Optional[str] = None,
    ):
        self.model, self.acc = model, model.for_key(key)
        # What pays for probes (``Acceptance.plain_s``): one for a run's controllers (``pot``: the key
        # it is kept under), else each earned the run's plain seconds for its own probes, and prompt
        # lookup's and the aux's probes together lost 2-3 % beside plain decoding on the bundled pair.
        self.pot = model.for_key(pot) if pot is not None else self.acc
        model.pace.gap()  # a new request: its calls are not compared with the last one's
        self.acc.follow = gammas[0] >= 1  # no plain steps to lose to optimism (Acceptance.survival)
        self.gammas, self.widths, self.tree = gammas, list(widths), tree
        # A tree method may verify the best beam alone where its tree does not pay: what that keeps
        # is learned apart, from every tree (its best beam's own test) and every such step.
        self.alone: Optional[Acceptance] = model.for_key(f"{key} best beam") if tree else None
        if self.alone is not None:
            self.alone.follow = self.acc.follow
        self.free = free  # drafts cost no aux call (prompt lookup): a step is its verify alone
        self._plan: Optional[Plan] = None
        self._probing = False
        self._stretching = False  # the plan drafts one token more than the best, to measure that depth
        self._lag = 0  # committed tokens the aux had not seen when the last plan was made
        # Within one plan(), while the tables stand still: beam_calls_s by width (summed through
        # each depth), and _first_aux_rows
        self._beam_s: Optional[dict[int, list[float]]] = None
        self._first_aux: Optional[tuple[float, float]] = None
        self._reads: Optional[dict[tuple[str, int], float]] = None  # and each table's seconds by rows

    def table(self, alone: bool) -> Acceptance:
        """What a plan's drafts keep: a tree's (or a straight draft's), or its best beam's alone."""
        return self.alone if alone and self.alone is not None else self.acc

    def verifies(self, width: int) -> tuple[bool, ...]:
        """The verifies a draft at ``width`` may get, as ``Plan.alone``: a tree method's tree or
        its best beam alone (one beam is a path: verified straight, the same test for less)."""
        if not self.tree:
            return (False,)
        return (True,) if width == 1 else (False, True)

    def verify_rows(self, gamma: int, width: int, alone: bool = False) -> int:
        """Rows of the target call: the pending token plus the draft, or plus the tree's nodes."""
        if not self.tree or gamma == 0 or alone:
            return gamma + 1
        return 1 + round(self.nodes(gamma, width))

    def nodes(self, gamma: int, width: int) -> float:
        """A tree's nodes: summed over its depths as measured at ``width``, a depth not measured
        continuing the one before (beams alive per depth), else three quarters of g x w. Every tree
        teaches the depths it reached: learned per draft length, the trees of drafts that stopped
        early (where the aux is unsure, and its beams many) set the price of that length alone."""
        known, total, last = self.model.nodes, 0.0, None
        for d in range(1, gamma + 1):
            last = known.get((width, d), last)
            if last is None:
                return gamma * width * TREE_FILL_GUESS
            total += last
        return total

    def beam_calls_s(self, gamma: int, width: int) -> float:
        """Expected seconds of a draft's aux calls after its first (depths 2..gamma): one row per
        live beam, as this method's drafts at ``width`` have kept them alive at each depth (else
        ``width`` rows)."""
        if gamma < 2:
            return 0.0
        memo = self._beam_s
        cum = memo.get(width) if memo is not None else None
        if cum is None or len(cum) <= gamma:
            cum = self._beam_cum(width, max(gamma, self.gammas[-1]))
            if memo is not None:
                memo[width] = cum
        return cum[gamma]

    def _beam_cum(self, width: int, last: int) -> list[float]:
        """Seconds of the calls after a draft's first, summed through each depth 0..``last``."""
        aux, cum = self.model.aux, [0.0, 0.0]
        for reading in self.acc.beams.readings(width, last):
            call = (
                sum(p * self._read(aux, r) for r, p in enumerate(reading) if p > 0)
                if reading
                else self._read(aux, width)
            )
            cum.append(cum[-1] + call)
        return cum

    def step_seconds(
        self, gamma: int, width: int, lag: int = 0, survivals: Optional[list[float]] = None, alone: bool = False
    ) -> float:
        """Expected wall seconds of a step; ``lag``: committed tokens the aux must feed first;
        ``survivals``: P(k >= j) at ``width`` for j up to at least ``gamma``, if at hand;
        ``alone``: a tree method verifies the best beam alone."""
        m = self.model
        if gamma == 0:
            return self._read(m.target, 1) + m.overhead
        # A tree's price bounds a straight call's of as many rows: until one is measured, its stand-in.
        verify = m.tree if self.tree and m.tree.known and (not alone or not m.target.known) else m.target
        seconds = self._read(verify, self.verify_rows(gamma, width, alone)) + m.draft_overhead
        if self.free:
            return seconds
        first = self.first_aux_s(gamma, width, survivals, alone)
        return seconds + first + self.beam_calls_s(gamma, width) + m.catchup_s(lag)

    def first_aux_s(
        self, gamma: int, width: int, survivals: Optional[list[float]] = None, alone: bool = False
    ) -> float:
        """A draft's first aux call feeds the target's bonus token, and also its last drafted token
        when the whole draft was accepted (no beam's cache holds it): in steady drafting, two rows
        with the chance P(k >= gamma)."""
        one, second = self._first_aux if self._first_aux is not None else self._first_aux_rows()
        whole = survivals[gamma] if survivals is not None else self.table(alone).survival(width, gamma)
        return one + whole * second

    def _first_aux_rows(self) -> tuple[float, float]:
        """The aux's one-row call, and what a second row adds to it."""
        aux = self.model.aux
        one = self._read(aux, 1)
        return one, max(self._read(aux, 2) - one, 0.0)

    def _read(self, costs: Costs, rows: int) -> float:
        """``costs(rows)``, read once per plan (a plan reads a row many times; the tables stand still)."""
        reads = self._reads
        if reads is None:
            return costs(rows)
        key = (costs.kind, rows)
        seconds = reads.get(key)
        if seconds is None:
            seconds = reads[key] = costs(rows)
        return seconds

    def plan(self, max_gamma: int, lag: int = 0) -> Plan:
        """The best (gamma, width) with gamma <= max_gamma, compared as steady drafting would run
        (the aux in step), drafting's rate scaled by how its forecasts have fared (``Delivered``);
        ``lag``: committed tokens the aux has not seen, which a probe pays for and which drafting
        after plain steps must earn back within ``SWITCH_HORIZON`` steps (else, where drafting and
        plain steps nearly tie, switching back and forth pays the aux's catch-up each time)."""
        gammas = [g for g in self.gammas if g <= max_gamma] or [max_gamma]
        self._beam_s, self._reads = {}, {}  # the tables do not change while it plans
        self._first_aux = self._first_aux_rows()
        options = []
        for w in self.widths:
            for alone in self.verifies(w):
                survivals = self.table(alone).survivals(w, gammas[-1])
                tokens = list(accumulate(survivals))  # 1 + sum_{d<=g} P(k >= d): expected tokens at each g
                options += [
                    Plan(g, w, tokens[g], max(self.step_seconds(g, w, 0, survivals, alone), 1e-12), alone=alone)
                    for g in gammas
                ]
        acc = self.acc
        # Each kind's forecasts against what they delivered: both compared at their mean.
        delivered, plain = acc.delivered.factor(), acc.plain_delivered.factor()

        switch = self.model.catchup_s(lag) / SWITCH_HORIZON

        def score(p: Plan) -> float:
            if p.gamma == 0:
                return p.rate * plain
            return p.tokens / (p.seconds + switch) * delivered

        best = max(options, key=score)
        self._probing, self._lag = False, lag
        unknown = not (self.model.aux.known and self.model.target.known)
        if best.gamma == 0:
            acc.since_draft += 1
            # A probe drafts at least PROBE_GAMMA tokens: its aux calls after the first (which feeds
            # the tokens the aux skipped) are what drafting on would make, and they are measured.
            drafts = [p for p in options if p.gamma >= PROBE_GAMMA] or [p for p in options if p.gamma > 0]
            if drafts and acc.since_draft >= acc.probe_every:  # a probe: the best draft, if earned
                probe = max(drafts, key=lambda p: p.rate)
                loss = self.step_seconds(probe.gamma, probe.width, lag, alone=probe.alone)
                loss -= probe.tokens * best.seconds / plain
                # a probe that beat plain steps clearly refuted the forecast this loss comes from
                if unknown or acc.earned or loss <= PROBE_BUDGET * self.pot.plain_s:
                    acc.since_draft, acc.probe_every = 0, min(acc.probe_every * 2, PROBE_MAX)
                    best, self._probing, acc.earned = probe, True, False
        else:
            acc.since_draft, acc.probe_every, acc.earned = 0, PROBE_FIRST, False
            best = self._try_tree(self._stretch(best, options), options)
            if not self._stretching:
                # gamma is the best length for a draft of average confidence; where the aux is surer
                # (or less sure) than average, keep_going lets the draft run on (or stops it). Capped
                # at the forecast's length, drafts at a flat optimum swung with the costs' noise: x4
                # at T = 0 drafted 376-488 tokens over five repeats of the same texts, now 462-519.
                best = replace(best, reach=gammas[-1])
        best.timed = not unknown
        self._plan, self._beam_s, self._first_aux, self._reads = best, None, None, None
        return best

    def _stretch(self, best: Plan, options: list[Plan]) -> Plan:
        """Every ``STRETCH_EVERY`` drafting steps, one token more than the best plan where that
        depth has been drafted fewer than ``STRETCH_TRIES`` times: a few unlucky early drafts
        would otherwise keep a longer draft's acceptance low for good (nothing drafts it again to
        learn better). Its cost is bounded: the depth is measured after a few stretches."""
        acc = self.acc
        acc.since_stretch += 1
        self._stretching = False
        longer = _option(options, best.gamma + 1, best.width, best.alone)
        if longer is None or acc.since_stretch < STRETCH_EVERY:
            return best
        if self.table(best.alone).tries(best.width, longer.gamma) >= STRETCH_TRIES:
            return best
        acc.since_stretch, self._stretching = 0, True
        return longer

    def _try_tree(self, best: Plan, options: list[Plan]) -> Plan:
        """MMTAD: the tree instead of the best beam alone while fewer than ``TREE_TRIES`` trees
        have been verified at that width, so that the two are compared as measured."""
        if not best.alone or best.width == 1 or self.acc.tries(best.width, 1) >= TREE_TRIES:
            return best
        return _option(options, best.gamma, best.width, alone=False) or best

    def keep_going(self, depth: int, cum_logq: float) -> bool:
        """After ``depth`` drafted tokens whose best beam has cumulative log q ``cum_logq``: is
        drafting on expected to raise tokens per second? It is when, for some depth up to the
        plan's longest (its reach: a sure draft runs past its gamma), the tokens it is expected to
        add per extra second beat the step's average so far (the test for a ratio E/T; looking past
        the next depth because a verify's cost grows in steps, a tree's most: depth 3 alone may not
        pay where depths 3 and 4 do). Depth j's chance is P(depth accepted | confidence) x
        P(j accepted | depth accepted)."""
        plan = self._plan
        if plan is None or depth >= plan.longest:
            return False
        floor = max(self.gammas[0], PROBE_GAMMA if self._probing else 0)
        if self._stretching or depth < min(plan.gamma, floor):  # a stretch, a probe, or the method's floor (MTAD: 4)
            return True
        acc, w, alone = self.table(plan.alone), plan.width, plan.alone
        survival = acc.survivals(w, plan.longest)
        now = max(survival[depth], 1e-9)
        sure = acc.given_confidence(w, cum_logq)
        seconds, tokens = self.step_seconds(depth, w, 0, survival, alone), sum(survival[: depth + 1])
        gain = 0.0
        for d in range(depth + 1, plan.longest + 1):
            gain += sure * survival[d] / now
            # (tokens + gain) / step_seconds(d) beats tokens / seconds
            if (tokens + gain) * seconds > tokens * self.step_seconds(d, w, 0, survival, alone):
                return True
        return False

    def observe_step(
        self, plan: Plan, k: Optional[int], cum_logq: Floats, seconds: float, calls_s: Optional[float] = None
    ) -> None:
        """After a step: k accepted tokens (None for a plain step) of a draft whose best beam has
        the given cumulative log q per depth, the step's wall seconds and, where measured, the
        seconds its model calls took (else the cost tables' estimate of them)."""
        m = self.model
        drafted = len(cum_logq) if k is not None else 0
        if k is not None and drafted:
            self.table(plan.alone).observe(plan.width, k, cum_logq)
            # A probe that beat a plain step's speed clearly (tokens per second of that very step,
            # by PROBE_WIN) hints at a new regime: look again soon. One that found tokens but only
            # drew level, or lost, does not (where drafting does not pay, lucky probes would
            # otherwise make a slow draft every few steps).
            # The aux's catching up is left out: drafting on, it would not recur. As in plan(),
            # each side's rate is scaled by what its kind of step delivered on average.
            plain_rate = self.acc.plain_delivered.factor() / max(self.step_seconds(0, 1), 1e-12)
            steady = seconds - m.catchup_s(self._lag)
            rate = (k + 1) / steady * self.acc.delivered.factor() if steady > 0 else 0.0
            if self._probing and rate > PROBE_WIN * plain_rate:
                self.acc.probe_every, self.acc.earned = PROBE_SOON, True
            self.pot.plain_s = 0.0
            if not m.frozen and plan.timed:
                self.acc.delivered.add(steady, self.step_seconds(drafted, plan.width, alone=plan.alone))
        elif k is None:
            self.observe_plain(seconds, plan.timed, own=True)
        if m.frozen:
            return
        if calls_s is None:
            calls_s = self.step_seconds(drafted, plan.width, self._lag, alone=plan.alone)
            calls_s -= m.draft_overhead if drafted else m.overhead
        m.observe_overhead(bool(drafted), seconds - calls_s)

    def observe_plain(self, seconds: float, timed: bool, own: bool = False) -> None:
        """A plain step another controller planned (``timed``: from timings) where this one too
        had planned none (``own``: this one planned it): it teaches this one as its own plain steps
        do, earning the next probe (beside the aux, prompt lookup's classes would otherwise never
        probe again once they stop drafting; a pot shared with the planner is earned by the
        planner, once) and what plain steps deliver against their forecast."""
        if own or self.pot is self.acc:
            self.pot.plain_s += seconds
        if not self.model.frozen and timed:
            self.acc.plain_delivered.add(seconds, self.step_seconds(0, 1))

    def observe_alone(self, width: int, k: int, cum_logq: Floats) -> None:
        """A tree at ``width`` whose best beam, verified alone, would have kept k tokens."""
        if self.alone is not None:
            self.alone.observe(width, k, cum_logq)

    def observe_beams(self, width: int, rows: Sequence[int]) -> None:
        """A draft at ``width`` made aux calls of these rows after its first (its live beams)."""
        self.acc.beams.observe(width, rows)

    def observe_tree(self, width: int, per_depth: Sequence[int]) -> None:
        """A verified tree at ``width`` had these nodes at depths 1, 2, ..."""
        known = self.model.nodes
        for d, n in enumerate(per_depth, start=1):
            old = known.get((width, d))
            known[(width, d)] = n if old is None else old + EMA_ALPHA * (n - old)


def _option(options: list[Plan], gamma: int, width: int, alone: bool) -> Optional[Plan]:
    """The plan among ``options`` with this gamma, width and verify, if there is one."""
    return next((p for p in options if (p.gamma, p.width, p.alone) == (gamma, width, alone)), None)
