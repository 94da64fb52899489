import math
import time

import numpy as np
import pytest

from helpers import FakeLM, chi2_critical, chi2_stat, deterministic_q
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.config import SamplingConfig
from mtad_edge.runtime.drafting.aux import Draft
from mtad_edge.runtime.methods import StepView, get
from mtad_edge.runtime.rules.sampling import Columns, KeptRows, filtered_logprobs, sample, sample_logits
from mtad_edge.runtime.rules.verify import (
    block_residual,
    block_stop_prob,
    block_verify,
    block_weights,
    greedy_accept_length,
    match_verify,
    mtad_accept_length,
    speculative_verify,
)

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


# -- a deterministic draft (prompt lookup): draw the target's token, keep the draft while equal --
MATCH_SAMPLINGS = [SamplingConfig(1.0, 0, 1.0), SamplingConfig(0.8, 3, 0.9)]


def _likely_draft(lm: "TreeLM") -> np.ndarray:
    """Three tokens each the most likely under ``lm`` after context [0] and the ones before it: a
    draft that is kept whole often and cut often."""
    draft: list[int] = []
    for _ in range(3):
        draft.append(int(np.argmax(lm([0, *draft]))))
    return np.array(draft)


@pytest.mark.parametrize("sampling", MATCH_SAMPLINGS)
def test_match_rule_keeps_each_drafted_token_with_its_target_probability(sampling):
    """(k, next) follows the law of emitting the target's own draws: P(k = d, next = y) =
    prod_{j<d} p_j(x_j) * p_d(y) for y != x_d (y from p_gamma once all are kept). Chi-square at
    0.1 % over 20000 rounds, with the rows given as raw logits and filtered by ``sampling``."""
    lm = TreeLM(4, seed=11, min_support=2)
    draft = _likely_draft(lm)
    logits = _rows(lm, [0], draft, 4)
    p = np.exp(filtered_logprobs(logits, sampling))
    want, alive = np.zeros((4, 4)), 1.0
    for d in range(4):
        want[d] = alive * p[d]
        if d < 3:
            want[d, draft[d]] = 0.0  # drawing x_d keeps it: that round goes on to depth d + 1
            alive *= p[d, draft[d]]
    assert abs(want.sum() - 1) < 1e-12 and 0.1 < alive < 0.9  # every k is likely enough to test
    rng, counts = np.random.default_rng(5), np.zeros((4, 4))
    for _ in range(20000):
        k, nxt = match_verify(logits, draft, sampling, rng)
        counts[k, nxt] += 1
    stat, df = chi2_stat(counts.ravel(), want.ravel())
    assert stat < chi2_critical(df)


@pytest.mark.parametrize("sampling", MATCH_SAMPLINGS)
def test_match_rule_emits_the_plain_samplers_draws_from_the_same_generator(sampling):
    """One ``sample_logits`` draw per emitted token, in order: the text a plain sampler would
    write from the same generator state, whatever was drafted."""
    lm = TreeLM(4, seed=11, min_support=2)
    draft = _likely_draft(lm)
    logits = _rows(lm, [0], draft, 4)
    lengths = set()
    for seed in range(300):
        k, nxt = match_verify(logits, draft, sampling, np.random.default_rng(seed))
        plain = np.random.default_rng(seed)
        assert [*draft[:k].tolist(), nxt] == [sample_logits(logits[d], sampling, plain) for d in range(k + 1)]
        lengths.add(k)
    assert {0, 3} <= lengths  # drafts cut at the first token and drafts kept whole


