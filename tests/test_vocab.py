"""Drafting across vocabularies on fake models with vocabularies of their own: the map, lossless sd
(chi-square), the aux kept in step with the target's text (re-synchronisation), the policy."""

import io

import numpy as np
import pytest

from helpers import TWO_TOKEN_RUN, FakeLM, chi2_critical, chi2_stat, exact_two_token_joint
from mtad_edge.loader import pair_vocabulary
from mtad_edge.runtime.backend import VocabInfo
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.errors import IncompatiblePairError
from mtad_edge.runtime.rules.sampling import filtered_logprobs
from mtad_edge.runtime.text.vocab import CrossVocab, VocabMap, build_map, map_models

# Token 0 is a control token in both (it prints nothing). The target has "ba" and "cd" the aux
# lacks; the aux has "dc" and "e" the target lacks; "a", "b", "c", "d", "ab" are shared.
TARGET_PIECES = [b"", b"a", b"b", b"c", b"ab", b"ba", b"cd", b"d"]
AUX_PIECES = [b"", b"b", b"a", b"d", b"ab", b"c", b"dc", b"e"]
PROMPT = [1, 2, 3]  # "abc" in the target's vocabulary


class PieceLM(FakeLM):
    """A fake model with a vocabulary of text pieces; tokenize is greedy longest match."""

    def __init__(self, pieces, **kw):
        super().__init__(vocab=len(pieces), **kw)
        self.pieces = pieces

    def tokenize(self, text, add_special=True):
        data, out, i = text.encode(), [], 0
        while i < len(data):
            fits = [j for j, p in enumerate(self.pieces) if p and data.startswith(p, i)]
            if not fits:
                i += 1
                continue
            best = max(fits, key=lambda j: len(self.pieces[j]))
            out.append(best)
            i += len(self.pieces[best])
        return out

    def token_bytes(self, token):
        return self.pieces[token]

    def vocab_info(self):
        return VocabInfo("pieces", len(self.pieces), -1, -1, False, lambda i: self.pieces[i] or b"<control>")


def cross_pair(target_salt=1, aux_salt=2, sharpness=1.0):
    target = PieceLM(TARGET_PIECES, salt=target_salt, n_seq_max=17, n_ctx=512, sharpness=sharpness)
    aux = PieceLM(AUX_PIECES, salt=aux_salt, n_seq_max=9, n_ctx=512, sharpness=sharpness)
    return target, aux, map_models(target, aux)


def text(model, ids) -> bytes:
    return b"".join(model.token_bytes(int(t)) for t in ids)


def test_the_map_meets_tokens_by_their_bytes_and_control_tokens_only_each_other():
    target, aux, vm = cross_pair()
    for a, t in enumerate(vm.a2t):
        assert (t < 0) == (AUX_PIECES[a] in (b"dc", b"e"))
        if t >= 0:
            assert TARGET_PIECES[t] == AUX_PIECES[a]
    assert vm.a2t[0] == 0 and vm.t2a[0] == 0  # the control tokens, by their text
    assert [TARGET_PIECES[t] for t in np.flatnonzero(vm.t2a < 0)] == [b"ba", b"cd"]
    assert vm.mapped == 6 and vm.coverage_of([1, 5, 6, 7]) == 0.5


def test_spellings_of_the_same_bytes_meet_the_one_the_tokenizer_writes():
    # Target: a byte-fallback "<0x2C>" (id 1) and an ordinary "," (id 2) decode to the same byte.
    vm = build_map([b"x", b",", b","], [b",", b"x"], target_prefer=lambda ids, key: 2)
    assert vm.a2t.tolist() == [2, 0] and vm.t2a.tolist() == [1, 0, 0]  # every target spelling finds the aux ","


@pytest.mark.parametrize("verify", ["block", "token"])
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0, 0, 1.0), SamplingConfig(0.8, 4, 0.9)])
def test_sd_across_vocabularies_is_lossless(sampling, verify):
    """The residual max(0, p - q) spans the target's whole vocabulary, so tokens the aux cannot
    draft ("ba", "cd") still come out as often as the target alone makes them."""
    target, aux, vm = cross_pair()
    counts = np.zeros(target.n_vocab**2)
    for seed in range(3000):
        cfg = DecodeConfig("sd", TWO_TOKEN_RUN, gamma=3, verify=verify, sampling=sampling, seed=seed)
        gen = Generation(target, aux, PROMPT, cfg, vocab=vm)
        out = [t for b in gen for t in b]
        counts[out[0] * target.n_vocab + out[1]] += 1
    expected = exact_two_token_joint(target, PROMPT, sampling)
    assert expected[[i * target.n_vocab + j for i in (5, 6) for j in range(target.n_vocab)]].sum() > 0.05
    stat, df = chi2_stat(counts, expected)
    assert stat < chi2_critical(df)


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_greedy_drafting_across_vocabularies_equals_greedy_ar(method):
    target, aux, vm = cross_pair()
    greedy = SamplingConfig(temperature=0.0)
    ar = [t for b in Generation(target, None, PROMPT, DecodeConfig("ar", 60, sampling=greedy)) for t in b]
    for gamma in (2, 4, "auto"):
        gen = Generation(target, aux, PROMPT, DecodeConfig(method, 60, gamma=gamma, sampling=greedy), vocab=vm)
        assert [t for b in gen for t in b] == ar, (method, gamma)
        assert gen.stats.drafted > 0


