"""Drafting: who proposes the tokens a method verifies, behind one protocol (base.py), picked from
one registry, asked by one composite (``Drafters``) that arbitrates by expected rate.

Adding a drafter is one module with a ``Drafter`` subclass and one line in ``REGISTRY``; the
``drafter`` option's choices come from it ('a+b' joins drafters; 'auto' takes each drafter its
entry wants for the run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Optional

import numpy as np

from ..errors import OptionError
from .aux import AuxDrafter
from .base import AUTO, Draft, Drafter, Kept, Offer, Overlap, Run
from .controller import FixedController, Plan
from .forced import ForcedDrafter
from .lookup import LookupDrafter


@dataclass(frozen=True)
class Entry:
    """A drafter kind: how to build it for a run (``beside_free``: a free drafter is asked before
    it), whether it drafts with the aux model, and whether 'auto' takes it for a run."""

    build: Callable[[Run, bool], Drafter]
    uses_aux_model: bool
    auto: Callable[[Run], bool]


# In the order they are asked: certain spans first (continued by a drafter that can), then free
# drafters (a free draft that pays is taken over a dearer one).
REGISTRY: dict[str, Entry] = {
    # A grammar's forced spans: wherever the request has a constraint.
    "forced": Entry(lambda run, _: ForcedDrafter(run), False, lambda run: run.constraint is not None),
    # Prompt lookup: beside the aux where the controller prices drafts (gamma 'auto'), alone without an aux.
    "ngram": Entry(lambda run, _: LookupDrafter(run), False, lambda run: run.cfg.gamma == AUTO or run.aux is None),
    "aux": Entry(lambda run, free: AuxDrafter(run, free), True, lambda run: run.aux is not None),
}


def choices() -> tuple[str, ...]:
    """The drafter option's values: 'auto', each drafter, and each join of several (registry order)."""
    names = list(REGISTRY)
    joins = ["+".join(c) for n in range(1, len(names) + 1) for c in combinations(names, n)]
    return (AUTO, *joins)


def parse(spec: str) -> list[str]:
    """The drafters an explicit spec ('ngram+aux') names, in asking order."""
    named = set(spec.split("+"))
    return [n for n in REGISTRY if n in named]


def uses_aux_model(spec: str) -> bool:
    """Whether a drafter spec drafts with the aux model ('auto': wherever the pair has one)."""
    return spec == AUTO or any(REGISTRY[n].uses_aux_model for n in parse(spec))


