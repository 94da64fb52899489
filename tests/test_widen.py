"""`mtad-edge export widen`: SmolLM2 widened 2x computes what the original computes (same logits up to
float rounding, same greedy tokens) and loads as a pair; bad input is one line, from the CLI and the API."""

import json
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("gguf")

from mtad_edge.cli import cli  # noqa: E402
from mtad_edge.export.widen import StandinExport, export_standin, widen  # noqa: E402
from mtad_edge.pairs import load_manifest, prepare  # noqa: E402
from mtad_edge.runtime.backend import Batch  # noqa: E402
from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig  # noqa: E402
from mtad_edge.runtime.errors import MtadEdgeError  # noqa: E402
from mtad_edge.store import sha256_file  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return"]
# llama.cpp rounds activations to F16 for F16 weights, and the widened sums run in another order:
# SmolLM2 x2 differs from the original by ~0.02 on logits of magnitude ~30.
ATOL = 0.1


def all_logits(path: Path, prompt: str) -> np.ndarray:
    with LlamaCppBackend(path, LlamaCppConfig(n_ctx=64, n_threads=2)) as b:
        return np.array(b.decode(Batch.run(b.tokenize(prompt), 0, logits="all")))


def metadata(path: Path) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    keys = ["embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv"]
    return {k: fields[f"llama.{k}"].contents() for k in [*keys, "rope.dimension_count", "block_count"]}


