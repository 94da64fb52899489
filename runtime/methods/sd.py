"""``sd``: lossless speculative sampling (Leviathan et al. 2023) with one sampled draft."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..drafter import beam_cells, beam_slots
from ..verify import speculative_verify
from . import Layout, Method
from .ar import plain_step

if TYPE_CHECKING:
    from ..config import DecodeConfig
    from ..decoding import Generation


class SD(Method):
    name = "sd"
    summary = "lossless speculative sampling"
    min_auto_gamma = 0

    def layout(self, gamma: int, width: int, cfg: Optional[DecodeConfig] = None) -> Layout:
        return Layout(1, gamma + 1, beam_slots(1), beam_cells(1, gamma))

    def step(self, run: Generation, gamma: int, width: int) -> list[int]:
        if gamma == 0:
            return plain_step(run)
        draft = run.propose(gamma, 1, rows=True)
        assert draft.q_rows is not None
        p = run.target_logp(draft.tokens)
        with run.timed("verify_s"):
            k, nxt = speculative_verify(p, draft.q_rows, draft.tokens, run.rng)
        return run.commit(draft.tokens, k, nxt)
