"""The ONNX Runtime backend on an ONNX export of the embedded SmolLM2 (fp32 target, int4 aux)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import (
    assert_drafting_equals_greedy_ar,
    assert_rollback_equals_fresh,
    decode_beams,
    generate_tokens,
    greedy_agreement,
)
from mtad_edge.cli import cli
from mtad_edge.loader import ModelOptions, open_pair
from mtad_edge.pairs import Pair, load_manifest, prepare
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.backends.ort_backend import OrtBackend, OrtConfig
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.text.compat import check_pair

pytestmark = pytest.mark.slow
HAS_CUDA = "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers()
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def ort_models(onnx_pair):
    with open_pair(prepare(load_manifest(onnx_pair)), ["mmtad"], 4, 4, ModelOptions(n_ctx=512)) as m:
        yield m


def test_greedy_ar_on_onnx_agrees_with_hf_and_llama_cpp(ort_models, hf_smol, smol_files):
    from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig

    with LlamaCppBackend(smol_files.target, LlamaCppConfig(n_ctx=256)) as f16:
        agree, total = greedy_agreement(ort_models.target, hf_smol, f16, PROMPTS)
    print(f"ONNX fp32 greedy agreement over {total} tokens: {agree}")
    assert agree["hf"] / total >= 0.95


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_greedy_drafting_methods_equal_greedy_ar_on_onnx(ort_models, method):
    stats = assert_drafting_equals_greedy_ar(ort_models.target, ort_models.aux, method, PROMPTS, 24)
    assert all(st.drafted > 0 for st in stats)


def test_auto_gamma_on_onnx_keeps_consistent_histograms(ort_models):
    t, a = ort_models.target, ort_models.aux
    out, st = generate_tokens(t, a, t.tokenize(PROMPTS[0]), DecodeConfig("mtad", 32, gamma="auto", gamma_max=4, seed=2))
    assert len(out) == st.generated > 0
    assert sum(st.gamma_hist.values()) == st.target_calls and st.drafted == sum(g * n for g, n in st.gamma_hist.items())


def test_onnx_target_drafts_with_a_llama_cpp_aux_of_another_family(onnx_pair, gemma_files):
    """SmolLM2 fp32 on ONNX Runtime, Gemma 3 270M Q4_K_M on llama.cpp: greedy drafting equals ar."""
    pair = prepare(load_manifest(onnx_pair))
    with open_pair(Pair(pair.target, gemma_files.aux), ["sd", "mtad"], 4, 4, ModelOptions(n_ctx=256)) as m:
        assert m.vocab is not None
        for method in ("sd", "mtad"):
            ids = m.target.tokenize(PROMPTS[0])
            greedy = SamplingConfig(temperature=0.0)
            ar, _ = generate_tokens(m.target, None, ids, DecodeConfig("ar", 24, sampling=greedy))
            gen = Generation(m.target, m.aux, ids, DecodeConfig(method, 24, gamma=4, sampling=greedy), vocab=m.vocab)
            assert [t for b in gen for t in b] == ar and gen.stats.drafted > 0


def test_rollback_then_decode_equals_fresh_decode_on_onnx(ort_models):
    assert_rollback_equals_fresh(ort_models.target, atol=1e-4)


def test_long_inputs_run_in_chunks_with_the_same_logits(ort_models, monkeypatch):
    t = ort_models.target
    ids = t.tokenize("Once upon a time, in a small village by the sea, there lived an old fisherman who")
    t.rollback(0, 0)
    whole = np.array(t.decode(Batch.run(ids, 0, logits="all")))
    assert t._chunk >= len(ids)  # one run: 682 tokens of 49152 logits fit in the 128 MB budget
    monkeypatch.setattr(t, "_chunk", 5)
    t.rollback(0, 0)
    chunked = np.array(t.decode(Batch.run(ids, 0, logits="all")))
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)
    nxt = int(np.argmax(chunked[-1]))
    after = np.array(t.decode(Batch.run([nxt], len(ids))))[-1]  # the cache built in chunks continues
    monkeypatch.undo()
    t.rollback(0, 0)
    t.decode(Batch.run(ids, 0, logits="none"))
    np.testing.assert_allclose(after, np.array(t.decode(Batch.run([nxt], len(ids))))[-1], rtol=0, atol=1e-4)


def test_beams_as_batch_rows_match_single_rows(ort_models):
    a = ort_models.aux
    ids = a.tokenize("Say hi.")
    together = decode_beams(a, ids, [10, 20, 30])
    for s, tok in enumerate([10, 20, 30], start=1):
        a.rollback(s, len(ids))
        alone = np.array(a.decode(Batch.run([tok], len(ids), seq=s)))[-1]
        np.testing.assert_allclose(together[s - 1], alone, rtol=0, atol=1e-3)
        a.rollback(s, 0)


def test_sampled_mtad_on_onnx_and_int4_generates(ort_models):
    t, a = ort_models.target, ort_models.aux
    ids = t.tokenize(t.apply_chat_template([{"role": "user", "content": "Write a sentence about rain."}]))
    out, st = generate_tokens(t, a, ids, DecodeConfig("mtad", 32, gamma=4, seed=2))
    assert st.generated == len(out) > 0 and st.accepted <= st.drafted
    aux_only, _ = generate_tokens(a, None, ids, DecodeConfig("ar", 16, seed=2))  # the int4 model alone
    assert aux_only


def test_mixed_pair_llama_cpp_target_onnx_aux(onnx_pair, smol_files):
    aux_dir = onnx_pair.parent / "aux"
    with open_pair(Pair(smol_files.target, aux_dir), ["sd"], 4, 4, ModelOptions(n_ctx=256)) as m:
        check_pair(m.target, m.aux)
        [st] = assert_drafting_equals_greedy_ar(m.target, m.aux, "sd", ["The capital of France is"], 16)
    assert st.drafted > 0


def test_cli_generate_with_an_onnx_manifest(onnx_pair):
    r = CliRunner().invoke(
        cli,
        [
            "generate",
            "--manifest",
            str(onnx_pair),
            "--json",
            "--method",
            "mtad",
            "--max-tokens",
            "8",
            "--seed",
            "1",
            "--chat",
            "Hello",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["stats"]["method"] == "mtad"
    r = CliRunner().invoke(cli, ["generate", "--manifest", str(onnx_pair), "--backend", "llama.cpp", "hi"])
    assert r.exit_code == 1 and "cannot run" in r.stderr


@pytest.fixture(scope="module")
def ort_on_device(onnx_pair, ort_models):
    """The same pair with caches kept as OrtValues through IO binding: the CUDA code path
    (helper graphs for cuts, joins and batch rows), here on the CPU provider."""
    d = onnx_pair.parent
    with (
        OrtBackend(d / "target", OrtConfig(n_ctx=512, n_seq_max=ort_models.target.n_seq_max, io_binding=True)) as t,
        OrtBackend(d / "aux", OrtConfig(n_ctx=512, n_seq_max=ort_models.aux.n_seq_max, io_binding=True)) as a,
    ):
        yield t, a


@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mmtad"])
def test_caches_on_device_decode_exactly_as_host_caches(ort_models, ort_on_device, method):
    t, a = ort_on_device
    assert t.io_binding and not ort_models.target.io_binding
    ids = t.tokenize("Once upon a time, in a small village by the sea, there lived an old fisherman who")
    cfg = DecodeConfig(method, 32, gamma=4, seed=5)  # a fixed gamma: the same steps on both
    host, hs = generate_tokens(ort_models.target, None if method == "ar" else ort_models.aux, ids, cfg)
    dev, ds = generate_tokens(t, None if method == "ar" else a, ids, cfg)
    assert dev == host and (ds.accepted, ds.drafted) == (hs.accepted, hs.drafted)
    assert_rollback_equals_fresh(t, atol=1e-4)


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA")
def test_provider_cuda_without_cuda_is_a_clear_error(onnx_pair):
    from mtad_edge.runtime.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--provider cuda: this onnxruntime has no CUDAExecutionProvider"):
        OrtBackend(onnx_pair.parent / "target", OrtConfig(provider="cuda"))
    r = CliRunner().invoke(cli, ["generate", "--manifest", str(onnx_pair), "--provider", "cuda", "hi"])
    assert r.exit_code == 1 and r.output.startswith("Error: --provider cuda")


@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu and a GPU")
@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_cuda_keeps_caches_on_the_gpu_and_greedy_drafting_equals_greedy_ar(onnx_pair, method):
    d = onnx_pair.parent
    with (
        OrtBackend(d / "target", OrtConfig(n_ctx=512, n_seq_max=5, provider="cuda")) as t,
        OrtBackend(d / "aux", OrtConfig(n_ctx=512, n_seq_max=9, provider="cuda")) as a,
    ):
        assert t.provider == "CUDAExecutionProvider" and t.io_binding and a.io_binding
        assert all(st.drafted > 0 for st in assert_drafting_equals_greedy_ar(t, a, method, PROMPTS, 24))
        assert_rollback_equals_fresh(t, atol=1e-3)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_attention_heads": None}, "num_attention_heads must be a positive integer, not None"),  # a KeyError
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, not 0"),  # ZeroDivisionError
        ({"num_key_value_heads": "3"}, "num_key_value_heads must be a positive integer, not '3'"),
        ({"hidden_size": 4, "head_dim": None}, "hidden_size is smaller than num_attention_heads"),
        ({"eos_token_id": {"id": 2}}, "eos_token_id must be a token id or a list of them"),  # a TypeError
        ({"vocab_size": "HUGE"}, "a number over 4300 digits long"),  # written as 5000 digits below
        ({"bos_token": 5}, "bos_token must be a token's text, not 5"),  # tokenizer_config.json: an AttributeError
        ({"eos_token": {"content": ["</s>"]}}, "eos_token must be a token's text"),
    ],
)
def test_a_malformed_onnx_config_is_a_one_line_load_error(onnx_pair, tmp_path, change, needle):
    """config.json and tokenizer_config.json come with the model folder, so they are untrusted: a
    bad head count was a KeyError, ZeroDivisionError or TypeError traceback."""
    from mtad_edge.runtime.errors import ModelLoadError

    src = onnx_pair.parent / "target"
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    name = "tokenizer_config.json" if {"bos_token", "eos_token"} & set(change) else "config.json"
    cfg = {**json.loads((src / name).read_text()), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None or k == "head_dim"}
    (tmp_path / name).unlink()
    (tmp_path / name).write_text(json.dumps(cfg).replace('"HUGE"', "9" * 5000))
    with pytest.raises(ModelLoadError) as e:
        OrtBackend(tmp_path, OrtConfig(n_ctx=64))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
