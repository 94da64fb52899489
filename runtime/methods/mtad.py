"""``mtad``: multi-token assisted decoding (Qin et al., ICLR 2025): beam-sampled draft, joint
acceptance test, one bonus token from the target."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from ..drafter import beam_cells, beam_slots
from ..sampling import sample
from ..verify import greedy_accept_length, mtad_accept_length
from . import Layout, Method
from .ar import plain_step

if TYPE_CHECKING:
    from ..config import DecodeConfig
    from ..decoding import Generation


class MTAD(Method):
    # A short draft makes the joint test less joint and gives MTAD's PPL gain away (one token: a
    # per-token test), so 'auto' drafts at least four tokens when sampling: the paper's gamma, and
    # the reference of the issue's bound (PPL <= 1.05x gamma 4's), which gamma 3 straddles. PPL
    # against gamma 4 on the same prompts and seeds (8 quality prompts x 128 tokens, T=1): on
    # SmolLM2-135M at gamma 1 / 2 / 3, mtad 1.21 / 1.07 / 1.03 and mmtad 1.15 / 1.06 / 1.03 (4
    # seeds); gamma 3 with 6 seeds on another machine, mtad 1.07 and mmtad 1.085 (90 % intervals
    # 1.01-1.13 and 1.04-1.13); on Gemma 3 270M, gamma 3: mtad 1.04, mmtad 1.08 (1.01-1.14). A
    # faster, less joint draft is the user's to ask for (--gamma 3, --gamma-min), or to have
    # measured for the pair at hand (`mtad-edge tune`: mtad_edge/tune.py). README, "Quality".
    min_auto_gamma = 4
    name = "mtad"
    summary = "multi-token assisted decoding: beam draft, joint acceptance"
    uses_beams = True

    def layout(self, gamma: int, width: int, cfg: Optional[DecodeConfig] = None) -> Layout:
        return Layout(1, gamma + 1, beam_slots(width), beam_cells(width, gamma))

    def step(self, run: Generation, gamma: int, width: int) -> list[int]:
        if gamma == 0:
            return plain_step(run)
        draft = run.propose(gamma, width)
        p = run.target_logp(draft.tokens)
        with run.timed("verify_s"):
            n = len(draft.tokens)
            if run.cfg.sampling.greedy:
                k = greedy_accept_length(draft.tokens, np.argmax(p[:n], axis=-1))
            else:
                k = mtad_accept_length(p[np.arange(n), draft.tokens], draft.logq_x, run.cfg.accept_threshold)
            nxt = sample(p[k], run.rng)
        return run.commit(draft.tokens, k, nxt)
