"""The n-gram (prompt lookup) drafter, and sd's verify rules on its deterministic drafts."""

import time

import numpy as np
import pytest

from helpers import FakeLM, chi2_critical, chi2_stat, deterministic_q, exact_two_token_joint
from mtad_edge.runtime.config import SamplingConfig
from mtad_edge.runtime.drafting.lookup import (
    MATCH_CAP,
    MATCH_EDGES,
    NGRAM_MAX,
    NGRAM_MIN,
    NgramDrafter,
    match_class,
)
from mtad_edge.runtime.rules.sampling import filtered_logprobs
from mtad_edge.runtime.rules.verify import block_verify, match_verify, speculative_verify


def naive(tokens, gamma, n_min=NGRAM_MIN, n_max=NGRAM_MAX):
    """The definition, by scanning: for n = n_max..n_min, the tokens after the last earlier
    occurrence of the last n tokens, at most gamma and never past the end."""
    tokens = list(tokens)
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[size - n :]:
                return n, tokens[start + n : start + n + gamma]
    return 0, None


def drafted(d, tokens, gamma):
    out = d.propose(tokens, gamma)
    return None if out is None else out.tolist()


def test_matches_the_longest_suffix_and_copies_what_followed():
    d = NgramDrafter(n_min=2, n_max=4)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 1, 2, 3, 4, 9, 9, 7, 1, 2, 3]
    assert d.match_len(tokens) == 3 and drafted(d, tokens, 3) == [4, 9, 9]  # (1, 2, 3) at 1
    tokens = [5, 1, 2, 3, 4, 9, 8, 2, 3]
    assert d.match_len(tokens) == 2 and drafted(d, tokens, 2) == [4, 9]  # only (2, 3) matches
    tokens = [6, 1, 2, 3, 4, 7, 8, 9, 0, 1, 2, 3, 4]
    assert d.match_len(tokens) == 4 and drafted(d, tokens, 10) == [7, 8, 9, 0, 1, 2, 3, 4]


def test_most_recent_occurrence_wins():
    d = NgramDrafter(n_min=2, n_max=2)
    tokens = [1, 2, 7, 0, 1, 2, 8, 0, 1, 2]
    assert drafted(d, tokens, 2) == [8, 0]
    tokens += [9, 1, 2]
    assert drafted(d, tokens, 2) == [9, 1]


def test_a_longer_match_beats_a_more_recent_shorter_one():
    d = NgramDrafter(n_min=1, n_max=3)
    tokens = [4, 5, 6, 7, 0, 5, 6, 8, 3, 6, 9, 4, 5, 6]  # (4, 5, 6) at 0; (5, 6) at 5; (6,) at 9
    assert d.match_len(tokens) == 3 and drafted(d, tokens, 2) == [7, 0]


def agreeing(tokens, n, draft_len):
    """By its definition: how many tokens before the draft's source equal the context's last ones,
    found by scanning every earlier position for the one whose continuation is the draft."""
    tokens = list(tokens)
    size = len(tokens)
    for start in range(size - n - 1, -1, -1):
        if tokens[start : start + n] == tokens[size - n :]:
            m = n
            while m < MATCH_CAP and start + n - 1 - m >= 0 and tokens[start + n - 1 - m] == tokens[size - 1 - m]:
                m += 1
            return m, tokens[start + n : start + n + draft_len]
    raise AssertionError("no occurrence")


def test_a_lookup_says_how_far_its_match_agrees():
    d = NgramDrafter(n_min=2, n_max=4)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18
    tokens = [5, 6, 7, 8, 1, 2, 3, 4, 9, 9, 0, 5, 6, 7, 8, 1, 2, 3, 4]
    found = d.lookup(tokens, 3)
    assert found.tokens.tolist() == [9, 9, 0] and found.matched == 8  # agrees back to the start
    found = d.lookup([1, 2, 3, 9, 7, 2, 3], 2)
    assert found.tokens.tolist() == [9, 7] and found.matched == 2  # (2, 3) only: 1 and 7 differ
    passage = list(range(100, 140))
    found = d.lookup(passage + [0] + passage[:30], 4)
    assert found.tokens.tolist() == passage[30:34] and found.matched == MATCH_CAP  # counted up to the cap
    rng = np.random.default_rng(3)
    for _ in range(300):  # against the definition on random text over 4 tokens (many long matches)
        tokens = rng.integers(0, 4, int(rng.integers(3, 60))).tolist()
        found = NgramDrafter().lookup(tokens, 5)
        n, _ = naive(tokens, 5)
        if not n:
            assert found is None
            continue
        assert (found.matched, found.tokens.tolist()) == agreeing(tokens, n, 5)


