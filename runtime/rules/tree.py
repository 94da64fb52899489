"""MMTAD: the draft beams as a token tree, and the tree acceptance rule (pure numpy).

Notation: beams b = 1..n of length gamma, x_{b,d} their tokens; p = target, q = draft, both
filtered. The tree merges equal prefixes, so one target pass evaluates every distinct node once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..backend import Backend, Batch


@dataclass
class TokenTree:
    """Trie of beams. Node i (0-based) has ``token[i]``, ``depth[i]`` (1..gamma), ``parent[i]``
    (-1 = the root, i.e. the last committed token) and ``beams[i]`` (beam ids through it).
    ``node_of[b, d-1]`` is beam b's node at depth d. Nodes are in breadth-first order."""

    token: list[int]
    depth: list[int]
    parent: list[int]
    beams: list[tuple[int, ...]]
    node_of: np.ndarray

    @classmethod
    def from_beams(cls, beams: np.ndarray) -> TokenTree:
        """The trie of the beams; a beam shorter than the others is padded with -1 (a beam that
        died early, in the full tree), and its padded depths have node -1."""
        n, gamma = beams.shape
        index: dict[tuple[int, ...], int] = {}
        token: list[int] = []
        depth: list[int] = []
        parent: list[int] = []
        members: list[list[int]] = []
        node_of = np.full((n, gamma), -1, dtype=np.int64)
        for d in range(gamma):
            for b in range(n):
                if beams[b, d] < 0:
                    continue
                key = tuple(int(t) for t in beams[b, : d + 1])
                if key not in index:
                    index[key] = len(token)
                    token.append(key[-1])
                    depth.append(d + 1)
                    parent.append(index[key[:-1]] if d else -1)
                    members.append([])
                members[index[key]].append(b)
                node_of[b, d] = index[key]
        return cls(token, depth, parent, [tuple(m) for m in members], node_of)

    def __len__(self) -> int:
        return len(self.token)

    def parent_rows(self) -> np.ndarray:
        """(n, gamma): the logits row predicting x_{b,d}, when row 0 is the root and row
        1 + i is node i."""
        par = np.array(self.parent)[np.maximum(self.node_of, 0)]  # parent node of each (beam, depth)
        return np.where(self.node_of >= 0, par + 1, 0)  # the root (-1) maps to row 0; padding too


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


def mmtad_accept(
    cum_logp: np.ndarray, cum_logq_best: np.ndarray, threshold: float, bars: Optional[np.ndarray] = None
) -> tuple[int, int]:
    """Tree acceptance of MMTAD (the paper's TreeMTADStrategy_v2).

    At depth d, beam b passes when  log p(x_{b,1..d}) - log q(x*_{1..d}) > log(threshold),
    with q taken along the best draft beam x*. The deepest depth with a passing beam wins,
    and among the beams passing there the one with the highest log p(x_{b,1..d}).

    cum_logp: (n, gamma) cumulative target log-probs along each beam; cum_logq_best: (gamma,);
    ``bars``: (n, gamma) added to log(threshold) (a higher bar where a beam repeats itself).
    Returns (k, b): k accepted tokens (0 when nothing passes) of beam b (0 when k is 0).
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    with np.errstate(invalid="ignore"):
        ok = (cum_logp - cum_logq_best[None, :]) > np.log(threshold) + (0.0 if bars is None else bars)
    depths = np.flatnonzero(ok.any(axis=0))
    if not len(depths):
        return 0, 0
    d = int(depths[-1])
    passing = np.flatnonzero(ok[:, d])
    return d + 1, int(passing[np.argmax(cum_logp[passing, d])])


def greedy_tree_accept(beams: np.ndarray, argmax_along: np.ndarray) -> tuple[int, int]:
    """Temperature 0: the beam whose leading run of tokens equal to the target's argmax (along
    its own path) is longest; ties go to the lowest beam id. ``argmax_along``: (n, gamma)."""
    match = np.cumprod(np.asarray(beams) == np.asarray(argmax_along), axis=1).sum(axis=1)
    b = int(np.argmax(match))
    return int(match[b]), b
