"""``ar``: plain autoregressive sampling from the target, one token per call."""

from __future__ import annotations

from typing import Optional

from ..drafting.aux import Draft
from .base import Layout, Method, StepResult, StepView, plain_step


class AR(Method):
    name = "ar"
    summary = "target only, one token per call"
    needs_aux = False
    min_auto_gamma = 0

    def layout(self, gamma: int, width: int, tree: Optional[str] = None) -> Layout:
        return Layout()

    def step(self, run: StepView, gamma: int, width: int, draft: Optional[Draft]) -> StepResult:
        return plain_step(run)
