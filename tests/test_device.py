"""The decoders' exactness on whatever device the llama.cpp build offloads to (the GPU of a CUDA
build, else the CPU): random-weight models of SmolLM2's shape and vocabulary, every layer
offloaded, target F16 and aux its own Q4_0 (mtad_edge/bench/shapes.py: peaked logits, so greedy
decoding has no near-ties and any difference is a bug, not rounding). scripts/gpu-check.sh runs
this file on a GPU machine; CI runs it on the CPU."""

import os
from pathlib import Path

import numpy as np
import pytest

from helpers import (
    assert_beams_match_single_sequences,
    assert_drafting_equals_greedy_ar,
    logits_after_rollback,
    logits_fresh,
)
from mtad_edge.loader import ModelOptions, open_pair
from mtad_edge.pairs import Pair
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig

pytestmark = pytest.mark.slow

PROMPTS = ["Explain beam search in one paragraph.", "Why is the sky blue?", "Write a haiku about rain."]
ALL_LAYERS = -1
# A rolled-back draft leaves the cache's used span longer, and CUDA's attention tiles over that span:
# logits of a ~0.5 spread moved by up to 1.7e-4 on an H200 (2026-11-27); the CPU's stay within 1e-5.
ROLLBACK_ATOL = {"cpu": 1e-5, "gpu": 1e-3}
VOCAB_ENV = "MTAD_EDGE_VOCAB_GGUF"  # a GGUF to take the vocabulary from where the packaged models are not


@pytest.fixture(scope="module")
def random_files(tmp_path_factory, request):
    pytest.importorskip("gguf")
    from mtad_edge.bench.shapes import write_model

    vocab = Path(os.environ[VOCAB_ENV]) if VOCAB_ENV in os.environ else request.getfixturevalue("smol_files").target
    folder = tmp_path_factory.mktemp("random-smollm2")
    target = write_model("smollm2-135m", "f16", "normal", vocab, folder / "target-f16.gguf")
    aux = write_model("smollm2-135m", "q4_0", "normal", vocab, folder / "aux-q4_0.gguf")
    return Pair(target, aux)


@pytest.fixture(scope="module")
def offloaded(random_files):
    with open_pair(random_files, ["mmtad"], 4, 4, ModelOptions(n_ctx=512, n_gpu_layers=ALL_LAYERS)) as models:
        yield models


def _device() -> str:
    import llama_cpp

    return "gpu" if llama_cpp.llama_supports_gpu_offload() else "cpu"


def test_the_random_pair_is_offloaded_where_the_build_can(offloaded):
    print("device:", _device())
    for m in (offloaded.target, offloaded.aux):
        assert m.config.n_gpu_layers == ALL_LAYERS


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_greedy_drafting_equals_greedy_ar_offloaded(offloaded, method):
    stats = assert_drafting_equals_greedy_ar(offloaded.target, offloaded.aux, method, PROMPTS, 48)
    drafted = sum(st.drafted for st in stats)
    accepted = sum(st.accepted for st in stats)
    assert drafted > 0 and accepted > drafted // 2, (drafted, accepted)  # the aux is the target's quantization


def test_rollback_then_decode_equals_fresh_decode_offloaded(offloaded, random_files):
    ids = offloaded.target.tokenize("Name a color.")
    got = logits_after_rollback(offloaded.target, ids)
    with LlamaCppBackend(random_files.target, LlamaCppConfig(n_ctx=256, n_gpu_layers=ALL_LAYERS)) as fresh:
        want = logits_fresh(fresh, ids, [100], [555])  # the kept tokens in the same batch shapes
    np.testing.assert_allclose(got, want, rtol=0, atol=ROLLBACK_ATOL[_device()])
    assert got.argmax() == want.argmax()


def test_beams_as_batch_rows_equal_single_rows_offloaded(offloaded, random_files):
    with LlamaCppBackend(random_files.aux, LlamaCppConfig(n_ctx=256, n_gpu_layers=ALL_LAYERS)) as ref:
        assert_beams_match_single_sequences(offloaded.aux, ref, offloaded.aux.tokenize("Say hi."))


def test_random_bytes_models_load_and_give_finite_logits(tmp_path, random_files):
    """The timing kind (quantized blocks of random bytes, written without a float pass): llama.cpp
    loads it, its tensor types follow Q4_K_M's recipe, and its logits are finite."""
    from gguf import GGUFReader

    from mtad_edge.bench.shapes import write_model

    path = write_model("smollm2-135m", "q4_0", "bytes", random_files.target, tmp_path / "bytes.gguf")
    with LlamaCppBackend(path, LlamaCppConfig(n_ctx=64, n_gpu_layers=ALL_LAYERS)) as m:
        logits = np.array(m.decode(Batch.run(m.tokenize("Hello"), 0)))[-1]
    assert logits.shape == (m.n_vocab,) and np.isfinite(logits).all()
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["token_embd.weight"] == "Q4_0" and types["output_norm.weight"] == "F32"
    from mtad_edge.bench.shapes import tensor_type

    assert [tensor_type(f"blk.{i}.ffn_down.weight", "q4_k_m", 32, False) for i in (0, 4, 6, 31)] == [
        "q6_k",
        "q4_k",
        "q6_k",
        "q6_k",
    ]  # llama.cpp's use_more_bits: the first and last eighth, and every third layer between
    assert tensor_type("token_embd.weight", "q4_k_m", 16, True) == "q6_k"  # a tied embedding is the output


def test_rows_that_are_not_whole_k_blocks_take_llama_quantizes_fallbacks(tmp_path, random_files):
    """Qwen2.5-0.5B's 896-wide rows are not whole 256-weight blocks: as llama-quantize does, Q4_K
    falls back to Q5_0 and Q6_K to Q8_0 there; the file loads and gives finite logits."""
    from gguf import GGUFReader

    from mtad_edge.bench.shapes import write_model

    path = write_model("qwen2.5-0.5b", "q4_k_m", "bytes", random_files.target, tmp_path / "q.gguf", n_layer=1)
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q6_K"  # its rows are 4864 = 19 blocks of 256
    with LlamaCppBackend(path, LlamaCppConfig(n_ctx=64, n_gpu_layers=ALL_LAYERS)) as m:
        logits = np.array(m.decode(Batch.run(m.tokenize("Hello"), 0)))[-1]
    assert logits.shape == (151936,) and np.isfinite(logits).all()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("gpt-9", "f16", "normal"), "unknown shape"),
        (("smollm2-135m", "q3_k", "normal"), "unknown file type"),
        (("smollm2-135m", "f16", "bytes"), "quantized blocks only"),
        (("smollm2-135m", "q4_k_m", "normal"), "use --weights bytes"),
    ],
)
def test_random_models_refuse_what_they_cannot_make(tmp_path, random_files, args, needle):
    from mtad_edge.bench.shapes import write_model
    from mtad_edge.runtime.errors import MtadEdgeError

    with pytest.raises(MtadEdgeError, match=needle):
        write_model(*args, random_files.target, tmp_path / "x.gguf")
