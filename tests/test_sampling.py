import numpy as np
import pytest

from mtad_edge.runtime.config import SamplingConfig
from mtad_edge.runtime.rules.sampling import (
    FEW_KEPT,
    Columns,
    KeptRows,
    filtered_logprobs,
    kept_logprobs,
    log_softmax,
    sample,
    sample_logits,
    sample_without_replacement,
    top_k_mask,
    top_p_mask,
)


def test_top_k_keeps_the_k_largest():
    x = np.array([[0.1, 3.0, -1.0, 2.0, 0.5]])
    out = top_k_mask(x, 2)
    assert np.isfinite(out).sum() == 2
    assert set(np.flatnonzero(np.isfinite(out[0]))) == {1, 3}
    assert top_k_mask(x, 0) is x and top_k_mask(x, 5) is x


def test_top_p_keeps_smallest_set_reaching_p():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    kept = np.isfinite(top_p_mask(np.log(p), 0.8))
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = np.isfinite(top_p_mask(np.log(p), 0.81))
    assert kept.tolist() == [True, True, True, False]
    assert np.isfinite(top_p_mask(np.log(p), 0.1)).sum() == 1  # never empty


def test_filtered_logprobs_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 2
    cfg = SamplingConfig(temperature=0.7, top_k=8, top_p=0.8)
    got = filtered_logprobs(logits, cfg)
    for row, g in zip(logits, got):
        x = row.astype(np.float64) / 0.7
        keep = np.argsort(-x)[:8]
        p = np.exp(x[keep] - x[keep].max())
        p /= p.sum()
        order = np.argsort(-p)
        cum = np.cumsum(p[order]) - p[order]
        nucleus = keep[order[cum < 0.8]]
        expect = np.full(50, -np.inf)
        q = np.exp(x[nucleus] - x[nucleus].max())
        expect[nucleus] = np.log(q / q.sum())
        assert np.array_equal(np.isfinite(g), np.isfinite(expect))
        assert np.allclose(g[nucleus], expect[nucleus])
        assert np.isclose(np.exp(g[np.isfinite(g)]).sum(), 1.0)


def test_no_top_k_path_and_greedy():
    logits = np.array([1.0, 2.0, 0.5, 1.5])
    full = filtered_logprobs(logits, SamplingConfig(1.0, 0, 1.0))
    assert np.allclose(full, log_softmax(logits))
    g = filtered_logprobs(logits, SamplingConfig(0.0, 10, 0.9))
    assert g[1] == 0 and np.isinf(g[[0, 2, 3]]).all()
    assert sample(g, np.random.default_rng(0)) == 1


def test_sample_follows_the_distribution():
    logp = np.array([np.log(0.1), -np.inf, np.log(0.6), np.log(0.3)])
    rng = np.random.default_rng(1)
    counts = np.bincount([sample(logp, rng) for _ in range(4000)], minlength=4)
    assert counts[1] == 0
    assert np.allclose(counts / 4000, [0.1, 0.0, 0.6, 0.3], atol=0.03)


def test_sample_without_replacement_distinct_and_top_n():
    scores = np.log(np.array([[0.4, 1.0, 0.1], [0.3, 0.15, 0.05]]))
    scores[0, 1] = -np.inf
    top = sample_without_replacement(scores, 3, None)
    assert top.tolist() == [0, 3, 4]  # flat indices, best first; -inf never picked
    rng = np.random.default_rng(2)
    for _ in range(200):
        pick = sample_without_replacement(scores, 4, rng)
        assert len(set(pick.tolist())) == 4 and 1 not in pick.tolist()
    assert len(sample_without_replacement(scores, 10, rng)) == 5  # only 5 finite candidates


def test_first_pick_of_gumbel_top_n_is_a_sample_from_the_weights():
    p = np.array([0.5, 0.3, 0.2])
    rng = np.random.default_rng(3)
    first = np.bincount([sample_without_replacement(np.log(p), 2, rng)[0] for _ in range(4000)], minlength=3)
    assert np.allclose(first / 4000, p, atol=0.03)


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampling_config(kw):
    with pytest.raises(ValueError):
        SamplingConfig(**kw)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(),
        SamplingConfig(0.7, 40, 0.95),
        SamplingConfig(1.3, 5, 1.0),
        SamplingConfig(1.0, 0, 0.9),
        SamplingConfig(0.8, FEW_KEPT + 36, 0.9),  # past FEW_KEPT: the numpy route
    ],
)
def test_sampling_from_logits_draws_what_the_filtered_row_draws(cfg):
    """The plain step's shortcut: the same token as sample(filtered_logprobs(...)) for the same
    generator state, draw after draw (ties included: logits rounded to a coarse grid)."""
    data = np.random.default_rng(5)
    for vocab in (7, 300, 49152):
        a, b = np.random.default_rng(11), np.random.default_rng(11)
        for _ in range(40):
            logits = np.round(data.normal(size=vocab) * 2, 1).astype(np.float32)
            assert sample_logits(logits, cfg, a) == sample(filtered_logprobs(logits[None], cfg)[0], b)
    greedy = SamplingConfig(temperature=0.0)
    assert sample_logits(np.array([0.1, 3.0, 2.0]), greedy, np.random.default_rng(0)) == 1