def test_match_classes_split_at_their_edges():
    assert [match_class(m) for m in (2, 3)] == [0, 0]
    assert [match_class(m) for m in MATCH_EDGES] == list(range(1, len(MATCH_EDGES) + 1))
    assert match_class(MATCH_CAP) == len(MATCH_EDGES)


def test_no_match_gives_none():
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 4, 5], 4) is None and d.match_len([1, 2, 3, 4, 5]) == 0
    assert d.propose([], 4) is None and d.propose([7], 4) is None
    assert d.propose([1, 2, 1, 2], 0) is None  # nothing asked
    one = NgramDrafter(n_min=1, n_max=1)
    assert drafted(one, [3, 4, 3], 2) == [4, 3] and NgramDrafter(n_min=2).propose([3, 4, 3], 2) is None


def test_the_draft_never_runs_past_the_end():
    d = NgramDrafter(n_min=2, n_max=3)
    tokens = [1, 2, 3, 1, 2]
    assert drafted(d, tokens, 10) == [3, 1, 2]
    assert drafted(d, [0, 7, 7, 7, 7], 5) == [7]  # overlapping: (7, 7, 7) at 1, then the last 7
    assert drafted(d, [4, 4, 4], 5) == [4]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter(n_min=0)
    with pytest.raises(ValueError):
        NgramDrafter(n_min=3, n_max=2)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_use_gives_the_drafts_of_a_fresh_index_and_of_the_definition(seed):
    """A list growing by 1..4 tokens a call (a decoding loop): every draft equals a fresh
    drafter's and the naive scan's, and each n-gram is indexed once."""
    rng = np.random.default_rng(seed)
    d = NgramDrafter()
    tokens = [int(t) for t in rng.integers(0, 6, size=20)]
    for _ in range(150):
        gamma = int(rng.integers(1, 7))
        n, want = naive(tokens, gamma)
        assert d.match_len(tokens) == n
        assert drafted(d, tokens, gamma) == want == drafted(NgramDrafter(), tokens, gamma)
        tokens += [int(t) for t in rng.integers(0, 6, size=int(rng.integers(1, 5)))]
    d.match_len(tokens)
    assert d.rebuilds == 0
    assert d.index_ops == sum(len(tokens) - n for n in range(NGRAM_MIN, NGRAM_MAX + 1))  # ends 0..len-2


def test_numpy_input_and_output():
    d = NgramDrafter()
    out = d.propose(np.array([1, 2, 3, 9, 1, 2]), 2)
    assert out.dtype == np.int64 and out.tolist() == [3, 9]


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t[:-3],  # shorter: a new request with a shorter prompt
        lambda t: [9] + t[1:],  # same length, first token differs
        lambda t: t[:-1] + [(t[-1] + 1) % 6],  # the last token indexed differs
        lambda t: t[:10] + [(t[10] + 1) % 6] + t[11:] + [1, 2],  # a middle token differs, and it grew
        lambda t: [int(x) for x in np.random.default_rng(7).integers(0, 6, size=80)],  # another text
    ],
)
def test_a_list_that_does_not_extend_the_indexed_one_rebuilds(change):
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 6, size=60)]
    d = NgramDrafter()
    d.match_len(tokens)
    other = change(list(tokens))
    for gamma in (1, 3, 8):
        assert drafted(d, other, gamma) == naive(other, gamma)[1]
        other = other + [int(rng.integers(0, 6))]
    assert d.rebuilds >= 1
    assert drafted(d, other, 4) == naive(other, 4)[1]


def test_a_change_the_spot_checks_miss_is_caught_by_checking_the_match():
    """Same first, middle and last tokens, another 4-gram in between: the stale index points at
    a place that no longer holds the suffix; the match check rebuilds and finds the true one."""
    d = NgramDrafter(n_min=2, n_max=2)
    tokens = [0, 1, 2, 3, 5, 6, 7, 8, 0, 9, 9, 4, 3, 4, 4, 4, 5, 1, 2]
    assert drafted(d, tokens, 2) == [3, 5]  # (1, 2) at 1
    edited = list(tokens)
    edited[1:3] = [7, 7]  # (1, 2) is gone from position 1
    edited[5:7] = [1, 2]  # and now sits at 5
    assert drafted(d, edited, 2) == naive(edited, 2)[1] == [8, 0]
    assert d.rebuilds == 1