@pytest.mark.parametrize("method,tree", [("sd", "final"), ("mtad", "final"), ("mmtad", "final"), ("mmtad", "full")])
def test_the_aux_follows_the_committed_text_and_its_cache_stays_consistent(method, tree):
    """After a long sampled run the aux context spells exactly the target's text (tokens the aux
    lacks were re-tokenised), its cache holds a prefix of it, and a new draft is scored on that
    cache exactly as a fresh aux scores it."""
    target, aux, vm = cross_pair(sharpness=0.5)
    gen = Generation(target, aux, PROMPT, DecodeConfig(method, 200, gamma=3, tree=tree, seed=4), vocab=vm)
    [t for b in gen for t in b]
    drafter, st = gen.drafter, gen.stats
    cross = drafter.cross
    assert st.vocab_resyncs == cross.resyncs > 0 and 0 < st.vocab_mapped_share < 1
    cross.catch_up(drafter.ctx, gen.tokens)
    assert text(aux, drafter.ctx) == text(target, gen.tokens)
    held = list(aux.held(0))
    assert held == drafter.ctx[: len(held)]
    assert all(not aux.held(s) for s in range(1, aux.n_seq_max))  # no beam left behind
    d = drafter.propose(gen.tokens, 3, 2)
    path = list(drafter.ctx)
    for x_aux, x, lq in zip(drafter._beam_aux[d.best], d.tokens, d.logq_x):
        ref = cross.restrict(
            filtered_logprobs(aux.logits_for(path)[None], drafter.score_cfg),
            aux.logits_for(path)[None],
            lambda z: filtered_logprobs(z, drafter.score_cfg),
        )[0]
        assert np.isclose(lq, ref[x_aux]) and vm.a2t[x_aux] == x and np.isfinite(ref).sum() <= vm.mapped
        path.append(int(x_aux))


def test_an_incomplete_character_makes_the_aux_wait():
    target = PieceLM([b"", b"a", b"\xc3", b"\xa9", b"b"], salt=1, n_seq_max=5)  # "é" spelled in two bytes
    aux = PieceLM([b"", b"a", "é".encode(), b"b"], salt=2, n_seq_max=9)
    vm = map_models(target, aux)
    cross = CrossVocab(vm, target, aux)
    ctx = cross.start([1])
    cross.catch_up(ctx, [1, 2])
    assert cross.lagging and ctx == [1]
    cross.catch_up(ctx, [1, 2, 3, 4])
    assert not cross.lagging and ctx == [1, 2, 3] and cross.resyncs == 1


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path))
    return tmp_path


def test_policy(home, tmp_path):
    target = PieceLM(TARGET_PIECES, salt=1)
    paths = (tmp_path / "t.gguf", tmp_path / "a.gguf")
    assert pair_vocabulary(target, PieceLM(TARGET_PIECES, salt=2), paths, "auto") is None  # identical: fast path
    said = []
    vm = pair_vocabulary(target, PieceLM(AUX_PIECES, salt=2), paths, "auto", said.append)
    assert vm is not None and said[0].startswith("note: target t.gguf and aux a.gguf have different vocabularies")
    assert "6 of 8 aux tokens have a target twin" in said[0]
    assert list(home.glob("vocab/*.npz"))  # cached per pair of files
    with pytest.raises(IncompatiblePairError, match="--vocab-mismatch refuse"):
        pair_vocabulary(target, PieceLM(AUX_PIECES, salt=2), paths, "refuse")
    stranger = PieceLM([b"", b"x", b"y", b"z"], salt=3)  # nothing but the control token in common
    with pytest.raises(IncompatiblePairError, match=r"too little is shared to draft \(1 of 4 aux tokens .* 0\.0% of"):
        pair_vocabulary(target, stranger, paths, "auto")
    assert pair_vocabulary(target, stranger, paths, "allow") is not None


def _npz(**arrays) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


@pytest.mark.parametrize(
    "damage",
    [
        lambda good, vm: good[: len(good) // 2],  # truncated: zipfile.BadZipFile
        lambda good, vm: b"",  # EOFError
        lambda good, vm: _npz(a2t=vm.a2t[:2], t2a=vm.t2a[:2]),  # IndexError while decoding
        lambda good, vm: _npz(a2t=vm.a2t[None], t2a=vm.t2a[None]),
        lambda good, vm: _npz(a2t=vm.a2t.astype(float), t2a=vm.t2a.astype(float)),
        lambda good, vm: _npz(a2t=vm.a2t + 1000, t2a=vm.t2a),  # ids past the vocabulary
        lambda good, vm: _npz(a2t=np.array(["x"] * len(vm.a2t)), t2a=vm.t2a),  # numpy's UFuncTypeError
        lambda good, vm: _npz(a2t=np.int64(3), t2a=np.int64(3)),
    ],
)
def test_a_damaged_cached_vocabulary_map_is_derived_again(home, tmp_path, damage):
    """A cache record is untrusted: one of another shape or type was loaded as the map (or its read
    was a traceback) and failed only while decoding."""
    target, aux = PieceLM(TARGET_PIECES, salt=1), PieceLM(AUX_PIECES, salt=2)
    paths = (tmp_path / "t.gguf", tmp_path / "a.gguf")
    vm = pair_vocabulary(target, aux, paths, "auto")
    (record,) = home.glob("vocab/*.npz")
    record.write_bytes(damage(record.read_bytes(), vm))
    again = pair_vocabulary(target, aux, paths, "auto")
    assert again.a2t.dtype == np.int64 and (again.a2t == vm.a2t).all() and (again.t2a == vm.t2a).all()
    assert (VocabMap.load(str(record), target.n_vocab, aux.n_vocab).a2t == vm.a2t).all()  # written anew
