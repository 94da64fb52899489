"""Option decorators shared by every command that loads a pair or decodes.

Request options (method, gamma, temperature, ...) are built from the runtime's option table
(runtime/options.py): the default, the bound and the error message are the table's, so the CLI,
the Python API and the server say the same words about the same bad value. Model options are
one decorator that hands the command a ``ModelChoice``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TextIO

import click

import mtad_edge.store as store
from mtad_edge.engine import Engine
from mtad_edge.loader import BACKENDS, PROVIDERS, THREADS_MAX, ModelOptions
from mtad_edge.pairs import DEFAULT_PAIR, GPU_LAYERS_MAX, Pair, resolve
from mtad_edge.runtime.backends.rpc import parse_endpoints
from mtad_edge.runtime.config import DECODE_FIELDS, SAMPLING_FIELDS, DecodeConfig
from mtad_edge.runtime.errors import MtadEdgeError, OptionError
from mtad_edge.runtime.options import OPTIONS, Option
from mtad_edge.runtime.text.compat import MISMATCH_MODES

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _stack(*decorators: Decorator) -> Decorator:
    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


class OptionType(click.ParamType):
    """A click type that parses and checks with the option table (its message on failure)."""

    def __init__(self, opt: Option):
        self.opt = opt
        self.name = opt.name

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        if self.opt.kind == "choice":
            return "[" + "|".join(self.opt.allowed()) + "]"
        return ("INTEGER" if self.opt.kind == "int" else "FLOAT") + ("|auto" if self.opt.auto else "")

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if not isinstance(value, str):
            return value  # a default: already checked by the table
        try:
            return self.opt.parse(value)
        except OptionError as e:
            self.fail(str(e), param, ctx)


def request_option(name: str, default: Any = None, help: Optional[str] = None) -> Decorator:
    """``--name`` parsed and checked by the option table; ``default`` and ``help`` replace the
    table's for a command that means something else by the option (tune's base seed)."""
    opt = OPTIONS[name]
    default = opt.default if default is None else default
    return click.option(
        "--" + name.replace("_", "-"),
        name,
        type=OptionType(opt),
        default=default,
        show_default=default is not None,
        help=f"{help or opt.help} ({opt.describe()})",
    )


method_option = request_option("method")
# Every request option but the method (commands choose theirs), in the table's order.
_REQUEST = DECODE_FIELDS + SAMPLING_FIELDS
sampling_options = _stack(*(request_option(n) for n in OPTIONS if n in _REQUEST and n != "method"))


def decode_options(f: Callable[..., Any]) -> Callable[..., Any]:
    return method_option(sampling_options(f))


def decode_config(**options: Any) -> DecodeConfig:
    """The request options a command was given, as a DecodeConfig."""
    return DecodeConfig().with_options(options)


@dataclass(frozen=True)
class ModelChoice:
    """Which models a command runs (a named pair, a manifest, or --target/--aux files) and how
    they are loaded."""

    pair: Optional[str]
    target: Optional[str]
    aux: Optional[str]
    options: ModelOptions

    @property
    def label(self) -> str:
        return self.pair or (click.format_filename(self.target) if self.target else DEFAULT_PAIR)

    def resolve(self) -> Pair:
        return resolve(self.pair, self.target, self.aux, say=_say)

    def engine(
        self,
        defaults: DecodeConfig,
        method_names: Optional[Sequence[str]] = None,
        capacity: Optional[tuple[int, int]] = None,
    ) -> Engine:
        return Engine.open(self.resolve(), self.options, defaults, method_names, capacity, say=_say)


def _say(message: str) -> None:
    click.echo(message, err=True)


_MODEL_FIELDS = (
    "pair",
    "manifest",
    "target",
    "aux",
    "n_ctx",
    "threads",
    "aux_threads",
    "n_gpu_layers",
    "aux_gpu_layers",
    "flash_attn",
    "backend",
    "provider",
    "vocab_mismatch",
    "rpc",
)


def _rpc_servers(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[tuple[str, ...]]:
    try:
        return None if value is None else parse_endpoints(value, "--rpc")
    except MtadEdgeError as e:
        raise click.BadParameter(str(e), ctx, param) from None


vocab_mismatch_option = click.option(
    "--vocab-mismatch",
    type=click.Choice(MISMATCH_MODES),
    default="auto",
    show_default=True,
    help="Target and aux with different vocabularies: auto drafts in their shared tokens when enough of the "
    "target's text is draftable, allow drafts however little, refuse needs identical ones.",
)


def model_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--pair/--manifest/--target/--aux and the loading options, given to ``f`` as ``model``."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in _MODEL_FIELDS}
        if given["pair"] and given["manifest"]:
            raise click.UsageError("give --pair or --manifest, not both")
        options = ModelOptions(**{k: given[k] for k in _MODEL_FIELDS[4:]})
        model = ModelChoice(given["pair"] or given["manifest"], given["target"], given["aux"], options)
        return f(*args, model=model, **kwargs)

    return _stack(
        click.option(
            "--pair",
            metavar="NAME|MANIFEST",
            help=f"Named pair (see `mtad-edge models list`) or a manifest.json. Default: {DEFAULT_PAIR}.",
        ),
        click.option("--manifest", type=click.Path(exists=True), help="A pair's manifest.json (same as --pair PATH)."),
        click.option(
            "--target",
            type=click.Path(),
            help="Target model: a GGUF file, an ONNX model folder, or hf:OWNER/REPO/FILE.gguf | hf:OWNER/REPO:QUANT.",
        ),
        click.option(
            "--aux", type=click.Path(), help="Auxiliary (draft) model: GGUF file, ONNX folder or an hf: reference."
        ),
        click.option(
            "--ctx-size",
            "n_ctx",
            type=click.IntRange(min=32),
            help="Tokens of prompt and answer the context holds (default: the pair's, else 2048).",
        ),
        click.option("--threads", type=click.IntRange(1, THREADS_MAX), help="CPU threads (default: all usable cores)."),
        click.option(
            "--aux-threads",
            type=click.IntRange(1, THREADS_MAX),
            help="The aux's own CPU threads (llama.cpp's -td; default: as --threads). With --draft-ahead on "
            "and both models on the CPU, give each its own cores: --threads 1 --aux-threads 1 on two.",
        ),
        click.option(
            "--n-gpu-layers",
            type=click.IntRange(min=-1, max=GPU_LAYERS_MAX),
            help="Layers to offload to the GPU; -1 all (default: all when llama.cpp was built with "
            "CUDA/Metal, else 0).",
        ),
        click.option(
            "--aux-gpu-layers",
            type=click.IntRange(min=-1, max=GPU_LAYERS_MAX),
            help="The aux's own --n-gpu-layers (llama.cpp's -ngld); 0 keeps the draft model on the CPU "
            "(default: the pair's aux_gpu_layers, else as the target).",
        ),
        click.option(
            "--flash-attn/--no-flash-attn",
            default=None,
            help="Force flash attention on or off (default: off on a CPU for heads up to 64 wide, where it "
            "costs; else llama.cpp decides).",
        ),
        click.option(
            "--backend",
            type=click.Choice(BACKENDS),
            default="auto",
            show_default=True,
            help="auto: llama.cpp for .gguf files, ONNX Runtime for ONNX model folders (mixed pairs work).",
        ),
        click.option(
            "--provider",
            type=click.Choice(PROVIDERS),
            default="auto",
            show_default=True,
            help="ONNX Runtime execution provider (auto: CUDA when onnxruntime-gpu sees a GPU).",
        ),
        vocab_mismatch_option,
        click.option(
            "--rpc",
            metavar="HOST:PORT[,HOST:PORT...]",
            callback=_rpc_servers,
            help="Put the target's layers on these ggml-rpc-servers (`mtad-edge rpc server`), as llama.cpp's "
            "--rpc does (--n-gpu-layers, split by their free memory); the aux stays here. They have no "
            "authentication: trusted networks only (docs/rpc.md). Default: the pair's rpc, else none.",
        ),
    )(wrapper)


def missing_extra(what: str, extra: str, e: ImportError) -> click.ClickException:
    """An optional extra that is not installed, as a one-line error naming what installs it."""
    return click.ClickException(f"{what} needs its extra: pip install 'mtad-edge[{extra}]' ({e.name} missing)")


def errors_as_click(f: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the runtime's user-facing errors into one-line click errors (exit 1, no traceback);
    an OSError that no code before named (a full disk, a read-only folder) too, in its words."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except MtadEdgeError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            raise click.ClickException(store.os_error(e)) from None

    return wrapper


class StdoutError(MtadEdgeError):
    """Standard output refused a write: a full disk (or /dev/full), a pipe whose reader left."""


def write_out(text: str, stream: Optional[TextIO] = None) -> None:
    """Write a command's output to ``stream`` (standard output) at once. Where the OS refuses it,
    a one-line StdoutError, and standard output is pointed at the null device first: the
    interpreter flushes it again at exit, which would print a traceback of its own."""
    out = stream or sys.stdout
    try:
        out.write(text)
        out.flush()
    except OSError as e:
        raise stdout_error(e, out) from None


def stdout_error(e: OSError, stream: Optional[TextIO] = None) -> StdoutError:
    """The one-line error for a write to standard output that failed, with standard output
    pointed at the null device (see write_out)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, (stream or sys.stdout).fileno())
        os.close(null)
    return StdoutError(f"cannot write to standard output: {store.os_error(e)}")