# -- block verification (Sun et al., ICLR 2025) beside the token rule -------------------------
class TreeLM:
    """Random conditional distributions over a small vocabulary, a fresh one per context (cached).

    Each row puts Dirichlet(1) mass on a random subset of at least ``min_support`` tokens, so a
    target and a draft built with ``min_support < v`` have zeros where the other is positive;
    ``one_hot`` puts all mass on one token: a deterministic drafter such as an n-gram lookup."""

    def __init__(self, v: int, seed: int, min_support: int | None = None, one_hot: bool = False):
        self.v, self.seed, self.one_hot = v, seed, one_hot
        self.min_support = v if min_support is None else min_support
        self.rows: dict[tuple, np.ndarray] = {}

    def __call__(self, ctx) -> np.ndarray:
        ctx = tuple(int(t) for t in ctx)
        if ctx not in self.rows:
            rng = np.random.default_rng([self.seed, len(ctx), *ctx])
            support = 1 if self.one_hot else int(rng.integers(self.min_support, self.v + 1))
            self.rows[ctx] = _rand_dist(rng, self.v, support)
        return self.rows[ctx]


def _rows(model, ctx, draft, n):
    return np.stack([model([*ctx, *draft[:d]]) for d in range(n)])


def _token_rule_outcomes(p_rows, q_rows, draft):
    """(tau, P(tau), residual) of the token rule, from its definition."""
    gamma, alive = len(draft), 1.0
    for d, x in enumerate(draft):
        a = min(1.0, np.exp(p_rows[d, x] - q_rows[d, x]))
        res = np.maximum(np.exp(p_rows[d]) - np.exp(q_rows[d]), 0)
        yield d, alive * (1 - a), res / res.sum() if res.sum() > 0 else np.exp(p_rows[d])
        alive *= a
    yield gamma, alive, np.exp(p_rows[gamma])


def _block_rule_outcomes(p_rows, q_rows, draft):
    """(tau, P(tau), residual) of the block rule: P(tau = k) = h_k prod_{j>k} (1 - h_j)."""
    gamma = len(draft)
    w = block_weights(p_rows, q_rows, draft)
    h = [block_stop_prob(p_rows, q_rows, w, i) for i in range(gamma + 1)]
    for k in range(gamma + 1):
        yield (
            k,
            h[k] * math.prod(1 - h[j] for j in range(k + 1, gamma + 1)),
            np.exp(block_residual(p_rows, q_rows, w, k)),
        )


RULES = {"token": _token_rule_outcomes, "block": _block_rule_outcomes}


def _drafts(q, ctx, gamma):
    """Every draft of ``gamma`` tokens with its probability under q (sampled token by token)."""
    if gamma == 0:
        yield (), 1.0
        return
    for draft, pr in _drafts(q, ctx, gamma - 1):
        probs = np.exp(q([*ctx, *draft]))
        for x in np.flatnonzero(probs):
            yield (*draft, int(x)), pr * probs[x]


def _round(rule, p, q, ctx, gamma):
    """Exact distribution of the block one draft + verify round emits, and its expected tau."""
    out: dict[tuple, float] = {}
    mean_tau = 0.0
    for draft, qd in _drafts(q, ctx, gamma):
        p_rows, q_rows = _rows(p, ctx, draft, gamma + 1), _rows(q, ctx, draft, gamma)
        for k, pk, res in RULES[rule](p_rows, q_rows, np.array(draft)):
            assert 0 <= pk <= 1 + 1e-12 and abs(res.sum() - 1) < 1e-12
            mean_tau += qd * pk * k
            if pk == 0:
                continue
            for y in np.flatnonzero(res):
                key = (*draft[:k], int(y))
                out[key] = out.get(key, 0.0) + qd * pk * res[y]
    return out, mean_tau


def _first_tokens(rule, p, q, ctx, gamma, m):
    """Exact distribution of the first ``m`` emitted tokens (more rounds when one emits fewer);
    rule None: the target alone."""
    if m == 0:
        return {(): 1.0}
    if rule is None:
        step = {(int(y),): pr for y, pr in enumerate(np.exp(p(ctx))) if pr > 0}
    else:
        step = _round(rule, p, q, ctx, gamma)[0]
    out: dict[tuple, float] = {}
    for block, pr in step.items():
        block = block[:m]
        for rest, pr2 in _first_tokens(rule, p, q, [*ctx, *block], gamma, m - len(block)).items():
            out[block + rest] = out.get(block + rest, 0.0) + pr * pr2
    return out


