"""Option decorators shared by the commands that load a pair and decode."""

from __future__ import annotations

import functools

import click

from mtad_edge.runtime.decoding import METHODS, DecodeConfig
from mtad_edge.runtime.sampling import SamplingConfig


def _stack(*decorators):
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


model_options = _stack(
    click.option(
        "--pair",
        "pair",
        metavar="NAME|MANIFEST",
        help="Named pair (see `mtad-edge models list`) or a manifest.json. Default: smollm2-135m.",
    ),
    click.option("--manifest", type=click.Path(exists=True), help="A pair's manifest.json (same as --pair PATH)."),
    click.option(
        "--target", type=click.Path(), help="Target model: a GGUF file or an ONNX model folder (instead of --pair)."
    ),
    click.option("--aux", type=click.Path(), help="Auxiliary (draft) model: GGUF file or ONNX folder (with --target)."),
    click.option(
        "--ctx-size",
        "n_ctx",
        type=click.IntRange(min=32),
        help="Context size in tokens (default: the pair's, else 2048).",
    ),
    click.option("--threads", "n_threads", type=click.IntRange(min=1), help="CPU threads (default: all usable cores)."),
    click.option(
        "--n-gpu-layers",
        type=click.IntRange(min=-1),
        help="Layers to offload to the GPU; -1 all (default: all when llama.cpp was built with CUDA/Metal, else 0).",
    ),
    click.option(
        "--flash-attn/--no-flash-attn",
        default=None,
        help="Force flash attention on or off (default: llama.cpp decides).",
    ),
    click.option(
        "--backend",
        type=click.Choice(["auto", "llama.cpp", "onnx"]),
        default="auto",
        show_default=True,
        help="auto: llama.cpp for .gguf files, ONNX Runtime for ONNX model folders (mixed pairs work).",
    ),
    click.option(
        "--provider",
        type=click.Choice(["auto", "cpu", "cuda"]),
        default="auto",
        show_default=True,
        help="ONNX Runtime execution provider (auto: CUDA when onnxruntime-gpu sees a GPU).",
    ),
)

method_option = click.option(
    "--method",
    type=click.Choice(METHODS),
    default="mtad",
    show_default=True,
    help="ar: target only; sd: lossless speculative sampling; mtad: multi-token assisted decoding.",
)

sampling_options = _stack(
    click.option("--gamma", type=click.IntRange(min=1, max=64), default=4, show_default=True, help="Draft length."),
    click.option(
        "--beam-width", type=click.IntRange(min=1, max=64), default=4, show_default=True, help="MTAD beam width w."
    ),
    click.option(
        "--accept-threshold",
        type=click.FloatRange(0, 1, min_open=True),
        default=0.5,
        show_default=True,
        help="MTAD: accept the longest prefix with p(x)/q(x) above this.",
    ),
    click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True, help="0 = greedy."),
    click.option("--top-k", type=click.IntRange(min=0), default=10, show_default=True, help="0 disables."),
    click.option(
        "--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True, help="1 disables."
    ),
    click.option(
        "--seed", type=click.IntRange(min=0), help="Sampling seed (default: random; the seed used is in the stats)."
    ),
    click.option(
        "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="Tokens to generate at most."
    ),
)


def decode_options(f):
    return method_option(sampling_options(f))


def decode_config(
    method, gamma, beam_width, accept_threshold, temperature, top_k, top_p, seed, max_tokens
) -> DecodeConfig:
    return DecodeConfig(
        method=method,
        max_tokens=max_tokens,
        gamma=gamma,
        beam_width=beam_width,
        accept_threshold=accept_threshold,
        seed=seed,
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p),
    )


def pair_or_manifest(pair, manifest):
    if pair and manifest:
        raise click.UsageError("give --pair or --manifest, not both")
    return pair or manifest


def errors_as_click(f):
    """Turn the runtime's user-facing errors into one-line click errors (exit 1, no traceback)."""
    from mtad_edge.runtime.errors import MtadEdgeError

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except MtadEdgeError as e:
            raise click.ClickException(str(e)) from None

    return wrapper
