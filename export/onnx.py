"""HF checkpoints -> an ONNX target + aux pair (optimum-onnx export, onnxruntime quantization).

Each model becomes a folder (``model.onnx`` + its tokenizer files) exported with optimum's
``text-generation-with-past`` task, then weight-only 4-bit (``MatMulNBitsQuantizer``), dynamic
int8, fp16 or left fp32. Staging and the manifest-last rule are the same as for GGUF.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mtad_edge.runtime.errors import MtadEdgeError, first_line
from mtad_edge.store import sha256_file

from .staging import Progress, pair_manifest, preflight, publish, staging

QUANTS = ("int4", "int8", "fp16", "fp32")


@dataclass(frozen=True)
class OnnxExport:
    target: Path
    aux: str  # an HF folder, or "from-target"
    out: Path
    quant: str = "int4"
    aux_quant: str = "int4"
    block_size: int = 32  # int4: weights per quantization block
    accuracy_level: int = 0  # int4: 0 = fp32 compute; 4 (int8 compute) is faster on CPU but flips near-ties
    overwrite: bool = False
    name: Optional[str] = None
    context_size: int = 2048
    vocab_mismatch: str = "auto"  # different tokenizers: auto | allow | refuse (as at run time)


def export_fp32(hf_dir: Path, dest: Path) -> None:
    from optimum.exporters.onnx import main_export

    try:
        # a model folder never runs its own code (said here, not left to optimum's default)
        main_export(
            str(hf_dir), output=str(dest), task="text-generation-with-past", device="cpu", trust_remote_code=False
        )
    except Exception as e:  # unsupported architecture, bad checkpoint, ...
        raise MtadEdgeError(f"optimum could not export {hf_dir} to ONNX: {first_line(e)}") from None


def quantize_onnx(src: Path, dest: Path, quant: str, block_size: int, accuracy_level: int) -> None:
    """src/model.onnx (fp32) -> dest/model.onnx in ``quant``; tokenizer and config files copied."""
    import onnx

    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy(f, dest / f.name)
    model_in, model_out = src / "model.onnx", dest / "model.onnx"
    if quant == "fp32":
        for f in src.glob("model.onnx*"):
            shutil.copy(f, dest / f.name)
    elif quant == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(model_in), str(model_out), weight_type=QuantType.QInt8)
    elif quant == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        q = MatMulNBitsQuantizer(
            onnx.load(str(model_in)), block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level
        )
        q.process()
        q.model.save_model_to_file(str(model_out), use_external_data_format=False)
    elif quant == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        onnx.save(convert_float_to_float16(onnx.load(str(model_in)), keep_io_types=True), str(model_out))
    else:
        raise MtadEdgeError(f"unknown ONNX quantization {quant!r} (choose from {', '.join(QUANTS)})")


def export_onnx(job: OnnxExport, say: Progress = lambda s: None) -> Path:
    """Run the export; returns the manifest path."""
    for q in (job.quant, job.aux_quant):
        if q not in QUANTS:
            raise MtadEdgeError(f"unknown ONNX quantization {q!r} (choose from {', '.join(QUANTS)})")
    self_draft, _ = preflight(job.target, job.aux, job.out, job.overwrite, say, job.vocab_mismatch)
    with staging(job.out) as stage:
        say(f"exporting target {job.target} to ONNX")
        export_fp32(job.target, stage / "target-fp32")
        aux_fp32 = stage / "target-fp32"
        if not self_draft:
            say(f"exporting aux {job.aux} to ONNX")
            aux_fp32 = stage / "aux-fp32"
            export_fp32(Path(job.aux), aux_fp32)
        say(f"quantizing target to {job.quant}")
        quantize_onnx(stage / "target-fp32", stage / "target", job.quant, job.block_size, job.accuracy_level)
        say(f"quantizing aux to {job.aux_quant}" + (" (self-draft from the target)" if self_draft else ""))
        quantize_onnx(aux_fp32, stage / "aux", job.aux_quant, job.block_size, job.accuracy_level)
        return publish(stage, job.out, ["target", "aux"], _manifest(job, stage, self_draft))


def _manifest(job: OnnxExport, stage: Path, self_draft: bool) -> dict:
    def variant(role: str, quant: str) -> dict[str, Any]:
        derive: dict[str, Any] = {
            "tool": "optimum-onnx text-generation-with-past + onnxruntime.quantization",
            "quant": quant,
        }
        v = {
            "file": f"{role}/model.onnx",
            "sha256": sha256_file(stage / role / "model.onnx"),
            "derive": derive,
        }
        if quant == "int4":
            derive.update(block_size=job.block_size, accuracy_level=job.accuracy_level)
        return v

    return pair_manifest(
        job,
        job.name or job.out.name,
        variant("target", job.quant),
        variant("aux", job.aux_quant),
        self_draft,
        format="onnx",
        description=f"ONNX export of {job.target} (target) and {job.aux} (aux)",
        chat_template={"source": "tokenizer_config"},
    )
