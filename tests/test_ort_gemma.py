"""ONNX Runtime on Gemma 3 270M: an export without position_ids, a SentencePiece vocabulary of
262144 tokens, and mixed pairs with the llama.cpp Q4_K_M aux."""

import pytest

from helpers import assert_drafting_equals_greedy_ar, assert_rollback_equals_fresh, greedy_agreement
from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig
from mtad_edge.runtime.backends.ort_backend import OrtBackend, OrtConfig
from mtad_edge.runtime.text.compat import check_pair

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def gemma_onnx(onnx_gemma):
    with OrtBackend(onnx_gemma, OrtConfig(n_ctx=256)) as b:
        yield b


@pytest.fixture(scope="module")
def gemma_cpp(gemma_files):
    with (
        LlamaCppBackend(gemma_files.target, LlamaCppConfig(n_ctx=256)) as f16,
        LlamaCppBackend(gemma_files.aux, LlamaCppConfig(n_ctx=256, n_seq_max=9)) as q4,
    ):
        yield f16, q4


def test_export_has_no_position_ids_and_tokenizes_like_llama_cpp(onnx_gemma, gemma_onnx, gemma_cpp):
    import onnxruntime as ort

    names = {i.name for i in ort.InferenceSession(str(onnx_gemma / "model.onnx")).get_inputs()}
    assert "position_ids" not in names and "attention_mask" in names
    f16, _ = gemma_cpp
    text = "Hello world,  twice\n\nÜnïcödé 東京 🙂 <start_of_turn>user\nx = 2**10  # ok"
    assert gemma_onnx.tokenize(text) == f16.tokenize(text)
    ids = gemma_onnx.tokenize(text)
    assert b"".join(gemma_onnx.token_bytes(t) for t in ids) == b"".join(f16.token_bytes(t) for t in ids)


def test_greedy_ar_agrees_with_hf_and_llama_cpp_f16(gemma_onnx, gemma_cpp, hf_gemma):
    agree, total = greedy_agreement(gemma_onnx, hf_gemma, gemma_cpp[0], PROMPTS)
    print(f"Gemma 3 ONNX fp32 greedy agreement over {total} tokens: {agree}")
    assert agree["hf"] / total >= 0.95 and agree["llama.cpp F16"] / total >= 0.9


@pytest.mark.parametrize("method", ["sd", "mtad"])
def test_mixed_pair_onnx_target_llama_cpp_aux_greedy_equals_ar(gemma_onnx, gemma_cpp, method):
    _, q4 = gemma_cpp
    check_pair(gemma_onnx, q4)
    assert all(st.accepted > 0 for st in assert_drafting_equals_greedy_ar(gemma_onnx, q4, method, PROMPTS, 16))


def test_rollback_then_decode_equals_fresh_decode_without_position_ids(gemma_onnx):
    assert_rollback_equals_fresh(gemma_onnx, atol=1e-3)


@pytest.mark.parametrize("name", ["gemma", "chatml"])
def test_builtin_chat_templates_render_as_llama_cpp_does(gemma_onnx, gemma_cpp, name):
    f16, _ = gemma_cpp
    chat = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi!\n"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a color."},
    ]
    for messages in (chat, chat[1:2]):
        for add in (True, False):
            want = f16.apply_chat_template(messages, template=name, add_assistant=add)
            assert gemma_onnx.apply_chat_template(messages, template=name, add_assistant=add) == want


def test_unknown_builtin_template_is_a_clear_error(gemma_onnx):
    from mtad_edge.runtime.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="unknown built-in chat template 'vicuna-x'"):
        gemma_onnx.apply_chat_template([{"role": "user", "content": "hi"}], template="vicuna-x")
