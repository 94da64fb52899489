"""``sd``: lossless speculative sampling with one draft, verified as a block (Sun et al., ICLR
2025) or token by token (Leviathan et al. 2023); a deterministic draft (prompt lookup) by
drawing the target's token at each depth and keeping the draft while they agree (the same law)."""

from __future__ import annotations

from typing import Optional

from ..drafting.aux import Draft, beam_cells, beam_slots
from ..rules.verify import block_verify, match_verify, speculative_verify
from .base import Layout, Method, StepResult, StepView, greedy_step, plain_step, target_call, target_columns


class SD(Method):
    name = "sd"
    summary = "lossless speculative sampling"
    min_auto_gamma = 0
    wants_q_rows = True

    def layout(self, gamma: int, width: int, tree: Optional[str] = None) -> Layout:
        return Layout(1, gamma + 1, beam_slots(1), beam_cells(1, gamma))

    def step(self, run: StepView, gamma: int, width: int, draft: Optional[Draft]) -> StepResult:
        if draft is None:
            return plain_step(run)
        if run.sampling.greedy:  # p one-hot: both rules keep the leading run of the target's argmax
            return greedy_step(run, draft)
        if draft.deterministic:  # q one-hot: keep the draft while it matches the target's draws
            (k, nxt), call = target_call(
                run, lambda logits: match_verify(logits, draft.tokens, run.sampling, run.rng), draft.tokens
            )
        else:
            assert draft.q is not None
            cols, call = target_columns(run, draft.tokens, draft.q)
            rule = block_verify if run.verify == "block" else speculative_verify
            p, q = cols.rows
            k, j = rule(p, q, cols.column(draft.tokens), run.rng)
            nxt = int(cols.vocab[j])
        return StepResult([*map(int, draft.tokens[:k]), nxt], k, calls=[call])
