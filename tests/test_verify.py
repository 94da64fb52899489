import math

import numpy as np
import pytest

from helpers import chi2_critical, chi2_stat
from mtad_edge.runtime.verify import greedy_accept_length, mtad_accept_length, speculative_verify

L = np.log


def test_mtad_accepts_whole_draft_when_joint_ratio_stays_above_threshold():
    # p/q per token: 1.0, 0.8, 0.9, 1.2 -> joint ratios 1.0, 0.8, 0.72, 0.864: all > 0.5
    lp = L([0.5, 0.4, 0.45, 0.6])
    lq = L([0.5, 0.5, 0.5, 0.5])
    assert mtad_accept_length(lp, lq, 0.5) == 4


def test_mtad_longest_passing_prefix_not_first_failure():
    # joint ratios: 0.4 (fail), 0.4*2 = 0.8 (pass), 0.8*0.5 = 0.4 (fail)
    lp = L([0.2, 0.8, 0.25])
    lq = L([0.5, 0.4, 0.5])
    assert mtad_accept_length(lp, lq, 0.5) == 2


def test_mtad_threshold_is_strict_and_none_passing_gives_zero():
    lp, lq = np.array([L(0.5), 0.0]), np.zeros(2)  # joint ratios exactly 0.5, 0.5
    assert mtad_accept_length(lp, lq, 0.5) == 0  # equal is not greater
    assert mtad_accept_length(lp, lq, 0.49) == 2
    assert mtad_accept_length(L([0.5]), L([0.5]), 1.0) == 0  # ratio 1 does not pass threshold 1
    assert mtad_accept_length(L([0.6]), L([0.5]), 1.0) == 1


def test_mtad_token_outside_target_support_cuts_the_prefix():
    lp = np.array([math.log(0.5), -np.inf, math.log(0.9)])
    lq = L([0.5, 0.5, 0.5])
    assert mtad_accept_length(lp, lq, 0.3) == 1


def test_mtad_rejects_bad_threshold():
    with pytest.raises(ValueError):
        mtad_accept_length(L([0.5]), L([0.5]), 0.0)


def test_greedy_accept_length():
    assert greedy_accept_length([3, 1, 4, 1], [3, 1, 5, 1, 9]) == 2
    assert greedy_accept_length([3, 1], [3, 1, 7]) == 2
    assert greedy_accept_length([2], [3, 0]) == 0


def _rand_dist(rng, v, support):
    p = np.zeros(v)
    idx = rng.choice(v, size=support, replace=False)
    p[idx] = rng.dirichlet(np.ones(support))
    with np.errstate(divide="ignore"):
        return np.log(p)


@pytest.mark.parametrize("case", range(4))
def test_speculative_sampling_preserves_the_target_distribution(case):
    """Draft x ~ q, verify: the emitted first token is distributed as p (chi-square, 0.1 %)."""
    rng = np.random.default_rng(100 + case)
    v = 6
    p = _rand_dist(rng, v, support=v - case % 2)  # sometimes p has zeros q does not
    q = _rand_dist(rng, v, support=v - (case // 2))  # sometimes q misses tokens p has
    if not np.isfinite(q).any():
        q = np.log(np.full(v, 1 / v))
    p_rows = np.stack([p, p])  # gamma 1: position 1 and the bonus position
    counts = np.zeros(v)
    n = 6000
    for _ in range(n):
        qx = np.exp(q)
        x = rng.choice(v, p=qx / qx.sum())
        k, nxt = speculative_verify(p_rows, q[None], np.array([x]), rng)
        counts[x if k == 1 else nxt] += 1
    stat, df = chi2_stat(counts, np.exp(p))
    assert stat < chi2_critical(df), (stat, counts / n, np.exp(p))


def test_speculative_all_accepted_gives_bonus_from_last_row():
    rng = np.random.default_rng(0)
    p = np.log(np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]) + 1e-300)
    q = p[:2].copy()
    k, nxt = speculative_verify(p, q, np.array([0, 1]), rng)
    assert (k, nxt) == (2, 2)


def test_speculative_greedy_rejection_returns_target_argmax():
    rng = np.random.default_rng(0)
    with np.errstate(divide="ignore"):
        p = np.log(np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
        q = np.log(np.array([[1.0, 0.0, 0.0]]))
    assert speculative_verify(p, q, np.array([0]), rng) == (0, 1)
