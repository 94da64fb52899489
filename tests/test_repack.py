"""Repacked CPU weights where AMX forces them off: the GGUF header read as untrusted input, the
tensors named from it, and the default pair's aux loaded that way."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from mtad_edge.runtime.gguf_header import MAX_KV, Tensor, read_header
from mtad_edge.runtime.repack import REPACK_KINDS, Overrides, repack_patterns

Q4_0, Q4_K, Q6_K, F16 = 2, 12, 14, 1


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf(
    tensors: dict | list, arch: str = "llama", *, n_kv: int | None = None, extra_kv: bytes = b"", version: int = 3
):
    """A GGUF header as llama.cpp writes it: architecture, a string array, then the tensor table."""
    kv = _s("general.architecture") + struct.pack("<I", 8) + _s(arch)
    kv += _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + b"".join(_s(t) for t in ("a", "bb", "<s>"))
    kv += _s("llama.block_count") + struct.pack("<II", 4, 2) + extra_kv
    count = 3 + (1 if extra_kv else 0) if n_kv is None else n_kv
    table = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)  # a list may repeat a name
    out = b"GGUF" + struct.pack("<IQQ", version, len(table), count) + kv
    for name, (ggml_type, shape) in table:
        raw = name if isinstance(name, bytes) else name.encode()
        out += _s(raw) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", n) for n in shape)
        out += struct.pack("<IQ", ggml_type, 0)
    return out + b"\0" * 32  # (tensor data would follow)


def model(layers: int = 2, ggml_type: int = Q4_0, rows: int = 64) -> dict:
    t = {"token_embd.weight": (ggml_type, (64, 1000)), "output_norm.weight": (0, (64,))}
    for i in range(layers):
        t |= {f"blk.{i}.{kind}.weight": (ggml_type, (64, rows)) for kind in REPACK_KINDS}
        t[f"blk.{i}.attn_norm.weight"] = (0, (64,))
    return t


def test_a_gguf_header_is_read_as_llama_cpp_writes_it(tmp_path, smol_files):
    aux = read_header(smol_files.aux)
    assert aux is not None and aux.architecture == "llama" and len(aux.tensors) == 272
    assert aux.tensors["blk.0.attn_k.weight"] == Tensor(Q4_0, (576, 192))  # 3 KV heads of 64
    assert aux.tensors["token_embd.weight"].shape == (576, 49152)
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf(model()))
    made = read_header(path)
    assert made is not None and made.tensors["blk.1.ffn_down.weight"] == Tensor(Q4_0, (64, 64))


def test_a_header_that_breaks_a_bound_or_ends_early_is_none_never_an_error(tmp_path):
    path = tmp_path / "m.gguf"
    whole = gguf(model(layers=1))
    for n in range(len(whole) - 32):  # every truncation of the header
        path.write_bytes(whole[:n])
        assert read_header(path) is None, n
    bad = {
        "counts past every model's": gguf(model(), n_kv=MAX_KV + 1),
        "a string longer than the file": gguf(model(), extra_kv=_s("k") + struct.pack("<IQ", 8, 2**62)),
        "a string array longer than the file": gguf(model(), extra_kv=_s("k") + struct.pack("<IIQ", 9, 8, 2**40)),
        "an array of arrays": gguf(model(), extra_kv=_s("k") + struct.pack("<IIQ", 9, 9, 1)),
        "an unknown value type": gguf(model(), extra_kv=_s("k") + struct.pack("<I", 77)),
        "version 1": gguf(model(), version=1),
        "a tensor name C reads shorter": gguf({b"blk.0.attn_q.weight\0x": (Q6_K, (64, 12))}),
        "a tensor named twice": gguf([("a", (Q4_0, (64, 64))), ("a", (Q4_0, (64, 64)))]),
        "a tensor name longer than llama.cpp takes": gguf({"blk.0.attn_q.weight" + "x" * 60: (Q4_0, (64, 64))}),
        "a key longer than any": gguf(model(), extra_kv=_s("k" * (1 << 17)) + struct.pack("<II", 4, 1)),
        "no magic": b"GGUX" + gguf(model())[4:],
    }
    for what, data in bad.items():
        path.write_bytes(data)
        t0 = time.perf_counter()
        assert read_header(path) is None, what
        assert time.perf_counter() - t0 < 1.0, what  # bounded by the file, not by what it claims
    assert read_header(tmp_path / "missing.gguf") is None
    path.write_bytes(gguf(model(), arch="llama" * 200_000))  # a value is skipped, not copied, unless short
    long_arch = read_header(path)
    assert long_arch is not None and long_arch.architecture == "" and repack_patterns(long_arch) == []


def test_only_kinds_whose_every_tensor_llama_cpp_can_repack_are_named():
    from mtad_edge.runtime.gguf_header import Header

    def header(tensors: dict, arch: str = "llama") -> Header:
        return Header(arch, {n: Tensor(t, s) for n, (t, s) in tensors.items()})

    every = [rf"^blk\.[0-9]+\.{kind}\.weight$" for kind in REPACK_KINDS]
    assert repack_patterns(header(model())) == every
    assert repack_patterns(header(model(ggml_type=Q4_K))) == every
    assert repack_patterns(header(model(), "gemma3")) == every
    assert repack_patterns(header(model(ggml_type=F16))) == []  # nothing to repack
    assert repack_patterns(header(model(rows=12))) == []  # rows not a multiple of 8: llama.cpp would abort
    assert repack_patterns(header(model(), "qwen2")) == []  # an architecture not checked
    assert repack_patterns(None) == []
    odd = model()
    odd["blk.1.attn_v.weight"] = (Q6_K, (64, 64))  # one layer's tensor of a type it does not repack
    odd["blk.0.ffn_up.weight"] = (Q4_0, (64, 64, 2))  # not a matrix
    named = repack_patterns(header(odd))
    assert named == [p for p in every if "attn_v" not in p and "ffn_up" not in p]
    assert "token_embd" not in "".join(named)  # the embedding is also read by row (get_rows)


def test_overrides_name_the_repack_buffer_of_the_ggml_llama_cpp_uses():
    llama_cpp = pytest.importorskip("llama_cpp")
    assert Overrides(llama_cpp, []).pointer is None
    made = Overrides(llama_cpp, [r"^blk\.[0-9]+\.attn_q\.weight$"])
    if "AVX2 = 1" not in llama_cpp.llama_print_system_info().decode():
        assert made.pointer is None
    else:
        assert made.count == 1 and made.pointer is not None


@pytest.mark.slow
def test_on_amx_machines_the_q4_0_aux_runs_repacked_and_drafts_the_same_distribution(smol_files, monkeypatch):
    """Where AMX turns llama.cpp's extra buffer types off, the aux's projections are repacked by
    name; its logits stay those of the same weights (llama.cpp rounds activations a little
    differently there), and the F16 target has nothing to repack."""
    from mtad_edge.runtime import llama_cpp_backend as lb
    from mtad_edge.runtime.backend import Batch

    if not lb.uses_amx():
        pytest.skip("extra buffer types stay on without AMX: llama.cpp repacks by itself")
    config = lb.LlamaCppConfig(n_ctx=256, n_threads=2)
    aux = lb.LlamaCppBackend(smol_files.aux, config)
    target = lb.LlamaCppBackend(smol_files.target, config)
    try:
        assert aux.repacked == len(REPACK_KINDS) and target.repacked == 0
        tokens = target.tokenize("The history of the Roman Empire begins with the founding of the city of Rome")
        repacked = aux.decode(Batch.run(tokens, 0, logits="all")).copy()  # a view of the context
    finally:
        aux.close()
        target.close()
    import llama_cpp

    with monkeypatch.context() as m:  # layers offloaded to a GPU keep their weights there: nothing is named
        m.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
        offloaded = lb.LlamaCppBackend(smol_files.aux, lb.LlamaCppConfig(n_ctx=256, n_threads=2, n_gpu_layers=-1))
        assert offloaded.repacked == 0
        offloaded.close()
    monkeypatch.setattr(lb, "repack_patterns", lambda header: [])
    plain = lb.LlamaCppBackend(smol_files.aux, config)
    try:
        assert plain.repacked == 0
        reference = plain.decode(Batch.run(tokens, 0, logits="all")).copy()
    finally:
        plain.close()
    from mtad_edge.runtime.sampling import log_softmax

    p, q = log_softmax(reference), log_softmax(repacked)
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    assert kl < 0.02, kl  # measured 0.004; the Q4_0 aux is 0.48 nats from its F16 target: this is rounding
    assert (reference.argmax(-1) == repacked.argmax(-1)).mean() > 0.85