class Drafters:
    """The drafters of one run and the rule that picks the step's offer (``choose``). A method that
    drafts nothing (ar; beam's windows on the target) gets none and its fixed plan every step."""

    def __init__(self, run: Run, drafters: Sequence[Drafter], fixed: Optional[tuple[int, int]] = None):
        self.run, self.drafters = run, list(drafters)
        self._fixed = FixedController(*fixed) if fixed is not None else None
        self.max_gamma = fixed[0] if fixed is not None else run.cfg.max_gamma
        self.max_width = fixed[1] if fixed is not None else max((d.width for d in self.drafters), default=1)
        floors = [f for d in self.drafters if (f := getattr(d, "gamma_floor", None)) is not None]
        self.gamma_floor: Optional[int] = (
            floors[0] if floors else None
        )  # for the stats: the shortest draft 'auto' allows
        self._asked: list[Offer] = []
        self._parts: tuple[Draft, Draft] = (
            Draft.certain(np.zeros(0, dtype=np.int64)),
        ) * 2  # a joined step's span and continuation

    @classmethod
    def build(cls, run: Run) -> Drafters:
        """The request's drafters: those its ``drafter`` option names, or 'auto''s choice."""
        cfg, method = run.cfg, run.method
        if not method.drafts:
            return cls(run, [], method.fixed_plan(cfg.gamma, cfg.beam_width))
        if cfg.drafter == AUTO:
            names = [n for n, e in REGISTRY.items() if e.auto(run)]
        else:
            names = parse(cfg.drafter)
            if run.aux is None and any(REGISTRY[n].uses_aux_model for n in names):
                raise OptionError(f"drafter {cfg.drafter} needs an aux model (or use drafter ngram)", "drafter")
        drafters: list[Drafter] = []
        for name in names:
            drafters.append(REGISTRY[name].build(run, any(d.free for d in drafters)))
        return cls(run, drafters)

    def start(self, tokens: list[int]) -> None:
        for d in self.drafters:
            d.start(tokens)

    def choose(self, tokens: Sequence[int], cap: int, step: int) -> Offer:
        """The step's offer. A certain span (a grammar's forced tokens) is drafted wherever one is
        offered, continued in the same verify by the best offer of the drafters that can draft
        after it. Otherwise each drafter is asked in turn: a later offer replaces the one standing
        unless that one drafts and the later does not, or the later drafts no faster (expected
        tokens per second); where the standing offer drafts, a drafter with a fixed plan (no rate
        to compare) is not asked. Where none drafts, the last plain plan stands."""
        if self._fixed is not None:
            return Offer(None, self._fixed.plan(cap))
        self._asked = []
        span: Optional[Offer] = None
        for d in self.drafters:
            if d.certain and (offer := self._ask(d, tokens, cap, step)).drafts:
                span = offer
                break
        if span is not None:
            assert span.found is not None
            after = tuple(int(t) for t in span.found)
            later = [d for d in self.drafters if d.continues and not d.certain]
            then = self._best(later, tokens, cap - len(after), step, after) if cap > len(after) else None
            self._pass(then)
            if then is None or not then.drafts:
                return span
            plan = replace(then.plan, gamma=len(after) + then.plan.gamma, tokens=then.plan.tokens + len(after))
            return replace(span, plan=plan, then=then)
        chosen = self._best([d for d in self.drafters if not d.certain], tokens, cap, step)
        self._pass(chosen)
        return chosen if chosen is not None else Offer(None, Plan(0, 1))  # a drafting method, nothing to draft with

    def _ask(self, d: Drafter, tokens: Sequence[int], cap: int, step: int, after: tuple[int, ...] = ()) -> Offer:
        offer = d.offer(tokens, cap, step, after)
        self._asked.append(offer)
        return offer

    def _best(
        self, drafters: Sequence[Drafter], tokens: Sequence[int], cap: int, step: int, after: tuple[int, ...] = ()
    ) -> Optional[Offer]:
        """The rule between drafters (``choose``), stated once."""
        chosen: Optional[Offer] = None
        for d in drafters:
            if chosen is not None and chosen.drafts and not d.adaptive:
                break
            offer = self._ask(d, tokens, cap, step, after)
            if chosen is None or not (chosen.drafts and (not offer.drafts or chosen.plan.rate >= offer.plan.rate)):
                chosen = offer
        return chosen

    def _pass(self, chosen: Optional[Offer]) -> None:
        """Every drafter that drafts nothing this step hears it."""
        drafting = chosen.drafter if chosen is not None and chosen.drafts else None
        for d in self.drafters:
            if d is not drafting:
                d.passed()

    def draft(self, offer: Offer, tokens: Sequence[int], step: int) -> Optional[Draft]:
        """The offer's draft (None: a plain step, or a method's own search on the target); a span
        and the draft that continues it as one."""
        if not offer.drafts:
            return None
        assert offer.drafter is not None
        draft = offer.drafter.draft(offer, tokens, step)
        if offer.then is not None:
            assert offer.then.drafter is not None
            self._parts = (draft, offer.then.drafter.draft(offer.then, tokens, step))
            return draft.then(self._parts[1])
        return draft

    def overlap(self, offer: Offer, draft: Optional[Draft], tokens: Sequence[int], step: int) -> Optional[Overlap]:
        if draft is None or offer.drafter is None or offer.then is not None:
            return None
        return offer.drafter.overlap(offer, draft, tokens, step)

    def commit(self, offer: Offer, draft: Optional[Draft], kept: Kept, tokens: Sequence[int]) -> None:
        """The target kept what ``kept`` says: the drafters follow, and their counters count it."""
        if draft is None or offer.drafter is None:
            return
        k = kept.accepted
        assert k is not None
        if offer.then is None:
            self._count(offer.drafter, len(draft.tokens), k)
            offer.drafter.commit(offer, draft, kept, tokens)
            return
        more, n = self._parts[1], len(self._parts[0].tokens)
        assert offer.then.drafter is not None
        self._count(offer.drafter, n, min(k, n))
        self._count(offer.then.drafter, len(more.tokens), max(0, k - n))
        offer.then.drafter.commit(offer.then, more, After(kept, n), tokens)

    @staticmethod
    def _count(drafter: Drafter, drafted: int, accepted: int) -> None:
        c = drafter.counters
        c["steps"] += 1
        c["drafted"] += drafted
        c["accepted"] += accepted

    def learn(
        self, offer: Offer, draft: Optional[Draft], kept: Kept, calls: Sequence[tuple[int, float, bool]], seconds: float
    ) -> None:
        """The cost tables learn the step's calls (``calls``: the target's rows, seconds and whether a
        tree verify), the drafter that planned it what it delivered (after a span, the drafter that
        continued it, where the target kept the span), and the drafters passed over for a plain
        step that they too planned a plain step."""
        m, calls_s = self.run.model, 0.0
        learner, mine, result = offer, draft, kept
        if offer.then is not None:
            learner, mine, result = offer.then, self._parts[1], After(kept, len(self._parts[0].tokens))
        if mine is not None and learner.drafter is not None:
            calls_s += learner.drafter.observe_calls(learner, mine)
        for rows, secs, tree in calls:
            (m.tree if tree else m.target).observe(rows, secs)
            calls_s += secs
        if learner.drafter is not None and (result.accepted is None or result.accepted >= 0):
            learner.drafter.learn(learner, mine, result, seconds, calls_s)
        if draft is None:
            for asked in self._asked:
                if asked is not offer and asked.drafter is not None and not asked.drafts:
                    asked.drafter.idle(seconds, offer.plan.timed)

    def room(self, cells: int) -> Optional[tuple[int, str]]:
        """The tightest bound a drafter's context puts on committed tokens, and why."""
        bounds = [b for d in self.drafters if (b := d.room(cells)) is not None]
        return min(bounds) if bounds else None

    def clear(self) -> None:
        for d in self.drafters:
            d.clear()

    def finish(self, generated: Sequence[int]) -> None:
        for d in self.drafters:
            d.finish(generated)

    def __getitem__(self, name: str) -> Drafter:
        """The run's drafter of this kind (KeyError: none)."""
        for d in self.drafters:
            if d.name == name:
                return d
        raise KeyError(name)

    @property
    def counters(self) -> dict[str, dict[str, object]]:
        return {d.name: d.counters for d in self.drafters}


@dataclass(frozen=True)
class After:
    """A verified step as the drafter that continued a span of n tokens sees it: its own drafted
    tokens kept (negative where the target kept only part of the span)."""

    kept: Kept
    n: int

    @property
    def tokens(self) -> list[int]:
        return self.kept.tokens

    @property
    def accepted(self) -> Optional[int]:
        k = self.kept.accepted
        return None if k is None else k - self.n

    @property
    def beam(self) -> Optional[int]:
        return self.kept.beam

    @property
    def tree_nodes(self) -> Optional[list[int]]:
        nodes = self.kept.tree_nodes
        return None if nodes is None else nodes[self.n :]

    @property
    def alone_accepted(self) -> Optional[int]:
        alone = self.kept.alone_accepted
        return None if alone is None else max(0, alone - self.n)