@pytest.mark.parametrize("vocab", [7, 300, 49152, 49155, 262144])
def test_kept_tokens_are_the_k_largest_logits(vocab):
    """Top-k through group maxima keeps exactly the k largest logits of every row: ties at the
    k-th value, -inf entries, several rows and a vocabulary that is no multiple of the groups."""
    data = np.random.default_rng(vocab)
    for k in (1, 10, 40, 200):  # 200: past what the bound cuts
        if k >= vocab:
            continue
        logits = np.round(data.normal(size=(3, vocab)) * 2, 1).astype(np.float32)  # a coarse grid: ties
        logits[0, -1] = 100.0  # the largest past the last whole group
        logits[1, : vocab // 2] = -np.inf
        logits[2] = 0.0  # every entry tied
        ids, logp = kept_logprobs(logits, SamplingConfig(1.0, k, 1.0))
        for row, kept in zip(logits, ids):
            assert len(set(kept.tolist())) == k
            assert np.array_equal(np.sort(row[kept]), np.sort(row)[-k:])
        assert np.isfinite(logp[0]).all()  # the row with no -inf


@pytest.mark.parametrize(
    "cfg", [SamplingConfig(1.0, 10, 0.9), SamplingConfig(0.7, 3, 1.0), SamplingConfig(1.0, 0, 0.9)]
)
def test_rows_on_shared_columns_hold_what_full_rows_hold(cfg):
    """Two sets of rows on the columns they share: every token either keeps has a column, as do
    the drafted tokens, and each row there equals its full filtered row; the tokens left out are
    -inf in every full row. With top-k off the columns are the whole vocabulary."""
    data = np.random.default_rng(3)
    vocab = 49152
    p_logits = data.normal(size=(5, vocab)).astype(np.float32) * 3
    q_logits = (p_logits[:4] + data.normal(size=(4, vocab))).astype(np.float32)
    drafted = np.array([5, 77, 49151, 5])  # not kept by any row, most likely
    p, q = KeptRows.of(p_logits, cfg), KeptRows.of(q_logits, cfg)
    full_p, full_q = filtered_logprobs(p_logits, cfg), filtered_logprobs(q_logits, cfg)
    assert np.array_equal(p.dense(), full_p) and np.array_equal(q.dense(), full_q)
    cols = Columns.shared(drafted, p, q)
    assert np.all(np.diff(cols.vocab) > 0) and set(drafted) <= set(cols.vocab.tolist())
    assert np.array_equal(cols.rows[0], full_p[:, cols.vocab]) and np.array_equal(cols.rows[1], full_q[:, cols.vocab])
    assert np.array_equal(cols.vocab[cols.column(drafted)], drafted)
    left_out = np.setdiff1d(np.arange(vocab), cols.vocab)
    assert not np.isfinite(full_p[:, left_out]).any() and not np.isfinite(full_q[:, left_out]).any()
    if not cfg.top_k:
        assert len(cols.vocab) == vocab
    else:
        assert len(cols.vocab) <= 9 * cfg.top_k + len(drafted)


def test_a_draw_on_shared_columns_is_the_draw_on_the_full_row():
    """``sample`` on a row's columns picks, from the same generator state, the token it picks on
    the full row (the kept tokens in the same order)."""
    data = np.random.default_rng(4)
    cfg = SamplingConfig(1.0, 20, 0.95)
    for _ in range(50):
        logits = data.normal(size=(2, 1000)) * 2
        cols = Columns.shared(np.array([3]), KeptRows.of(logits, cfg))
        seed = int(data.integers(1 << 30))
        for row in range(2):
            on_full = sample(filtered_logprobs(logits, cfg)[row], np.random.default_rng(seed))
            assert cols.vocab[sample(cols.rows[0][row], np.random.default_rng(seed))] == on_full
