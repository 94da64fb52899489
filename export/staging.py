"""What every export does around its conversion: checks before anything is written, a staging
folder inside ``out``, and publishing with the manifest last, so an interrupted export never
leaves a manifest pointing at half a file."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from mtad_edge.runtime.backends.llama_cpp_backend import LLAMA_MAX_LAYERS
from mtad_edge.runtime.errors import MtadEdgeError, json_int, json_problem, quoted
from mtad_edge.store import make_folder, os_error

FROM_TARGET = "from-target"
Progress = Callable[[str], None]


# What the converters size their work by, read from config.json before they run: a layer count or
# vocabulary of 10**30 made llama.cpp's converter build name tables until the OS killed it (a
# million layers: hours), and transformers allocates an embedding of vocab_size rows.
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")  # the converter's names for it
VOCAB_MAX = 1 << 21  # tokens: 8 times the largest vocabularies (Gemma's 262,144)
SUB_CONFIGS = ("text_config", "llm_config", "lm_config")  # a multimodal model's language model, read too


def check_hf_dir(path: Path, role: str) -> None:
    """A Hugging Face model folder whose config.json is a JSON object with a layer count and a
    vocabulary size (where it gives them) a model can have; else one line, before any work."""
    if not (path / "config.json").is_file():
        raise MtadEdgeError(f"--{role} {path}: not a Hugging Face model folder (no config.json)")
    where = f"--{role} {path / 'config.json'}"
    try:
        config = json.loads((path / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise MtadEdgeError(f"{where}: not valid JSON ({json_problem(e)})") from None
    if not isinstance(config, dict):
        raise MtadEdgeError(f"{where}: not a JSON object but {quoted(config)}")
    parts = [config] + [config[k] for k in SUB_CONFIGS if isinstance(config.get(k), dict)]
    for part in parts:
        for key, most in [(k, LLAMA_MAX_LAYERS) for k in LAYER_KEYS] + [("vocab_size", VOCAB_MAX)]:
            value = part.get(key)
            if value is not None and not json_int(value, 1, most):
                raise MtadEdgeError(f"{where}: {key} must be an integer in 1..{most}, got {quoted(value)}")


def preflight(
    target: Path, aux: str, out: Path, overwrite: bool, say: Progress, vocab_mismatch: str = "auto"
) -> tuple[bool, Path]:
    """Inputs are HF folders, no export is clobbered, the tokenizers may draft for each other (the
    run-time pair policy; an accepted mismatch is a notice on stderr). Returns (self_draft, manifest path)."""
    from .tokenizers import check_tokenizers

    self_draft = aux == FROM_TARGET
    check_hf_dir(target, "target")
    if not self_draft:
        check_hf_dir(Path(aux), "aux")
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and not overwrite:
        raise MtadEdgeError(f"{manifest_path} exists; pass --overwrite to replace the export")
    if not self_draft:
        say("checking that the tokenizers match")
        check_tokenizers(target, Path(aux), vocab_mismatch, lambda s: print(s, file=sys.stderr))  # before any write
    return self_draft, manifest_path


@contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A scratch folder inside ``out`` (same filesystem, so moves are renames), always removed."""
    make_folder(out, "the output folder")
    stage = out / f".export-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        stage.mkdir()
    except OSError as e:  # an existing folder on a read-only filesystem: make_folder had nothing to make
        raise MtadEdgeError(f"cannot write into the output folder {out}: {os_error(e)}") from None
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish(stage: Path, out: Path, names: list[str], manifest: dict) -> Path:
    """Move ``names`` (files or folders) from ``stage`` into ``out``, then the manifest, last."""
    manifest_path = out / "manifest.json"
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if manifest_path.exists():
        manifest_path.unlink()  # --overwrite: never a manifest beside files being replaced
    for name in names:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        os.replace(stage / name, out / name)
    os.replace(stage / "manifest.json", manifest_path)  # last: the export is complete
    return manifest_path


def trained_context(hf_dir: Path) -> Optional[int]:
    """The context a Hugging Face model was trained for (its config's max_position_embeddings)."""
    try:
        n = json.loads((hf_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return n if json_int(n, 1) else None


def pair_manifest(
    job: Any, name: str, target: dict[str, Any], aux: dict[str, Any], self_draft: bool, **fields: Any
) -> dict[str, Any]:
    """The schema-1 manifest of an exported pair: ``target``/``aux`` are the two file entries,
    ``fields`` the format's own keys (format, description, chat_template). Its context_size is
    the export's, at most what the target was trained for (the runtime refuses longer ones)."""
    trained = trained_context(Path(job.target))
    if self_draft:
        aux["self_draft"] = True
        aux["note"] = "no sibling model: the aux is the target quantized more strongly"
    return {
        "schema": 1,
        "name": name,
        **fields,
        "context_size": min(job.context_size, trained) if trained else job.context_size,
        "source": {"kind": "hf", "target": str(job.target), "aux": job.aux},
        "target": target,
        "aux": aux,
    }
