"""``auto``: the default, a method that never loses to plain decoding. It runs ``mtad`` where the
pair's measured costs (the engine's calibration, and what its requests have taught it) say MTAD's
joint draft pays for itself at its floor, and ``sd`` otherwise, whose controller drafts only where
drafting pays (prompt lookup's free drafts included) and takes plain target steps elsewhere.

Chosen once per request, before it runs (``choose``): the text then follows the chosen method's
rules exactly, and the stats say which it was and why (``Stats.auto``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Optional

from ..drafting.controller import Controller, Model
from ..rules.sampling import Filter
from .base import Layout, Method, StepResult, StepView
from .mtad import MTAD
from .sd import SD

# MTAD is chosen where its best plan is forecast at least this much faster than plain steps (sd
# loses nothing where it is not).
MTAD_MARGIN = 1.05
# Before this engine has drafted with mtad, each depth of its draft is taken to be kept with this
# chance given the one before: block efficiency about 3.4 at gamma 4, as MTAD's joint test kept it
# on both bundled pairs and the x4 stand-in at T = 1 (3.38-3.60, ../docs/standins.md); the
# controller's generic prior (0.6) is a probe's optimism, not a forecast.
MTAD_PRIOR = 0.8


class Auto(Method):
    name = "auto"
    summary = "mtad where this pair's measured costs say it pays, else sd (drafting only where it pays)"
    uses_beams = True
    picks = ("mtad", "sd")  # what it may run: the contexts hold room for both

    def layout(self, gamma: int, width: int, tree: Optional[str] = None) -> Layout:
        return MTAD().layout(gamma, width, tree).union(SD().layout(gamma, width, tree))

    def step(self, run: StepView, gamma: int, width: int, draft: object) -> StepResult:
        raise RuntimeError("method auto is chosen before a run starts (methods/auto.py: choose)")


def choose(
    sampling: Filter, gamma_max: int, width: int, model: Model, aux: bool, key: Callable[[str], str]
) -> tuple[str, str]:
    """(the method to run, why, in a few words) for a request sampling as ``sampling``, drafting up
    to ``gamma_max`` tokens at beam ``width``, on a pair whose costs and acceptance ``model`` holds
    (``key(method)``: the acceptance table a method's controller reads); ``aux``: the pair has one."""
    if not aux:
        return "sd", "no aux model: sd drafts by prompt lookup where that pays, else plain steps"
    if not (model.target.known and model.aux.known):
        return "sd", "this pair's costs are not measured: sd, which drafts only where that pays"
    floor = 0 if sampling.greedy else MTAD.min_auto_gamma
    trial = model.copy(frozen=True)
    learned = model.acceptance.get(key("mtad"))
    if learned is not None:  # what mtad's drafts kept on this pair, read on a copy (planning counts plans)
        trial.acceptance[key("mtad")] = copy.deepcopy(learned)
    else:
        trial.for_key(key("mtad")).prior = MTAD_PRIOR
    ctrl = Controller(trial, key("mtad"), range(min(floor, gamma_max), gamma_max + 1), [width], tree=False)
    plan = ctrl.plan(gamma_max)
    plain = 1.0 / max(model.target(1) + model.overhead, 1e-12)
    x = plan.rate / plain if plan.gamma else 1.0
    if plan.gamma and x >= MTAD_MARGIN:
        return "mtad", f"mtad, forecast {x:.2f}x plain decoding on this pair's measured costs"
    return "sd", f"sd: mtad's draft is forecast {x:.2f}x plain decoding here; sd drafts only where that pays"