def _pair(seed, kind, v=4):
    """A target and a draft model: 'full' supports, 'zeros' (each has zeros where the other is
    positive), or a 'deterministic' draft (one-hot q, as an n-gram draft)."""
    p = TreeLM(v, seed, min_support=2 if kind == "zeros" else v)
    q = TreeLM(v, seed + 1000, min_support=2 if kind == "zeros" else v, one_hot=kind == "deterministic")
    return p, q


KINDS = ["full", "zeros", "deterministic"]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", KINDS)
def test_exact_output_distribution_is_the_target(rule, kind):
    """By enumeration of every draft and outcome: the first three emitted tokens are distributed
    exactly as the target's (up to rounding), for gamma 1..3 and many random models."""
    for seed in range(8):
        p, q = _pair(seed, kind)
        want = _first_tokens(None, p, q, [0], 0, 3)
        for gamma in (1, 2, 3):
            got = _first_tokens(rule, p, q, [0], gamma, 3)
            assert set(got) <= set(want), (seed, gamma)
            assert max(abs(got.get(k, 0.0) - pr) for k, pr in want.items()) < 1e-12, (seed, gamma)


def _sample_first_two(verify, p, q, gamma, rng):
    ctx, out = [0], []
    while len(out) < 2:
        draft = []
        for _ in range(gamma):
            draft.append(sample(q([*ctx, *draft]), rng))
        draft = np.array(draft)
        k, nxt = verify(_rows(p, ctx, draft, gamma + 1), _rows(q, ctx, draft, gamma), draft, rng)
        block = [int(t) for t in draft[:k]] + [nxt]
        out += block
        ctx += block
    return out[:2]


@pytest.mark.parametrize("verify", [speculative_verify, block_verify])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_sampled_output_follows_the_target_two_token_distribution(verify, kind, gamma):
    """The functions themselves, sampled: the first two emitted tokens pass a chi-square test
    (0.1 %) against the target's exact joint."""
    p, q = _pair(10 + gamma, kind)
    rng = np.random.default_rng(gamma)
    want = _first_tokens(None, p, q, [0], 0, 2)
    counts = np.zeros(16)
    for _ in range(3000):
        a, b = _sample_first_two(verify, p, q, gamma, rng)
        counts[4 * a + b] += 1
    expected = np.zeros(16)
    for (a, b), pr in want.items():
        expected[4 * a + b] = pr
    stat, df = chi2_stat(counts, expected)
    assert stat < chi2_critical(df), (stat, df)


def test_block_rule_accepts_at_least_as_many_tokens_as_the_token_rule():
    """Exact expected tau of both rules over one drafted block, on many random model pairs:
    never lower for the block rule, and strictly higher on most."""
    gains = []
    for seed in range(60):
        v, gamma = 3, 2 + seed % 3
        p, q = TreeLM(v, seed, min_support=2 if seed % 2 else v), TreeLM(v, seed + 500)
        token, block = (_round(rule, p, q, [0], gamma)[1] for rule in ("token", "block"))
        assert block >= token - 1e-12, (seed, token, block)
        gains.append(block - token)
    assert sum(g > 1e-3 for g in gains) > 30 and max(gains) > 0.05, gains


def test_block_rule_on_the_papers_example():
    """Sun et al.'s motivating example: context-free p = (1/3, 2/3), q = (2/3, 1/3), gamma 2:
    the token rule accepts 10/9 tokens in expectation, block verification 11/9."""
    p_row, q_row = L([1 / 3, 2 / 3]), L([2 / 3, 1 / 3])
    p, q = (lambda ctx: p_row), (lambda ctx: q_row)
    assert _round("token", p, q, [0], 2)[1] == pytest.approx(10 / 9, abs=1e-12)
    assert _round("block", p, q, [0], 2)[1] == pytest.approx(11 / 9, abs=1e-12)


