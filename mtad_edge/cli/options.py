"""Option decorators shared by every command that loads a pair or decodes.

Request options (method, gamma, temperature, ...) are built from the runtime's option table
(runtime/options.py): the default, the bound and the error message are the table's, so the CLI,
the Python API and the server say the same words about the same bad value. Model options are
one decorator that hands the command a ``ModelChoice``.
"""

from __future__ import annotations

import contextlib
import functools
import math
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


class FiniteRange(click.FloatRange):
    """A float option in a range, never NaN or an infinity: click's FloatRange takes "nan" (which
    compares false with every bound) and "inf" where it has no maximum."""

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


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


def request_option(name: str, default: Any = None, help: Optional[str] = None, hidden: bool = False) -> Decorator:
    """``--name`` parsed and checked by the option table; ``default`` and ``help`` replace the
    table's for a command that means something else by the option (tune's base seed). An option
    a model may recommend has no default here (None: not given), so the model's can apply."""
    opt = OPTIONS[name]
    if default is None and opt.recommended:
        text = f"{help or opt.help} Default: the model's, else {opt.default}."
    else:
        default = opt.default if default is None else default
        text = help or opt.help
    return click.option(
        "--" + name.replace("_", "-"),
        name,
        type=OptionType(opt),
        default=default,
        show_default=default is not None,
        hidden=hidden,
        help=text,
    )


def _show_all(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """--help-all: the help with every option, the ones --help leaves out too."""
    if not value or ctx.resilient_parsing:
        return
    for p in ctx.command.params:
        if isinstance(p, click.Option):
            p.hidden = False
    click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


help_all_option = click.option(
    "--help-all",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_all,
    help="Show every option (drafting, loading, GPU, RPC) and exit.",
)
method_option = request_option("method")
# The request options --help shows; the others (drafting knobs) appear with --help-all.
EVERYDAY = ("method", "max_tokens", "temperature", "top_k", "top_p", "seed")
# Every request option but the method (commands choose theirs), in the table's order.
_REQUEST = DECODE_FIELDS + SAMPLING_FIELDS
sampling_options = _stack(
    *(request_option(n, hidden=n not in EVERYDAY) for n in OPTIONS if n in _REQUEST and n != "method")
)


def decode_options(f: Callable[..., Any]) -> Callable[..., Any]:
    return method_option(sampling_options(f))


def decode_config(**options: Any) -> DecodeConfig:
    """The request options a command was given, as a DecodeConfig (None: not given, the table's
    default; the engine applies the model's recommended ones over it, see ``given``)."""
    return DecodeConfig().with_options({k: v for k, v in options.items() if v is not None})


def recommended_note(recommended: dict[str, tuple[Any, str]]) -> str:
    """ "; temperature 0.7, top_k 40 from the pair's manifest": the model's defaults a command took."""
    by_source: dict[str, list[str]] = {}
    for name, (value, source) in recommended.items():
        by_source.setdefault(source, []).append(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")
    return "".join(f"; {', '.join(said)} from {source}" for source, said in by_source.items())


def given(options: dict[str, Any]) -> frozenset[str]:
    """The request options a command was given a value for (what the model's defaults leave alone)."""
    return frozenset(k for k, v in options.items() if v is not None)


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
        given: Optional[frozenset[str]] = None,
    ) -> Engine:
        """The engine; ``given``: the request options the command was given (the model's
        recommended values fill the others; None: ``defaults`` as they are)."""
        return Engine.open(self.resolve(), self.options, defaults, method_names, capacity, say=_say, given=given)


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


def vocab_mismatch_option(hidden: bool = False) -> Decorator:
    return click.option(
        "--vocab-mismatch",
        type=click.Choice(MISMATCH_MODES),
        default="auto",
        show_default=True,
        hidden=hidden,
        help="Target and aux with different vocabularies: auto drafts in their shared tokens where enough "
        "of the text is draftable; allow: however little; refuse: need the same vocabulary.",
    )


def model_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--pair/--manifest/--target/--aux and the loading options, given to ``f`` as ``model``;
    --help shows the everyday ones, --help-all every one."""

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
            help=f"Model pair: a name (`mtad-edge models list`) or a manifest.json. Default: {DEFAULT_PAIR}.",
        ),
        click.option("--manifest", type=click.Path(exists=True), hidden=True, help="Same as --pair PATH."),
        click.option(
            "--target",
            type=click.Path(),
            help="The model that answers: a GGUF file, an ONNX folder or hf:OWNER/REPO[/FILE.gguf|:QUANT].",
        ),
        click.option("--aux", type=click.Path(), help="The small model that drafts (same kinds as --target)."),
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
            hidden=True,
            help="The aux's own CPU threads (default: as --threads).",
        ),
        click.option(
            "--n-gpu-layers",
            type=click.IntRange(min=-1, max=GPU_LAYERS_MAX),
            help="Layers on the GPU; -1: all (default: all with a CUDA/Metal build, else 0).",
        ),
        click.option(
            "--aux-gpu-layers",
            type=click.IntRange(min=-1, max=GPU_LAYERS_MAX),
            hidden=True,
            help="The aux's own --n-gpu-layers; 0 keeps it on the CPU (default: the pair's, else as the target).",
        ),
        click.option(
            "--flash-attn/--no-flash-attn",
            default=None,
            hidden=True,
            help="Flash attention on or off (default: off on a CPU for heads up to 64 wide, else llama.cpp's choice).",
        ),
        click.option(
            "--backend",
            type=click.Choice(BACKENDS),
            default="auto",
            show_default=True,
            hidden=True,
            help="auto: llama.cpp for .gguf files, ONNX Runtime for ONNX folders.",
        ),
        click.option(
            "--provider",
            type=click.Choice(PROVIDERS),
            default="auto",
            show_default=True,
            hidden=True,
            help="ONNX Runtime's execution provider (auto: CUDA where it sees a GPU).",
        ),
        vocab_mismatch_option(hidden=True),
        click.option(
            "--rpc",
            metavar="HOST:PORT[,...]",
            callback=_rpc_servers,
            hidden=True,
            help="Run the target's layers on these ggml-rpc-servers (`mtad-edge rpc server`); no "
            "authentication: trusted networks only (default: the pair's, else none).",
        ),
        help_all_option,
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
