"""``ar``: plain autoregressive sampling from the target, one token per call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..sampling import sample
from . import Layout, Method

if TYPE_CHECKING:
    from ..config import DecodeConfig
    from ..decoding import Generation


class AR(Method):
    name = "ar"
    summary = "target only, one token per call"
    needs_aux = False
    min_auto_gamma = 0

    def layout(self, gamma: int, width: int, cfg: Optional[DecodeConfig] = None) -> Layout:
        return Layout()

    def step(self, run: Generation, gamma: int, width: int) -> list[int]:
        return plain_step(run)


def plain_step(run: Generation) -> list[int]:
    """One target call on the pending token, one sampled token (also what a drafting method
    does when its controller chooses gamma 0)."""
    p = run.target_logp()
    return [sample(p[-1], run.rng)]
