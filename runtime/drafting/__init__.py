"""Drafting: who proposes the tokens a method verifies, behind one protocol (base.py), picked from
one registry, asked by one composite (``Drafters``) that arbitrates by expected rate.

Adding a drafter is one module with a ``Drafter`` subclass and one line in ``REGISTRY``; the
``drafter`` option's choices come from it ('a+b' joins drafters; 'auto' takes each drafter its
entry wants for the run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Optional

from ..errors import OptionError
from .aux import AuxDrafter
from .base import AUTO, Draft, Drafter, Kept, Offer, Overlap, Run
from .controller import FixedController, Plan
from .lookup import LookupDrafter


@dataclass(frozen=True)
class Entry:
    """A drafter kind: how to build it for a run (``beside_free``: a free drafter is asked before
    it), whether it drafts with the aux model, and whether 'auto' takes it for a run."""

    build: Callable[[Run, bool], Drafter]
    uses_aux_model: bool
    auto: Callable[[Run], bool]


# In the order they are asked: free drafters first (a free draft that pays is taken over a dearer one).
REGISTRY: dict[str, Entry] = {
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
        """The step's offer. Each drafter is asked in turn: a later offer replaces the one standing
        unless that one drafts and the later does not, or the later drafts no faster (expected
        tokens per second); where the standing offer drafts, a drafter with a fixed plan (no rate to
        compare) is not asked. Where none drafts, the last plain plan stands."""
        if self._fixed is not None:
            return Offer(None, self._fixed.plan(cap))
        self._asked = []
        chosen: Optional[Offer] = None
        for d in self.drafters:
            if chosen is not None and chosen.drafts and not d.adaptive:
                break
            offer = d.offer(tokens, cap, step)
            self._asked.append(offer)
            if chosen is None or not (chosen.drafts and (not offer.drafts or chosen.plan.rate >= offer.plan.rate)):
                chosen = offer
        if chosen is None:  # no drafter (a drafting method with drafting off)
            return Offer(None, Plan(0, 1))
        for d in self.drafters:
            if d is not chosen.drafter or not chosen.drafts:
                d.passed()
        return chosen

    def draft(self, offer: Offer, tokens: Sequence[int], step: int) -> Optional[Draft]:
        """The offer's draft (None: a plain step, or a method's own search on the target)."""
        if not offer.drafts:
            return None
        assert offer.drafter is not None
        return offer.drafter.draft(offer, tokens, step)

    def overlap(self, offer: Offer, draft: Optional[Draft], tokens: Sequence[int], step: int) -> Optional[Overlap]:
        if draft is None or offer.drafter is None:
            return None
        return offer.drafter.overlap(offer, draft, tokens, step)

    def commit(self, offer: Offer, draft: Optional[Draft], kept: Kept, tokens: Sequence[int]) -> None:
        """The target kept what ``kept`` says: its drafter follows, and its counters count it."""
        if draft is None or offer.drafter is None:
            return
        c, k = offer.drafter.counters, kept.accepted
        assert k is not None
        c["steps"] += 1
        c["drafted"] += len(draft.tokens)
        c["accepted"] += k
        offer.drafter.commit(offer, draft, kept, tokens)

    def learn(
        self, offer: Offer, draft: Optional[Draft], kept: Kept, calls: Sequence[tuple[int, float, bool]], seconds: float
    ) -> None:
        """The cost tables learn the step's calls (``calls``: the target's rows, seconds and whether a
        tree verify), the drafter that planned it what it delivered, and the drafters passed over
        for a plain step that they too planned a plain step."""
        m, calls_s = self.run.model, 0.0
        if draft is not None and offer.drafter is not None:
            calls_s += offer.drafter.observe_calls(offer, draft)
        for rows, secs, tree in calls:
            (m.tree if tree else m.target).observe(rows, secs)
            calls_s += secs
        if offer.drafter is not None:
            offer.drafter.learn(offer, draft, kept, seconds, calls_s)
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
