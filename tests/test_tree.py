"""MMTAD's token tree and tree acceptance rule, by hand-computed cases."""

import numpy as np
import pytest

from mtad_edge.runtime.rules.tree import TokenTree, greedy_tree_accept, mmtad_accept

L = np.log


def test_tree_merges_shared_prefixes():
    beams = np.array([[5, 6, 7], [5, 6, 8], [5, 9, 7], [2, 6, 7]])
    t = TokenTree.from_beams(beams)
    # depth 1: 5, 2; depth 2: 5-6, 5-9, 2-6; depth 3: four leaves
    assert len(t) == 2 + 3 + 4
    assert t.depth == [1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert t.beams[t.node_of[0, 0]] == (0, 1, 2) and t.beams[t.node_of[0, 1]] == (0, 1)
    for b in range(4):  # walking parents from each leaf spells the beam
        path, node = [], t.node_of[b, 2]
        while node != -1:
            path.append(t.token[node])
            node = t.parent[node]
        assert path[::-1] == beams[b].tolist()
    rows = t.parent_rows()
    assert rows[:, 0].tolist() == [0, 0, 0, 0]  # depth-1 tokens are predicted by the root row
    assert rows[1, 2] == 1 + t.node_of[1, 1]


def test_beams_that_died_early_are_padded_paths_of_the_full_tree():
    paths = np.array([[5, 6, 7], [5, 9, 7], [2, -1, -1], [5, 4, -1]])  # two final beams, two dead ends
    t = TokenTree.from_beams(paths)
    assert len(t) == 2 + 3 + 2 and t.node_of[2].tolist()[1:] == [-1, -1] and t.node_of[3, 2] == -1
    assert t.beams[t.node_of[0, 0]] == (0, 1, 3)  # "5" lies on three paths
    rows = t.parent_rows()
    assert rows[2].tolist() == [0, 0, 0] and rows[3, 1] == 1 + t.node_of[3, 0]


def test_identical_beams_make_a_single_path():
    t = TokenTree.from_beams(np.array([[1, 2], [1, 2]]))
    assert len(t) == 2 and t.beams == [(0, 1), (0, 1)]


def test_mmtad_deepest_passing_depth_then_highest_log_p():
    cum_q = np.cumsum(L([0.5, 0.5, 0.5]))  # best beam's joint q: 0.5, 0.25, 0.125
    cum_p = np.cumsum(
        L(
            np.array(
                [
                    [0.5, 0.1, 0.9],  # ratios 1.0, 0.2, 0.36 -> passes d1 only
                    [0.4, 0.4, 0.3],  # 0.8, 0.64, 0.384 -> passes d1, d2
                    [0.45, 0.5, 0.2],
                ]
            )
        ),
        axis=1,
    )  # 0.9, 0.9, 0.36 -> d1, d2
    k, b = mmtad_accept(cum_p, cum_q, 0.5)
    assert k == 2 and b == 2  # at depth 2 beams 1 and 2 pass; beam 2 has the higher joint p


def test_mmtad_nothing_passes_and_threshold_strictness():
    cum_q = np.zeros(2)
    cum_p = np.array([[L(0.5), L(0.5)], [L(0.2), L(0.1)]])
    assert mmtad_accept(cum_p, cum_q, 0.5) == (0, 0)  # 0.5 is not > 0.5
    assert mmtad_accept(cum_p, cum_q, 0.4) == (2, 0)
    with pytest.raises(ValueError):
        mmtad_accept(cum_p, cum_q, 0.0)


def test_mmtad_later_depth_can_pass_after_earlier_failure():
    cum_q = np.cumsum(L([0.5, 0.5]))
    cum_p = np.cumsum(L(np.array([[0.2, 0.9]])), axis=1)  # ratios 0.4 (fail), 0.72 (pass)
    assert mmtad_accept(cum_p, cum_q, 0.5) == (2, 0)


def test_greedy_tree_accept_longest_matching_beam():
    beams = np.array([[1, 2, 3], [1, 4, 5], [1, 4, 6]])
    argmax = np.array([[1, 4, 0], [1, 4, 6], [1, 4, 6]])
    assert greedy_tree_accept(beams, argmax) == (3, 2)
    assert greedy_tree_accept(beams, np.full((3, 3), 9)) == (0, 0)
