"""``mtad``: multi-token assisted decoding (Qin et al., ICLR 2025): beam-sampled draft, joint
acceptance test, one bonus token from the target."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..drafting.aux import Draft, beam_cells, beam_slots
from ..rules.sampling import sample
from ..rules.verify import mtad_accept_length
from .base import Layout, Method, StepResult, StepView, greedy_step, plain_step, repeat_bars, target_columns

# A short draft makes the joint test less joint and gives MTAD's perplexity gain away (one token
# is a per-token test), so gamma 'auto' drafts at least the paper's gamma 4 when sampling, unless
# `mtad-edge tune` measured a shorter floor for the pair (docs/tuning.md has the measurements).
JOINT_FLOOR = 4


class MTAD(Method):
    min_auto_gamma = JOINT_FLOOR
    name = "mtad"
    summary = "multi-token assisted decoding: beam draft, joint acceptance"
    uses_beams = True

    def layout(self, gamma: int, width: int, tree: Optional[str] = None) -> Layout:
        return Layout(1, gamma + 1, beam_slots(width), beam_cells(width, gamma))

    def step(self, run: StepView, gamma: int, width: int, draft: Optional[Draft]) -> StepResult:
        return plain_step(run) if draft is None else joint_step(run, draft)


def joint_step(run: StepView, draft: Draft) -> StepResult:
    """One target call on the draft's best beam, MTAD's joint test on it, the bonus token."""
    if run.sampling.greedy:
        return greedy_step(run, draft)
    cols, call = target_columns(run, draft.tokens)
    (p,) = cols.rows
    logp_x = p[np.arange(len(draft.tokens)), cols.column(draft.tokens)]
    bars = repeat_bars(run, draft.tokens)
    k = mtad_accept_length(logp_x, draft.logq_x, run.accept_threshold, None if bars is None else bars[0])
    nxt = int(cols.vocab[sample(p[k], run.rng)])
    return StepResult([*map(int, draft.tokens[:k]), nxt], k, calls=[call])