@pytest.mark.slow
def test_widened_x2_target_gives_the_original_logits(smol_files, tmp_path):
    out = tmp_path / "smol-x2"
    r = CliRunner().invoke(cli, ["export", "widen", "--target", "smollm2-135m", "--factor", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    manifest = Path(r.stdout.strip().splitlines()[-1])
    assert manifest == out / "manifest.json"
    data = json.loads(manifest.read_text())
    assert data["standin"] == {"factor": 2, "of": smol_files.target.name, "parameters": 537_989_760}
    assert "stand-in" in data["description"] and "not a 538M model" in data["description"]
    pair = prepare(load_manifest(manifest))
    assert sorted(p.name for p in out.iterdir()) == sorted([pair.target.name, pair.aux.name, "manifest.json"])
    assert sha256_file(pair.target) == data["target"]["sha256"]
    assert sha256_file(pair.aux) == data["aux"]["sha256"] == sha256_file(smol_files.aux)

    before, after = metadata(smol_files.target), metadata(pair.target)
    assert after == {**before, **{k: 2 * before[k] for k in list(before)[:4]}}  # head and RoPE dims unchanged

    for prompt in PROMPTS:
        a, b = all_logits(smol_files.target, prompt), all_logits(pair.target, prompt)
        assert a.shape == b.shape and np.abs(a - b).max() < ATOL, np.abs(a - b).max()
        assert (a.argmax(axis=1) == b.argmax(axis=1)).all()  # the greedy next token after every prefix

    # The manifest loads as a pair, and the stand-in's greedy text is the original's.
    run = ["generate", "--method", "ar", "--max-tokens", "8", "--temperature", "0", "--threads", "2", PROMPTS[0]]
    original = CliRunner().invoke(cli, [*run, "--pair", "smollm2-135m"])
    standin = CliRunner().invoke(cli, [*run, "--pair", str(manifest)])
    assert original.exit_code == standin.exit_code == 0, standin.output
    assert standin.stdout == original.stdout


def bad_inputs(tmp_path: Path, gemma: Path, quantized: Path) -> list:
    junk = tmp_path / "notes.txt"
    junk.write_text("not a model\n")
    return [  # (source, factor, destination, needle)
        (gemma, 2, tmp_path / "g", "'gemma3' model: widen supports the llama architecture only"),
        (junk, 2, tmp_path / "j", "is not a GGUF file"),
        (quantized, 2, tmp_path / "q", "Q4_0"),
        (gemma, 1, tmp_path / "k", "at least 2 (got 1)"),
        (tmp_path / "missing.gguf", 2, tmp_path / "m", "no such file"),
    ]


@pytest.mark.slow  # the real Gemma and SmolLM2 files (only their headers are read)
def test_bad_input_is_one_line_from_the_cli(gemma_files, smol_files, tmp_path):
    for src, k, dest, needle in bad_inputs(tmp_path, gemma_files.target, smol_files.aux):
        args = ["export", "widen", "--target", str(src), "--aux", str(smol_files.aux), "--factor", str(k)]
        r = CliRunner().invoke(cli, [*args, "--out", str(dest)])
        assert r.exit_code == 1, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error:") and needle in lines[0], r.stderr
        assert "Traceback" not in r.output and not dest.exists()  # checked before anything is written


@pytest.mark.slow  # the real SmolLM2 files' headers
def test_an_output_folder_that_cannot_be_made_is_a_one_line_error(smol_files, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["export", "widen", "--target", str(smol_files.target), "--aux", str(smol_files.aux), "--factor", "2"]
    r = CliRunner().invoke(cli, [*args, "--out", str(blocker / "x2")])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot make the output folder"), r.stderr
    with pytest.raises(MtadEdgeError, match="^cannot make the output folder [^\n]*Not a directory"):
        export_standin(StandinExport(smol_files.target, 2, blocker / "x2", smol_files.aux))


@pytest.mark.slow
def test_bad_input_raises_from_the_api(gemma_files, smol_files, tmp_path):
    for src, k, dest, needle in bad_inputs(tmp_path, gemma_files.target, smol_files.aux):
        with pytest.raises(MtadEdgeError, match="^[^\n]*$") as e:
            widen(src, k, dest / "w.gguf")
        assert needle in str(e.value)
        with pytest.raises(MtadEdgeError, match="^[^\n]*$") as e:
            export_standin(StandinExport(src, k, dest, smol_files.aux))
        assert needle in str(e.value) and not dest.exists()

    existing = tmp_path / "taken.gguf"
    existing.write_bytes(b"")
    with pytest.raises(MtadEdgeError, match="exists; pass --overwrite"):
        widen(smol_files.target, 2, existing)
    with pytest.raises(MtadEdgeError, match="needs an aux"):
        export_standin(StandinExport(smol_files.target, 2, tmp_path / "no-aux"))


@pytest.mark.slow
def test_q8_0_standin_is_the_original_q8_0_widened(smol_files, tmp_path):
    """Q8_0 blocks (32 weights along a row) lie inside one copy, so quantizing the widened model
    quantizes the original's blocks again, scaled by 1/k: every copy holds the same numbers."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = tmp_path / "smol-x2-q8"
    manifest = export_standin(StandinExport(smol_files.target, 2, out, smol_files.aux, outtype="q8_0"))
    data = json.loads(manifest.read_text())
    assert data["target"]["derive"]["ftype"] == "Q8_0" and "quantized to Q8_0" in data["description"]
    files = [data["target"]["file"], data["aux"]["file"], "manifest.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # the F16 intermediate is gone
    widened = {t.name: t for t in GGUFReader(out / data["target"]["file"]).tensors}
    original = {t.name: t for t in GGUFReader(smol_files.target).tensors}
    for name in ("blk.3.attn_k.weight", "blk.3.ffn_down.weight", "output.weight"):
        assert widened[name].tensor_type.name == "Q8_0"
        w = dequantize(widened[name].data, widened[name].tensor_type)
        source = original["token_embd.weight" if name == "output.weight" else name].data.astype(np.float32)
        rows, cols = source.shape
        copy = w[:rows, :cols]
        assert (w == np.tile(copy, (w.shape[0] // rows, 2))).all()
        assert np.abs(copy * 2 - source).max() <= np.abs(source).max() / 127


# -- crafted GGUFs: metadata of the wrong type is one line before anything is written ------------------
def tiny_llama(path: Path, kv: dict, skip: tuple = (), shapes: Optional[dict] = None) -> Path:
    """A one-block Llama GGUF 8 wide (2 heads) with the KV fields ``kv`` ({key: (value, GGUFValueType)})
    over the usual ones, the keys in ``skip`` left out, and block matrices of other ``shapes``."""
    from gguf import GGUFValueType as T
    from gguf import GGUFWriter

    e, f = 8, 16
    fields = {"embedding_length": e, "feed_forward_length": f, "attention.head_count": 2}
    fields |= {"attention.head_count_kv": 2, "block_count": 1, "rope.dimension_count": 4}
    fields = {f"llama.{k}": (v, T.UINT32) for k, v in fields.items()} | kv
    w = GGUFWriter(path, "llama")
    for key, (value, vtype) in fields.items():
        if key not in skip:
            w.add_key_value(key, value, vtype, sub_type=T.STRING if vtype == T.ARRAY else None)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d"])
    mats = {"attn_q": (e, e), "attn_k": (e, e), "attn_v": (e, e), "attn_output": (e, e)}
    mats |= {"ffn_gate": (f, e), "ffn_up": (f, e), "ffn_down": (e, f)} | (shapes or {})
    w.add_tensor("token_embd.weight", np.ones((4, e), np.float16))
    for name, shape in mats.items():
        w.add_tensor(f"blk.0.{name}.weight", np.ones(shape, np.float16))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(e, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "kv,needle",
    [
        ({"llama.embedding_length": ("eight", "STRING")}, "llama.embedding_length must be a non-negative integer"),
        ({"llama.attention.head_count": ("2", "STRING")}, "llama.attention.head_count must be"),
        ({"llama.attention.head_count_kv": (["a"], "ARRAY")}, "llama.attention.head_count_kv must be"),
        ({"llama.feed_forward_length": (-16, "INT32")}, "got -16"),
        ({"llama.embedding_length": (2**63, "UINT64")}, "fits its type 2 times over"),  # a struct.error before
        ({"mtad_edge.widen.factor": (2, "UINT32")}, "needs mtad_edge.widen.source, a string"),  # a KeyError before
        ({"mtad_edge.widen.factor": ("2", "STRING"), "mtad_edge.widen.source": ("x", "STRING")}, "factor must be"),
        # well typed, but no model llama.cpp loads: it refused the file only after all of it was written
        ({"llama.attention.head_count": (0, "UINT32")}, "must be at least 1"),
        ({"llama.attention.head_count_kv": (0, "UINT32")}, "must be at least 1"),
        ({"llama.attention.head_count": (3, "UINT32")}, "the KV heads must divide the heads"),
    ],
)
def test_metadata_of_the_wrong_type_is_one_line_before_anything_is_written(tmp_path, kv, needle):
    """Each of these was a ValueError, TypeError, KeyError or struct.error traceback midway through."""
    from gguf import GGUFValueType

    kv = {k: (v, GGUFValueType[t]) for k, (v, t) in kv.items()}
    src = tiny_llama(tmp_path / "src.gguf", kv)
    with pytest.raises(MtadEdgeError, match="^[^\n]*$") as e:
        export_standin(StandinExport(src, 2, tmp_path / "out", src))
    assert needle in str(e.value) and not (tmp_path / "out").exists(), str(e.value)
    r = CliRunner().invoke(
        cli, ["export", "widen", "--target", str(src), "--aux", str(src), "--factor", "2", "--out", str(tmp_path / "o")]
    )
    assert r.exit_code == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize(
    "shapes,kv,needle",
    [
        ({"attn_q": (12, 8)}, {}, "blk.0.attn_q.weight is [12, 8], the metadata makes it [8, 8]"),
        ({"ffn_down": (8, 8)}, {}, "blk.0.ffn_down.weight is [8, 8], the metadata makes it [8, 16]"),
        ({"attn_k": (8, 8)}, {"llama.attention.head_count_kv": (1, "UINT32")}, "makes it [4, 8]"),
        (
            {},
            {"llama.attention.key_length": (2, "UINT32")},
            "blk.0.attn_q.weight is [8, 8], the metadata makes it [4, 8]",
        ),
        (
            {},
            {"llama.attention.key_length": ("4", "STRING")},
            "llama.attention.key_length must be a non-negative integer",
        ),
    ],
)
def test_a_tensor_shape_the_metadata_does_not_give_is_one_line_before_anything_is_written(tmp_path, shapes, kv, needle):
    """Well-typed metadata, a tensor of another shape: widen wrote the whole stand-in and llama.cpp
    refused it at load."""
    from gguf import GGUFValueType

    kv = {k: (v, GGUFValueType[t]) for k, (v, t) in kv.items()}
    src = tiny_llama(tmp_path / "src.gguf", kv, shapes=shapes)
    with pytest.raises(MtadEdgeError, match="^[^\n]*$") as e:
        export_standin(StandinExport(src, 2, tmp_path / "out", src))
    assert needle in str(e.value) and not (tmp_path / "out").exists(), str(e.value)


def test_keys_widen_rewrites_are_written_with_their_own_types(tmp_path, monkeypatch):
    """general.file_type given as a string made GGUFWriter fail (a TypeError); a string vocab_size failed
    as int() did. Now the file type is written as a UINT32 and the manifest counts the token texts."""
    from gguf import GGUFReader
    from gguf import GGUFValueType as T

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    kv = {
        "general.file_type": ("F16", T.STRING),
        "general.size_label": (7, T.UINT32),
        "llama.vocab_size": ("x", T.STRING),
    }
    manifest = export_standin(
        StandinExport(tiny_llama(tmp_path / "src.gguf", kv), 2, tmp_path / "out", tmp_path / "src.gguf")
    )
    data = json.loads(manifest.read_text())
    assert data["vocab_size"] == 4 and load_manifest(manifest).data["vocab_size"] == 4
    fields = GGUFReader(tmp_path / "out" / data["target"]["file"]).fields
    assert fields["general.file_type"].contents() == 1 and fields["llama.embedding_length"].contents() == 16
    assert isinstance(fields["general.size_label"].contents(), str)
