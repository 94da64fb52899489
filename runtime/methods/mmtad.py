"""``mmtad``: MTAD verifying all w final beams at once as a token tree (one target pass), keeping
the best among the deepest passing prefixes; or, where the controller finds the tree does not pay
for its rows, the best beam alone, as MTAD does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from ..backend import Backend, Batch
from ..drafting.base import Draft
from ..drafting.beams import beam_cells, beam_slots
from ..rules.sampling import Columns, KeptRows, argmax, sample
from ..rules.tree import TokenTree, greedy_tree_accept, mmtad_accept
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
        if run.shape.active:  # each row shaped after its node's path
            logits = run.shape.rows(logits, run.tokens, [(), *tree.paths()])
        greedy = run.sampling.greedy  # p one-hot: each row's argmax is all a rule needs
        if greedy:
            p = argmax(logits)
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


class TreeVerifier:
    """The target's side of MMTAD: one pass over the pending committed token(s) and every tree
    node. Beam b lives in target sequence 1 + b: the pending tokens go into every beam's sequence,
    each node into the sequences of the beams through it, at position = its depth."""

    def __init__(self, target: Backend):
        self.target = target

    def logits(self, tokens: Sequence[int], tree: TokenTree) -> np.ndarray:
        """Raw logits: row 0 predicts depth 1 (after the last committed token), row 1 + i
        predicts the child of node i."""
        target, n = self.target, int(tree.node_of.shape[0])
        held = len(target.held(0))
        for s in range(1, n + 1):
            target.rollback(s, 0)
            target.copy_seq(0, s)
        pending = tokens[held:]
        batch = Batch()
        for i, tok in enumerate(pending):
            batch.add(tok, held + i, range(n + 1), i == len(pending) - 1)
        base = len(tokens)
        for tok, depth, beams in zip(tree.token, tree.depth, tree.beams):
            batch.add(tok, base - 1 + depth, [1 + b for b in beams], True)
        return target.decode(batch)

    def adopt(self, base: int, beam: int, k: int, n_beams: int) -> None:
        """Sequence 0 (holding ``base`` committed tokens) takes beam ``beam``'s first k drafted
        tokens; every beam's sequence is dropped."""
        if k:
            self.target.copy_seq(1 + beam, 0, base, base + k)
        for s in range(1, n_beams + 1):
            self.target.rollback(s, 0)