def test_block_accept_length_follows_the_stopping_probabilities():
    """The backward draw of tau: for one draft, its histogram matches h_k prod_{j>k} (1 - h_j)."""
    p, q = _pair(10, "full", v=5)
    draft = np.array([0, 4, 0, 2])  # every tau from 0 to 4 has probability > 2 %
    p_rows, q_rows = _rows(p, [0], draft, 5), _rows(q, [0], draft, 4)
    want = np.array([pk for _, pk, _ in _block_rule_outcomes(p_rows, q_rows, draft)])
    assert (want > 0.02).all() and want.sum() == pytest.approx(1)
    rng = np.random.default_rng(0)
    counts = np.bincount([block_verify(p_rows, q_rows, draft, rng)[0] for _ in range(6000)], minlength=5)
    stat, df = chi2_stat(counts, want)
    assert stat < chi2_critical(df), (counts / 6000, want)


@pytest.mark.parametrize("kind", KINDS)
def test_gamma_one_and_deterministic_drafts_make_the_block_rule_the_token_rule(kind):
    """Per draft, the same law of (tau, next token): at gamma 1 always, and at any gamma when
    the draft is deterministic."""
    for seed in range(6):
        p, q = _pair(seed, kind)
        for gamma in (1, 2, 3) if kind == "deterministic" else (1,):
            for draft, _ in _drafts(q, [0], gamma):
                draft = np.array(draft)
                p_rows, q_rows = _rows(p, [0], draft, gamma + 1), _rows(q, [0], draft, gamma)
                for (k1, pk1, r1), (k2, pk2, r2) in zip(
                    _token_rule_outcomes(p_rows, q_rows, draft), _block_rule_outcomes(p_rows, q_rows, draft)
                ):
                    assert k1 == k2 and pk1 == pytest.approx(pk2, abs=1e-12)
                    if pk1 > 0:
                        np.testing.assert_allclose(r1, r2, atol=1e-12)


def test_block_rule_accepts_everything_when_p_equals_q():
    """p == q: every weight is 1 and h_gamma = 1, so the whole block is kept (also when a
    middle row is exactly equal, the 0/0 h), with no floating-point warning."""
    p, _ = _pair(4, "zeros", v=6)
    rng = np.random.default_rng(1)
    with np.errstate(all="raise"):
        for _ in range(200):
            draft = []
            for _ in range(4):
                draft.append(sample(p([0, *draft]), rng))
            draft = np.array(draft)
            rows = _rows(p, [0], draft, 5)
            k, nxt = block_verify(rows, rows[:4], draft, rng)
            assert k == 4 and np.isfinite(rows[4, nxt])


def test_block_rule_is_greedy_matching_at_temperature_zero():
    """One-hot p and q: keep the drafted tokens while they equal argmax p, then argmax p."""
    rng = np.random.default_rng(0)

    def one_hot(xs):
        with np.errstate(divide="ignore"):
            return np.log(np.eye(5)[xs])

    target = np.array([3, 1, 4, 1])
    for draft in ([3, 1, 2], [3, 1, 4], [0, 1, 4], [3, 2, 4]):
        k, nxt = block_verify(one_hot(target), one_hot(draft), np.array(draft), rng)
        assert k == greedy_accept_length(draft, target) and nxt == target[k]


def test_block_rule_handles_zeros_without_warnings():
    """Drafted tokens of p = 0, residuals over q's zeros, a deterministic q: no NaN, no warning,
    and the next token always has p > 0 at its depth."""
    rng = np.random.default_rng(2)
    for seed in range(20):
        p, q = _pair(seed, ("zeros", "deterministic")[seed % 2], v=5)
        with np.errstate(all="raise"):
            for _ in range(50):
                draft = []
                for _ in range(3):
                    draft.append(sample(q([0, *draft]), rng))
                draft = np.array(draft)
                p_rows = _rows(p, [0], draft, 4)
                k, nxt = block_verify(p_rows, _rows(q, [0], draft, 3), draft, rng)
                assert np.isfinite(p_rows[k, nxt]) and all(np.isfinite(p_rows[d, draft[d]]) for d in range(k))


