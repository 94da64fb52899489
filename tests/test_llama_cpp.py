"""The llama.cpp backend and the decoders on the real embedded pair (SmolLM2-135M F16 + Q4_0)."""

import numpy as np
import pytest

from helpers import (
    assert_beams_match_single_sequences,
    assert_blocks_follow_trees,
    common_prefix,
    generate_tokens,
    logits_after_rollback,
    logits_fresh,
    near_tie_at_first_difference,
    record_trees,
)
from mtad_edge.loader import ModelOptions, open_pair
from mtad_edge.pairs import Pair
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.backends.llama_cpp_backend import (
    CPU_FLASH_ATTN_OFF_HEAD,
    LlamaCppBackend,
    LlamaCppConfig,
    flash_attention,
)
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.errors import IncompatiblePairError, ModelLoadError
from mtad_edge.textstream import detokenize

pytestmark = pytest.mark.slow

PROMPTS = [
    "Explain beam search in one paragraph.",
    "Write a Python function that reverses a string.",
    "Tell a short story about a robot who learns to paint.",
    "Why is the sky blue?",
]


def chat_ids(model, text):
    return model.tokenize(model.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def fresh(smol_files):
    with LlamaCppBackend(smol_files.target, LlamaCppConfig(n_ctx=256)) as m:
        yield m


def test_rollback_then_decode_equals_fresh_decode(smol_models, fresh):
    ids = chat_ids(smol_models.target, "Name a color.")
    got = logits_after_rollback(smol_models.target, ids)
    np.testing.assert_allclose(got, logits_fresh(fresh, ids, [100], [555]), rtol=0, atol=1e-5)


def test_rollback_falls_back_to_reprefill_when_seq_rm_refuses(smol_files, fresh, monkeypatch):
    with LlamaCppBackend(smol_files.target, LlamaCppConfig(n_ctx=256)) as m:
        ids = chat_ids(m, "Name a color.")
        m.decode(Batch.run(ids + [100, 200], 0, logits="none"))
        real_rm = m._lib.llama_memory_seq_rm
        monkeypatch.setattr(
            m._lib, "llama_memory_seq_rm", lambda mem, seq, p0, p1: False if p0 > 0 else real_rm(mem, seq, p0, p1)
        )
        m.rollback(0, len(ids))
        assert m.rollback_fallbacks == 1
        got = np.array(m.decode(Batch.run([555], len(ids))))[-1]
    np.testing.assert_allclose(got, logits_fresh(fresh, ids, [555]), rtol=0, atol=1e-5)


def test_beams_in_one_batch_match_single_sequence_decodes(smol_models, smol_files):
    # one_row as the loader loads an aux: the same kernels (AMX's one-row kernel where its tiles crash)
    with LlamaCppBackend(smol_files.aux, LlamaCppConfig(n_ctx=256, one_row=True)) as ref:
        assert_beams_match_single_sequences(smol_models.aux, ref, chat_ids(smol_models.aux, "Say hi."))


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_greedy_sd_and_mtad_equal_greedy_ar_on_the_real_pair(smol_models, gamma):
    """llama.cpp logits depend on batch shape: a one-row step (ar) and a multi-row verify round
    differently (without flash attention, the CPU default for these 64-wide heads, more than
    with it). So a greedy text may leave ar's at a near-tie (top two logits within 0.05) and
    nowhere else: 10 of 768 tokens did at gamma 4 (one prompt, sd and mtad alike); with 'auto'
    the draft lengths follow the machine's timings, so where varies between runs."""
    t, a = smol_models.target, smol_models.aux
    greedy = SamplingConfig(temperature=0.0)
    total = agree = 0
    for p in PROMPTS:
        ids = chat_ids(t, p)
        ar, _ = generate_tokens(t, None, ids, DecodeConfig("ar", 64, sampling=greedy))
        for method in ("sd", "mtad", "mmtad"):
            out, st = generate_tokens(t, a, ids, DecodeConfig(method, 64, gamma=gamma, gamma_max=4, sampling=greedy))
            total += len(ar)
            agree += common_prefix(ar, out)
            assert st.drafted > 0 and 0 < st.acceptance_rate <= 1
            if near_tie_at_first_difference(t, ids, ar, out, tol=5e-2) is not None:
                print(method, p, "left ar's text at a near-tie")
    print(f"greedy sd/mtad vs ar agreement: {agree}/{total} tokens")


@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mmtad"])
def test_sampled_generation_gives_text_and_consistent_stats(smol_models, method):
    t, a = smol_models.target, smol_models.aux
    ids = chat_ids(t, "Write two sentences about the ocean.")
    out, st = generate_tokens(t, a, ids, DecodeConfig(method, 48, gamma=4, seed=3))
    text = detokenize(t, out)
    assert len(out) == st.generated > 0 and len(text.strip()) > 0
    assert all(0 <= x < t.n_vocab for x in out) and not any(t.is_eog(x) for x in out)
    assert st.accepted <= st.drafted and st.block_efficiency == pytest.approx(len(out) / st.target_calls)
    if method == "ar":  # a call per token, and one more for the end of the text where it ended
        assert st.target_calls == len(out) + (st.finish_reason == "stop")
    else:  # gamma 4 but where the 48-token budget leaves less: the room left, once per length (it shrinks)
        assert st.drafted == sum(g * n for g, n in st.gamma_hist.items()) and st.block_efficiency > 1.0
        assert sum(st.gamma_hist.values()) == st.target_calls
        assert all(n == 1 for g, n in st.gamma_hist.items() if g != 4) and set(st.gamma_hist) <= {0, 1, 2, 3, 4}
    again, _ = generate_tokens(t, a, ids, DecodeConfig(method, 48, gamma=4, seed=3))
    assert again == out  # fixed seed and gamma, same tokens


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_auto_gamma_on_the_real_pair_keeps_consistent_histograms(smol_models, method):
    t, a = smol_models.target, smol_models.aux
    ids = chat_ids(t, "Write two sentences about the ocean.")
    cfg = DecodeConfig(method, 64, gamma="auto", gamma_max=4, beam_width="auto" if method != "sd" else 4, seed=3)
    out, st = generate_tokens(t, a, ids, cfg)
    assert len(out) == st.generated > 0 and st.accepted <= st.drafted
    assert sum(st.gamma_hist.values()) == st.target_calls  # one target call per step
    assert sum(st.width_hist.values()) == sum(n for g, n in st.gamma_hist.items() if g > 0)
    assert set(st.gamma_hist) <= set(range(0 if method == "sd" else 1, 5)) and set(st.width_hist) <= {1, 2, 3, 4}
    assert st.drafted == sum(g * n for g, n in st.gamma_hist.items())
    assert st.predicted_tokens_per_s > 0 and 0 < st.controller_s < st.decode_s


def test_mmtad_on_the_real_pair_commits_paths_of_the_drafted_tree(smol_models, monkeypatch):
    t, a = smol_models.target, smol_models.aux
    trees = record_trees(monkeypatch)
    gen = Generation(
        t, a, chat_ids(t, "Describe a sunset in three sentences."), DecodeConfig("mmtad", 96, gamma=4, seed=7)
    )
    blocks = list(gen)
    st = gen.stats
    assert st.finish_reason in ("length", "stop") and st.generated == sum(map(len, blocks)) > 0
    n = len(blocks) - 1  # the last block may be cut by max_tokens or end-of-generation
    assert_blocks_follow_trees(blocks[:n], trees[:n], st.accept_lengths[:n])
    assert any(len(tr) > 1 and len({tuple(b) for b in tr.tolist()}) > 1 for tr in trees)  # real trees, not one path
    assert st.accepted <= st.drafted == 4 * st.target_calls
    assert st.block_efficiency == pytest.approx(st.generated / st.target_calls)


def test_identical_vocabularies_take_the_fast_path_and_refuse_insists_on_them(smol_files, gemma_files):
    with open_pair(smol_files, ["mtad"], 4, 4, ModelOptions(n_ctx=128)) as ok:
        assert ok.aux is not None and ok.vocab is None  # the same vocabulary: no map
    with pytest.raises(IncompatiblePairError, match="vocabulary .* differs"):
        open_pair(
            Pair(smol_files.target, gemma_files.aux), ["mtad"], 4, 4, ModelOptions(n_ctx=128, vocab_mismatch="refuse")
        )
    with open_pair(Pair(smol_files.target, gemma_files.aux), ["mtad"], 4, 4, ModelOptions(n_ctx=128)) as cross:
        assert cross.vocab is not None  # different vocabularies draft in their shared tokens


def test_gemma_pair_generates(gemma_files):
    cfg = DecodeConfig("mtad", 24, seed=0)
    with open_pair(gemma_files, ["mtad"], 4, 4, ModelOptions(n_ctx=256)) as m:
        prompt = m.render_chat([{"role": "user", "content": "Name three fruits."}])
        assert prompt.startswith("<start_of_turn>user\n")  # the manifest's built-in template
        out, st = generate_tokens(m.target, m.aux, m.target.tokenize(prompt), cfg)
    assert st.generated == len(out) > 0 and st.target_calls > 0


def test_flash_attention_is_off_on_the_cpu_for_narrow_heads_unless_asked_for():
    head = CPU_FLASH_ATTN_OFF_HEAD
    assert flash_attention(None, True, head) is False  # SmolLM2's 64-wide heads on the CPU
    assert flash_attention(None, True, 4 * head) is None  # Gemma's 256: llama.cpp decides
    assert flash_attention(None, True, 0) is None  # a width the file does not give: llama.cpp decides
    assert flash_attention(None, False, head) is None  # offloaded to a GPU: llama.cpp decides
    assert flash_attention(True, True, head) is True and flash_attention(False, False, 4 * head) is False


def test_contexts_run_the_flash_attention_chosen_for_their_heads(smol_models, smol_files, gemma_files, fresh):
    """The default pair runs without it on the CPU and gives the logits it gives with it (up to
    rounding); Gemma 3's wide heads leave the choice to llama.cpp; asking wins."""
    assert smol_models.target.flash_attn is False and smol_models.aux.flash_attn is False
    with LlamaCppBackend(gemma_files.target, LlamaCppConfig(n_ctx=128)) as gemma:
        assert gemma.flash_attn is None
    ids = chat_ids(fresh, "Name a color.")
    with LlamaCppBackend(smol_files.target, LlamaCppConfig(n_ctx=256, flash_attn=True)) as on:
        assert on.flash_attn is True
        with_it = logits_fresh(on, ids, [100, 200, 300])
    without = logits_fresh(fresh, ids, [100, 200, 300])
    np.testing.assert_allclose(with_it, without, rtol=0, atol=5e-2)
    assert with_it.argmax() == without.argmax()


def test_a_calibration_is_kept_per_flash_attention(smol_models, monkeypatch):
    """A call's cost depends on it, so costs timed with it on never seed a context without it."""
    from mtad_edge.calibrate import cache_key

    key = cache_key(smol_models, ModelOptions(n_ctx=512), [1, 5], [1, 4])
    monkeypatch.setattr(smol_models.target, "flash_attn", True)
    assert cache_key(smol_models, ModelOptions(n_ctx=512), [1, 5], [1, 4]) != key


def test_the_aux_is_placed_by_its_own_gpu_layers(smol_files):
    """--aux-gpu-layers (llama.cpp's -ngld): the aux loads with its own n_gpu_layers and the target
    with its own; unset, the aux takes the manifest's, else the target's. Without a GPU all of them run."""
    from mtad_edge.loader import _gpu_layers
    from mtad_edge.pairs import Manifest

    def placement(pair, **opts):
        with open_pair(pair, ["sd"], 4, 1, ModelOptions(n_ctx=128, **opts)) as m:
            return m.target.config.n_gpu_layers, m.aux.config.n_gpu_layers

    cfg = DecodeConfig("sd", 8, gamma=4, sampling=SamplingConfig(temperature=0.0))
    with open_pair(smol_files, ["sd"], 4, 1, ModelOptions(n_ctx=128, aux_gpu_layers=0)) as m:
        assert (m.target.config.n_gpu_layers, m.aux.config.n_gpu_layers) == (_gpu_layers(None), 0)
        out, st = generate_tokens(m.target, m.aux, chat_ids(m.target, "Name a color."), cfg)
        assert st.generated == len(out) > 0 and st.drafted > 0
    assert placement(smol_files, n_gpu_layers=-1) == (-1, -1)  # unset: as the target, as before
    on_cpu = Pair(
        smol_files.target,
        smol_files.aux,
        Manifest({**smol_files.manifest.data, "aux_gpu_layers": 0}, smol_files.manifest.path, True),
    )
    assert placement(on_cpu, n_gpu_layers=-1) == (-1, 0)  # the manifest's
    assert placement(on_cpu, n_gpu_layers=0, aux_gpu_layers=-1) == (0, -1)  # the option beats the manifest


def test_a_calibration_is_kept_per_aux_placement(smol_models, monkeypatch):
    """A draft on the CPU costs otherwise than one on a GPU: their costs never seed each other."""
    from dataclasses import replace

    from mtad_edge.calibrate import cache_key

    key = cache_key(smol_models, ModelOptions(n_ctx=512), [1, 5], [1, 4])
    monkeypatch.setattr(smol_models.aux, "config", replace(smol_models.aux.config, n_gpu_layers=7))
    assert cache_key(smol_models, ModelOptions(n_ctx=512), [1, 5], [1, 4]) != key


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", r"is empty \(0 bytes\), not a model file"),
        (b"PK\x03\x04 this is a zip, not a model" * 10, "not a GGUF file"),
        (
            b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64,
            "its GGUF header: it declares 18446744073709551615 tensors",
        ),
    ],
)
def test_corrupt_or_foreign_files_give_a_clear_error(tmp_path, content, needle):
    f = tmp_path / "bad.gguf"
    f.write_bytes(content)
    with pytest.raises(ModelLoadError, match=needle):
        LlamaCppBackend(f)


def test_truncated_gguf_gives_a_clear_error(tmp_path, smol_files):
    f = tmp_path / "half.gguf"
    with open(smol_files.aux, "rb") as src:
        f.write_bytes(src.read(5_000_000))
    with pytest.raises(ModelLoadError, match="could not load .*corrupted or incomplete"):
        LlamaCppBackend(f)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LlamaCppBackend(tmp_path / "nope.gguf")
