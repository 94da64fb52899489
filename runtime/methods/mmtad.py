"""``mmtad``: MTAD verifying all w final beams at once as a token tree (one target pass), keeping
the best among the deepest passing prefixes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from ..drafter import beam_cells, beam_slots
from ..sampling import filtered_logprobs, sample
from ..tree import TokenTree, TreeVerifier, greedy_tree_accept, mmtad_accept
from . import Layout, Method
from .ar import plain_step
from .mtad import MTAD

if TYPE_CHECKING:
    from ..config import DecodeConfig
    from ..decoding import Generation


class MMTAD(Method):
    min_auto_gamma = MTAD.min_auto_gamma  # a joint draft, as mtad's (see there)
    name = "mmtad"
    summary = "MTAD verifying all beams at once as a tree"
    uses_beams = True
    tree = True

    def layout(self, gamma: int, width: int, cfg: Optional[DecodeConfig] = None) -> Layout:
        # The pending token and up to w x gamma tree nodes; path b in target sequence 1 + b: the w
        # final beams, and in the full tree also every beam that died on the way (w x gamma at most).
        paths = width * gamma if cfg is None or cfg.tree == "full" else width
        return Layout(paths + 1, width * gamma + 1, beam_slots(width), beam_cells(width, gamma))

    def step(self, run: Generation, gamma: int, width: int) -> list[int]:
        if gamma == 0:
            return plain_step(run)
        draft = run.propose(gamma, width)
        paths = draft.paths(full=run.cfg.tree == "full")  # (n, gamma), -1 past a dead end
        tree = TokenTree.from_beams(paths)
        verifier = TreeVerifier(run.target)
        with run.timed("verify_s"):
            t0, pending = run.clock(), len(run.tokens) - len(run.target.held(0))
            p = filtered_logprobs(verifier.logits(run.tokens, tree), run.cfg.sampling)  # row 0: root
            run.observe_target(pending + len(tree), run.clock() - t0, tree=True)
            run.controller.observe_tree(width, [tree.depth.count(d) for d in range(1, paths.shape[1] + 1)])
            rows = tree.parent_rows()  # (n, gamma): the row predicting each beam token
            if run.cfg.sampling.greedy:
                k, b = greedy_tree_accept(paths, np.argmax(p, axis=-1)[rows])
            else:
                logp_x = np.where(paths >= 0, p[rows, np.maximum(paths, 0)], -np.inf)
                k, b = mmtad_accept(np.cumsum(logp_x, axis=1), np.cumsum(draft.logq_x), run.cfg.accept_threshold)
            nxt = sample(p[1 + tree.node_of[b, k - 1] if k else 0], run.rng)
            verifier.adopt(len(run.tokens), b, k, len(paths))
        return run.commit(paths[b], k, nxt, beam=b)