def test_empty_draft_samples_the_target_row():
    rng = np.random.default_rng(0)
    p_row = L([0.2, 0.8])[None]
    outs = [block_verify(p_row, np.zeros((0, 2)), np.zeros(0, dtype=np.int64), rng) for _ in range(2000)]
    assert {k for k, _ in outs} == {0} and 0.75 < np.mean([y for _, y in outs]) < 0.85


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_at_temperature_zero_a_step_reads_only_the_targets_argmax(method):
    """p is one-hot at temperature 0, so every rule keeps the leading run of drafted tokens equal
    to the target's argmax, then takes the argmax there: a step gives that without building
    filtered rows (sd needs no q rows then), as the block rule does on the full rows."""
    greedy = SamplingConfig(temperature=0.0)
    target = FakeLM(vocab=5, salt=3, sharpness=2.5, n_seq_max=5)
    tokens, data = [1, 2, 3], np.random.default_rng(0)
    kept = set()
    for _ in range(40):
        top = [int(np.argmax(target.logits_for(tokens)))]
        draft_tokens = np.array([top[0] if data.random() < 0.7 else int(data.integers(5))])
        while len(draft_tokens) < 4:  # mostly the target's own continuation, so runs of every length occur
            ctx = tokens + draft_tokens.tolist()
            top.append(int(np.argmax(target.logits_for(ctx))))
            x = top[-1] if data.random() < 0.7 else int(data.integers(5))
            draft_tokens = np.append(draft_tokens, x)
        top.append(int(np.argmax(target.logits_for(tokens + draft_tokens.tolist()))))
        k = next((d for d in range(4) if draft_tokens[d] != top[d]), 4)
        beams = np.stack([draft_tokens, (draft_tokens + 1) % 5])  # mmtad: a second beam, never better here
        logq = np.zeros(4)
        draft = Draft(draft_tokens, logq, None, beams if method == "mmtad" else draft_tokens[None], np.zeros((2, 4)))
        target.clear()
        target.decode(Batch.run(tokens[:-1], 0, logits="none"))
        view = StepView(
            target, list(tokens), greedy, 0.5, "final", "block", 1.0, np.random.default_rng(0), time.perf_counter
        )
        result = get(method).step(view, 4, 2, draft)
        if method == "mmtad" and result.beam == 1:  # the other beam matched longer: its own run
            continue
        assert (result.accepted, result.tokens) == (k, [*draft_tokens[:k].tolist(), top[k]])
        p = filtered_logprobs(
            np.stack([target.logits_for(tokens + draft_tokens[:d].tolist()) for d in range(5)]), greedy
        )
        _, q_rows = deterministic_q(draft_tokens, 5)
        assert block_verify(p, q_rows, draft_tokens, np.random.default_rng(1)) == (k, top[k])
        kept.add(k)
    assert kept == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("rule", [speculative_verify, block_verify])
def test_a_rule_on_shared_columns_decides_as_on_full_rows(rule):
    """sd verifies on the columns its target and draft rows keep: from the same generator state a
    rule accepts as many tokens and draws the same next token as on full vocabulary rows."""
    data = np.random.default_rng(11)
    cfg = SamplingConfig(1.0, 8, 0.9)
    for _ in range(300):
        gamma, vocab = int(data.integers(1, 6)), 500
        p_logits = data.normal(size=(gamma + 1, vocab)) * 2
        q_logits = p_logits[:gamma] + data.normal(size=(gamma, vocab)) * float(data.uniform(0.2, 2))
        q = KeptRows.of(q_logits, cfg)
        draft = np.array([sample(row, data) for row in q.dense()])
        p = KeptRows.of(p_logits, cfg)
        cols = Columns.shared(draft, p, q)
        seed = int(data.integers(1 << 30))
        on_full = rule(p.dense(), q.dense(), draft, np.random.default_rng(seed))
        k, j = rule(*cols.rows, cols.column(draft), np.random.default_rng(seed))
        assert (k, int(cols.vocab[j])) == on_full
