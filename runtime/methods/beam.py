"""``beam``: the target's own beam search over windows of gamma tokens, the reference MTAD
approximates.

MTAD drafts gamma tokens by beam search over the *aux's* joint probability and lets the target
veto the draft; ``beam`` runs the same search on the *target* and commits the best window
outright (keep the best joint, commit it, continue). With an aux equal to its target MTAD's
test always passes and the two coincide (MTAD then adds one bonus token per window), so
``beam`` shows how close mtad/mmtad come to the output they aim at, and what that output costs
when the target pays for every depth itself: gamma target calls of w rows per window.

The search is the drafter's (``BeamDrafter``) run on the target: at temperature 0 it is
deterministic top-w beam search over the (top-k/top-p filtered) joint log p; above 0 the w
beams are drawn without replacement in proportion to the tempered joint (beam sampling, as
MTAD's draft). It needs only the target: w beams in two banks of sequences, 2w + 1 in all.

No controller adapts it (there is no draft to tune): the window is the request's ``gamma`` and the
width its ``beam_width``; 'auto' for either means the paper's setting, 4 (the window MTAD's
fixed-gamma defaults drafted), so ``--method beam`` works with the default options.
"""

from __future__ import annotations

from typing import Optional

from ..drafting.aux import BeamDrafter, Draft, beam_cells, beam_slots
from .base import Call, Layout, Method, StepResult, StepView

AUTO_WINDOW = 4  # gamma 'auto' (and width 'auto'): the paper's gamma 4 and beam width 4


class Beam(Method):
    name = "beam"
    summary = "the target's own beam search, gamma tokens a window (what MTAD approximates)"
    needs_aux = False
    uses_beams = True

    def layout(self, gamma: int, width: int, tree: Optional[str] = None) -> Layout:
        # Sequence 0 plus two banks of w beams; the pending token plus the beams' cells.
        return Layout(beam_slots(width), beam_cells(width, gamma))

    def fixed_plan(self, gamma: int | str, width: int | str) -> tuple[int, int]:
        return (gamma if isinstance(gamma, int) else AUTO_WINDOW), (width if isinstance(width, int) else AUTO_WINDOW)

    def step(self, run: StepView, gamma: int, width: int, draft: Optional[Draft]) -> StepResult:
        # A searcher lives for one window only: between windows it holds no state (sequence 0
        # is the committed text, as after any step), so nothing is kept on the shared method.
        search = BeamDrafter(run.target, run.sampling, run.rng, width, clock=run.clock)
        search.start(run.tokens)  # sequence 0 already holds all but the pending token
        found = search.propose(run.tokens, gamma, width)
        window = [int(t) for t in found.tokens]
        # Sequence 0 adopts x_1..x_{gamma-1} of the best beam; x_gamma is the new pending token.
        search.commit(len(window) - 1)
        return StepResult(window, calls=[Call(rows, seconds) for rows, seconds in found.calls])
