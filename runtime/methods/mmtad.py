"""``mmtad``: MTAD verifying all w final beams at once as a token tree (one target pass), keeping
the best among the deepest passing prefixes; or, where the controller finds the tree does not pay
for its rows, the best beam alone, as MTAD does."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..drafting.aux import Draft, beam_cells, beam_slots
from ..rules.sampling import Columns, KeptRows, sample
from ..rules.tree import TokenTree, TreeVerifier, greedy_tree_accept, mmtad_accept
from ..rules.verify import greedy_accept_length, mtad_accept_length
from .base import Call, Layout, Method, StepResult, StepView, plain_step, repeat_bars
from .mtad import JOINT_FLOOR, joint_step


class MMTAD(Method):
    min_auto_gamma = JOINT_FLOOR  # a joint draft, as mtad's
    name = "mmtad"
    summary = "MTAD verifying all beams at once as a tree"
    uses_beams = True
    tree = True

    def layout(self, gamma: int, width: int, tree: Optional[str] = None) -> Layout:
        # The pending token and up to w x gamma tree nodes; path b in target sequence 1 + b: the w
        # final beams, and in the full tree also every beam that died on the way (w x gamma at most).
        paths = width * gamma if tree in (None, "full") else width
        return Layout(paths + 1, width * gamma + 1, beam_slots(width), beam_cells(width, gamma))

    def step(self, run: StepView, gamma: int, width: int, draft: Optional[Draft]) -> StepResult:
        if draft is None:
            return plain_step(run)
        paths = draft.paths(full=run.tree == "full")  # (n, gamma), -1 past a dead end
        if len(paths) == 1:  # one beam (width 1, prompt lookup, the best beam alone): a straight verify
            return joint_step(run, draft)
        tree = TokenTree.from_beams(paths)
        verifier = TreeVerifier(run.target)
        t0, pending = run.clock(), len(run.tokens) - len(run.target.held(0))
        logits = verifier.logits(run.tokens, tree)  # row 0: the root
        greedy = run.sampling.greedy  # p one-hot: each row's argmax is all a rule needs
        if greedy:
            p = np.argmax(logits, axis=-1)
        else:
            cols = Columns.shared(paths, KeptRows.of(logits, run.sampling))
            (p,) = cols.rows
        call = Call(pending + len(tree), run.clock() - t0, tree=True)
        rows = tree.parent_rows()  # (n, gamma): the row predicting each beam token
        best = draft.best  # the final beams come first in paths
        if greedy:
            along = p[rows]  # the target's argmax at each beam token
            k, b = greedy_tree_accept(paths, along)
            alone = greedy_accept_length(paths[best], along[best])
        else:
            logp_x = np.where(paths >= 0, p[rows, cols.column(np.maximum(paths, 0))], -np.inf)
            bars = repeat_bars(run, paths)
            k, b = mmtad_accept(np.cumsum(logp_x, axis=1), np.cumsum(draft.logq_x), run.accept_threshold, bars)
            alone = mtad_accept_length(
                logp_x[best], draft.logq_x, run.accept_threshold, None if bars is None else bars[best]
            )
        row = 1 + tree.node_of[b, k - 1] if k else 0
        nxt = int(p[row]) if greedy else int(cols.vocab[sample(p[row], run.rng)])
        verifier.adopt(len(run.tokens), b, k, len(paths))
        nodes = [tree.depth.count(d) for d in range(1, paths.shape[1] + 1)]
        return StepResult(
            [*map(int, paths[b, :k]), nxt], k, beam=b, calls=[call], tree_nodes=nodes, alone_accepted=alone
        )
