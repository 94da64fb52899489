"""Drafts that do not degenerate: the n-gram index, the drafter that skips repeats (no_repeat) and
MTAD's higher bar for blocks that repeat (repeat_penalty)."""

import numpy as np
import pytest

from helpers import TWO_TOKEN_RUN, FakeLM, chi2_critical, chi2_stat, exact_two_token_joint, generate_tokens
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.rules.repeats import Seen, ban
from mtad_edge.runtime.rules.tree import mmtad_accept
from mtad_edge.runtime.rules.verify import mtad_accept_length


def repeated_ngrams(tokens, n, start):
    """Positions >= start where an n-gram ends that occurred earlier in ``tokens``."""
    out = []
    for end in range(max(start, n - 1), len(tokens)):
        gram = tuple(tokens[end - n + 1 : end + 1])
        if any(tuple(tokens[i : i + n]) == gram for i in range(end - n + 1)):
            out.append(end)
    return out


def test_seen_indexes_a_growing_list_and_starts_over_on_another():
    seen = Seen(3)
    text = [5, 6, 7, 5, 6]
    seen.sync(text)
    assert seen.followers(text, []) == {7}  # "5 6" was followed by 7
    assert seen.followers(text, [7, 5]) == {6}  # "7 5" (context end + draft) was followed by 6
    assert seen.followers(text, [8]) == set()
    text += [9, 5, 6]
    seen.sync(text)
    assert seen.followers(text, []) == {7, 9}
    other = [1, 2, 1]
    seen.sync(other)  # not an extension: indexed afresh
    assert seen.followers(other, [2]) == {1}
    assert seen.repeats([1, 2, 1], [2, 1, 2, 3]).tolist() == [0, 1, 2, 2]  # 1 2 1 | 2 1 2 3: 121, 212 again


def test_ban_removes_and_renormalises():
    row = np.array([np.log(0.5), np.log(0.25), np.log(0.25), -np.inf])
    out = ban(row, {0})
    assert np.isneginf(out[0]) and np.allclose(np.exp(out[1:3]), [0.5, 0.5]) and np.isneginf(out[3])
    assert np.isneginf(ban(row, {0, 1, 2})).all()  # nothing left: this beam has no continuation
    assert ban(row, set()) is row


@pytest.mark.parametrize("method", ["mtad", "mmtad", "sd"])
def test_no_repeat_drafts_never_repeat_an_ngram_of_the_text(method):
    """No drafted token completes a 4-gram the text (and the draft before it) held: with 6 tokens
    unfiltered, some candidate is always left, so the drafter never falls back to repeating."""
    target, aux = FakeLM(salt=1, n_seq_max=5, vocab=6), FakeLM(salt=2, n_seq_max=9, vocab=6)
    drafts = []
    import mtad_edge.runtime.decoding as decoding

    real = decoding.Generation._draft

    def spy(self, plan):
        d = real(self, plan)
        drafts.append((list(self.tokens), [int(t) for t in d.tokens]))
        return d

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding.Generation, "_draft", spy)
        cfg = DecodeConfig(method, 60, gamma=4, no_repeat=4, sampling=SamplingConfig(1.0, 0, 1.0), seed=3)
        generate_tokens(target, aux, [1, 2, 3, 4, 1, 2, 3], cfg)
    assert drafts
    for context, draft in drafts:
        assert not repeated_ngrams(context + draft, 4, len(context)), (context, draft)


@pytest.mark.parametrize("verify", ["block", "token"])
def test_sd_stays_lossless_when_its_drafts_skip_repeats(verify):
    sampling = SamplingConfig(1.0, 0, 1.0)
    target, aux = FakeLM(salt=1, sharpness=1.0), FakeLM(salt=7, n_seq_max=3, sharpness=1.0)
    prompt = [1, 2, 1, 2]  # "1 2" is followed by 1: the drafter may never propose 1 after it
    counts = np.zeros(target.n_vocab**2)
    for seed in range(3000):
        cfg = DecodeConfig("sd", TWO_TOKEN_RUN, gamma=3, no_repeat=2, verify=verify, sampling=sampling, seed=seed)
        out, _ = generate_tokens(target, aux, prompt, cfg)
        counts[out[0] * target.n_vocab + out[1]] += 1
    stat, df = chi2_stat(counts, exact_two_token_joint(target, prompt, sampling))
    assert stat < chi2_critical(df)


def test_bars_raise_the_joint_test_where_a_block_repeats():
    logp, logq = np.log([0.9, 0.9, 0.9]), np.log([0.5, 0.5, 0.5])
    assert mtad_accept_length(logp, logq, 0.5) == 3
    assert mtad_accept_length(logp, logq, 0.5, np.array([0.0, 0.0, 10.0])) == 2
    assert mtad_accept_length(logp, logq, 0.5, np.array([10.0, 10.0, 10.0])) == 0
    cum_p, cum_q = np.cumsum(np.log([[0.9, 0.9], [0.8, 0.8]]), axis=1), np.cumsum(np.log([0.5, 0.5]))
    assert mmtad_accept(cum_p, cum_q, 0.5) == (2, 0)
    assert mmtad_accept(cum_p, cum_q, 0.5, np.array([[0.0, 10.0], [0.0, 0.0]])) == (2, 1)


@pytest.mark.parametrize("method", ["mtad", "mmtad"])
def test_a_prohibitive_repeat_penalty_accepts_no_drafted_repeat(method):
    """With a bar no repeating block clears, a repeated 4-gram can end only at a bonus token."""
    target, aux = FakeLM(salt=1, n_seq_max=5, vocab=3), FakeLM(salt=1, n_seq_max=9, vocab=3)  # aux = target
    prompt = [0, 1, 2, 0, 1, 2, 0]
    cfg = DecodeConfig(method, 80, gamma=4, repeat_penalty=1e6, seed=5)
    import mtad_edge.runtime.decoding as decoding

    blocks = []
    real = decoding.Generation._commit

    def spy(self, result, draft, looked_up, *ahead):
        blocks.append((len(self.tokens), result.accepted))
        return real(self, result, draft, looked_up, *ahead)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding.Generation, "_commit", spy)
        out, st = generate_tokens(target, aux, prompt, cfg)
    text = prompt + out
    ends = set(repeated_ngrams(text, 4, len(prompt)))
    for start, k in blocks:
        assert not any(start <= e < start + (k or 0) for e in ends), (start, k)
    _, free = generate_tokens(target, aux, prompt, DecodeConfig(method, 80, gamma=4, seed=5))
    assert free.accepted > st.accepted > 0  # the bar turned repeating blocks away, not every block