def test_reset_forgets_the_list():
    d = NgramDrafter()
    d.match_len([1, 2, 3, 1, 2])
    d.reset()
    assert d.match_len([4, 5, 4, 5]) == 2 and d.rebuilds == 0


def test_long_context_costs_one_index_update_per_new_token():
    """100k tokens fed a few at a time (a decoding loop asking each step): the index grows by
    one entry per token and key size, never re-reading the context."""
    rng = np.random.default_rng(0)
    text = [int(t) for t in rng.integers(0, 50, size=100_000)]
    text[60_000:60_500] = text[10_000:10_500]  # some copied text
    d = NgramDrafter()
    tokens = text[:1000]
    t0, calls, hits = time.perf_counter(), 0, 0
    while len(tokens) < len(text):
        tokens.extend(text[len(tokens) : len(tokens) + 3])
        hits += d.propose(tokens, 8) is not None
        calls += 1
    elapsed = time.perf_counter() - t0
    assert d.index_ops == sum(len(text) - n for n in range(NGRAM_MIN, NGRAM_MAX + 1)) and d.rebuilds == 0
    assert hits > 100  # the copied stretch drafts
    print(f"{calls} calls over 100k tokens: {elapsed:.2f} s, {d.index_ops} index insertions")


# Every bigram of the 5-token vocabulary has a continuation in it (a de Bruijn sequence), so every
# step drafts; its first draft, (0, 0, 1), has target probability 0.37 / 0.46 under the two
# samplings of the fake target, so first rounds both accept and reject.
PROMPT = [4, 1, 1, 2, 1, 3, 1, 4, 2, 2, 3, 2, 4, 3, 3, 4, 4, 0, 0, 1, 0, 2, 0, 3, 0, 4, 4]


def matching(p_rows, q_rows, draft, rng):
    """``match_verify`` as the q-reading rules are called: filtered log p rows are their own logits."""
    return match_verify(p_rows, draft, SamplingConfig(1.0, 0, 1.0), rng)


@pytest.mark.parametrize("verify", [speculative_verify, block_verify, matching])
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0, 0, 1.0), SamplingConfig(0.8, 4, 0.9)])
def test_ngram_drafts_keep_the_target_two_token_distribution(verify, sampling):
    """End to end on a fake target: n-gram drafts (q one-hot) verified by sd's rules; the first
    two emitted tokens pass a chi-square test (0.1 %) against the target's exact joint. One
    drafter serves every run, so each new run's shorter list exercises the rebuild."""
    target = FakeLM(vocab=5, salt=1, sharpness=1.0)
    rng = np.random.default_rng(0)
    d = NgramDrafter()
    counts = np.zeros(25)
    rounds, accepted, shorter, seen = np.zeros(3, dtype=int), np.zeros(4, dtype=int), 0, 0
    for _ in range(3000):
        tokens = list(PROMPT)
        shorter += seen > len(tokens)  # the drafter last saw a longer list: it must rebuild
        out: list[int] = []
        while len(out) < 2:
            draft = d.propose(tokens, 3)
            seen = len(tokens)
            _, q_rows = deterministic_q(draft, target.n_vocab)
            ctxs = [tokens + [int(t) for t in draft[:i]] for i in range(len(draft) + 1)]
            p_rows = filtered_logprobs(np.stack([target.logits_for(c) for c in ctxs]), sampling)
            k, nxt = verify(p_rows, q_rows, draft, rng)
            block = [int(t) for t in draft[:k]] + [nxt]
            rounds[len(out)] += 1
            accepted[k] += 1
            out += block
            tokens += block
        counts[out[0] * 5 + out[1]] += 1
    stat, df = chi2_stat(counts, exact_two_token_joint(target, PROMPT, sampling))
    assert stat < chi2_critical(df), (stat, df)
    assert rounds[1] > 100 and accepted[0] > 100 and accepted[1:].sum() > 100  # second rounds, k = 0 and > 0
    assert d.rebuilds == shorter > 100
