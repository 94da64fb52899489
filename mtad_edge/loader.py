"""Open a target/aux pair, each model on the backend its file calls for, with contexts sized for
the methods that will run on it (each method's ``layout`` says what a step needs)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import reduce
from pathlib import Path
from typing import Any, Optional

import mtad_edge.rpc_build as rpc_build
import mtad_edge.store as store
from mtad_edge.pairs import GPU_LAYERS_MAX, Pair, valid_gpu_layers
from mtad_edge.runtime import methods
from mtad_edge.runtime.backend import Backend, Segments
from mtad_edge.runtime.backends import amx, guard
from mtad_edge.runtime.backends.rpc import Placement, gpu_offload, parse_endpoints
from mtad_edge.runtime.errors import MtadEdgeError, OptionError, json_int, quoted
from mtad_edge.runtime.text import chat, structured
from mtad_edge.runtime.text.compat import MISMATCH_MODES, mismatch_verdict, vocab_difference
from mtad_edge.runtime.text.structured import ToolPlan
from mtad_edge.runtime.text.vocab import COVERAGE_SAMPLE, VocabMap, map_models

BACKENDS = ("auto", "llama.cpp", "onnx")
# llama.cpp's GGML_MAX_N_THREADS: its CPU backend keeps per-thread state in arrays this long, and a
# context with more threads crashed the process
THREADS_MAX = 512
PROVIDERS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelOptions:
    """How models are loaded (not what a request asks for): the same for every command."""

    n_ctx: Optional[int] = None  # committed tokens a run may hold; None: the manifest's context_size, else 2048
    threads: Optional[int] = None  # None: all usable cores
    aux_threads: Optional[int] = None  # the aux's own (llama.cpp's -td); None: as threads
    n_gpu_layers: Optional[int] = None  # llama.cpp; None: all layers when the build can offload, else 0
    # llama.cpp's -ngld for the aux (0: draft on the CPU); None: the manifest's aux_gpu_layers, else n_gpu_layers
    aux_gpu_layers: Optional[int] = None
    flash_attn: Optional[bool] = None  # llama.cpp; None: llama.cpp decides
    backend: str = "auto"  # auto: llama.cpp for .gguf files, ONNX Runtime for model folders / .onnx
    provider: str = "auto"  # ONNX Runtime: auto (CUDA when available) | cpu | cuda
    vocab_mismatch: str = "auto"  # different vocabularies: auto (draft when enough is shared) | allow | refuse
    # the target's layers on these ggml-rpc-servers ("HOST:PORT,..." or a list); None: the manifest's rpc
    rpc: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        """Each option checked as the API hands it over (any type): an OptionError naming it."""
        if self.rpc is not None:
            object.__setattr__(self, "rpc", parse_endpoints(self.rpc))
        for name, allowed in (("backend", BACKENDS), ("provider", PROVIDERS), ("vocab_mismatch", MISMATCH_MODES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise OptionError(f"unknown {name} {quoted(value)} (choose from {', '.join(allowed)})", name)
        for name in ("threads", "aux_threads"):
            value = getattr(self, name)
            if value is not None and not json_int(value, 1, THREADS_MAX):
                raise OptionError(f"{name} must be an integer in 1..{THREADS_MAX}, got {quoted(value)}", name)
        if self.n_ctx is not None and not json_int(self.n_ctx, 1):
            raise OptionError(f"n_ctx must be a positive integer, got {quoted(self.n_ctx)}", "n_ctx")
        if self.flash_attn is not None and not isinstance(self.flash_attn, bool):
            raise OptionError(f"flash_attn must be True, False or None, got {quoted(self.flash_attn)}", "flash_attn")
        for name in ("n_gpu_layers", "aux_gpu_layers"):
            value = getattr(self, name)
            if value is not None and not valid_gpu_layers(value):
                raise OptionError(
                    f"{name} must be an integer in -1..{GPU_LAYERS_MAX} (-1: all), got {quoted(value)}", name
                )


def _backend_for(path: Path, requested: str) -> str:
    kind = "onnx" if Path(path).is_dir() or Path(path).suffix == ".onnx" else "llama.cpp"
    if requested != "auto" and requested != kind:
        raise MtadEdgeError(f"--backend {requested} cannot run {path} (that is a {kind} model)")
    return kind


def load_backend(
    path: Path,
    n_ctx: int,
    n_seq_max: int,
    opts: ModelOptions,
    spin: bool = True,
    positions: Optional[int] = None,
    rpc: Optional[Placement] = None,
    one_row: bool = False,
) -> Backend:
    """A Backend for one model file: LlamaCppBackend for GGUF, OrtBackend for ONNX. ``spin``:
    ONNX Runtime's idle threads may spin-wait (only for a model loaded alone, see OrtConfig.spin).
    ``positions``: the committed tokens of ``n_ctx``, bounded by the model's trained context.
    ``rpc``: the rpc servers' devices its layers go to (a llama.cpp model; the caller closes it).
    ``one_row``: a model called mostly a row at a time (the aux; LlamaCppConfig.one_row)."""
    if _backend_for(path, opts.backend) == "onnx":
        from mtad_edge.runtime.backends.ort_backend import OrtBackend, OrtConfig

        cfg = OrtConfig(
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            n_threads=opts.threads,
            provider=opts.provider,
            spin=spin,
            positions=positions,
            model_facts=StoredModelFacts(),
        )
        return OrtBackend(path, cfg)
    from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig

    return LlamaCppBackend(
        path,
        LlamaCppConfig(
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            n_threads=opts.threads,
            n_gpu_layers=_gpu_layers(opts.n_gpu_layers, remote=rpc is not None),
            flash_attn=opts.flash_attn,
            positions=positions,
            amx_store=StoredAmxCrashes(),
            model_facts=StoredModelFacts(),
            rpc=rpc,
            one_row=one_row,
        ),
    )


def _llama_build() -> Optional[list[Any]]:
    """The llama.cpp build this process runs, the CPU and the kernel (None where /proc cannot say)."""
    build = amx.build_identity()
    if build is None:
        return None
    libraries = store.file_identity(*build["libraries"])  # a rebuilt library is another build
    return [libraries, build["cpu"], build["kernel"], build["features"]]


def _onnx_build() -> list[Any]:
    import onnxruntime

    return [onnxruntime.__version__, store.file_identity(onnxruntime.__file__)]


class StoredModelFacts:
    """Facts a backend derives about a model file once (runtime/backends/guard.py: a child loaded it
    cleanly; its special tokens), kept in the cache by the files' identity and the build that
    read them, so a second load of a known file derives nothing."""

    def _record(self, kind: str, path: Path, fact: str) -> Optional[Path]:
        build = _llama_build() if kind == "gguf" else _onnx_build()
        if build is None:
            return None
        files = store.file_identity(*(f.resolve() for f in guard.model_files(kind, path)), swaps=True)
        return store.path("models", store.key([kind, build, files, fact]))

    def get(self, kind: str, path: Path, fact: str) -> Optional[Any]:
        record = self._record(kind, path, fact)
        value = store.read_json(record) if record is not None else None
        return value.get(fact) if isinstance(value, dict) else None

    def put(self, kind: str, path: Path, fact: str, value: Any) -> None:
        record = self._record(kind, path, fact)
        if record is not None:
            store.remember(lambda: store.write_json(record, {fact: value}))


class StoredAmxCrashes:
    """The AMX children that crashed (runtime/backends/amx.py), kept in the cache by this build, CPU and
    kernel, so that later processes skip the child (about 0.3 s of every start)."""

    def _record(self, types: tuple[int, ...]) -> Optional[Path]:
        build = _llama_build()
        return None if build is None else store.path("amx", store.key([build, list(types)]))

    def crashed(self, types: tuple[int, ...]) -> bool:
        record = self._record(types)
        return record is not None and store.read_json(record) == {"types": list(types), "crashed": True}

    def record_crash(self, types: tuple[int, ...]) -> None:
        record = self._record(types)
        if record is not None:
            store.remember(lambda: store.write_json(record, {"types": list(types), "crashed": True}))


class LoadedPair:
    """The two backends of a pair and the methods they were opened for (default: every method);
    a context manager that closes both (and then the target's rpc servers' guards)."""

    def __init__(
        self,
        target: Backend,
        aux: Optional[Backend],
        pair: Pair,
        vocab: Optional[VocabMap] = None,
        method_names: Optional[Sequence[str]] = None,
        rpc: Optional[Placement] = None,
    ):
        self.target, self.aux, self.pair, self.rpc = target, aux, pair, rpc
        self.vocab = vocab  # the map between different vocabularies (None: the same vocabulary)
        self.methods = tuple(method_names) if method_names is not None else methods.names()

    def render_chat(self, messages: list[dict[str, Any]], plan: Optional[ToolPlan] = None) -> str:
        """Messages -> prompt text with the template the manifest names (default: the model's);
        ``plan``: the request's tools (structured.py: the template's own way where it takes them,
        else the fallback's system block)."""
        render, messages = self._renderer(messages, plan)
        return render(messages)

    def _template(self, messages: list[dict[str, Any]]) -> str:
        spec = (self.pair.manifest.data.get("chat_template") or {}) if self.pair.manifest else {}
        name = spec.get("name") if spec.get("source") == "builtin" else None
        return self.target.apply_chat_template(messages, template=name)

    def tools_template(self) -> Optional[str]:
        """The model's chat template where it takes tools in the format structured.py writes
        (a manifest's built-in template takes none)."""
        spec = (self.pair.manifest.data.get("chat_template") or {}) if self.pair.manifest else {}
        read = getattr(self.target, "chat_template_text", None)
        if spec.get("source") == "builtin" or read is None:
            return None
        text = read()
        return text if isinstance(text, str) and structured.takes_tools(text) else None

    def _renderer(
        self, messages: list[dict[str, Any]], plan: Optional[ToolPlan]
    ) -> tuple[Callable[[list[dict[str, Any]]], str], list[dict[str, Any]]]:
        """How to render ``messages`` and what to render: plain ones with the model's template; with
        tools offered or tool turns in the history, the template given them where it takes them,
        else the fallback (structured.plain_messages)."""
        offered = plan.offered if plan is not None else ()
        if not offered and not structured.has_tool_turns(messages):
            return self._template, messages
        template = self.tools_template()
        if template is None:
            return self._template, structured.plain_messages(messages, plan.block() if plan and offered else None)
        vocab, target = self.target.vocab_info(), self.target
        names = {
            key: target.token_bytes(i).decode("utf-8", "replace")
            for key, i in (("bos_token", vocab.bos), ("eos_token", vocab.eos))
            if 0 <= i < target.n_vocab
        }
        tools = [t.spec() for t in offered] or None
        messages = structured.template_messages(messages)
        for m in messages:  # a call's arguments are the template's markup: none may hold a special token's text
            for call in m.get("tool_calls") or ():
                self._no_special(
                    json.dumps(call["function"]["arguments"], ensure_ascii=False), "a tool call's arguments"
                )
        return (lambda ms: chat.render(template, ms, tools=tools, **names)), messages

    def chat_segments(self, messages: list[dict[str, Any]], plan: Optional[ToolPlan] = None) -> Segments:
        """Messages -> the template's markup and the messages' text, apart (runtime/text/chat.py), so
        only the markup becomes control tokens."""
        render, messages = self._renderer(messages, plan)
        found = chat.segments(render, messages)
        if found is not None:
            return found
        # A template that changes the contents beyond trimming them: their text cannot be found in
        # its output, so the whole is markup, unless a content would then become control tokens.
        for m in messages:
            self._no_special(m["content"], f"a {m['role']} message")
        return [(render(messages), True)]

    def _no_special(self, text: str, what: str) -> None:
        if self.target.tokenize(text, add_special=False) != self.target.tokenize(
            text, add_special=False, special=False
        ):
            raise OptionError(
                f"{what} holds a special token's text, and this chat template changes messages so that "
                "their text cannot be kept apart from its markup",
                "messages",
            )

    def close(self) -> None:
        for m in (self.aux, self.target):
            if m is not None:
                m.close()
        if self.rpc is not None:
            self.rpc.close()  # after the target: llama.cpp calls its servers until the model is freed

    def __enter__(self) -> LoadedPair:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _gpu_layers(requested: Optional[int], remote: bool = False) -> int:
    """n_gpu_layers as asked; else all where there are devices to offload to (rpc servers' or
    this machine's), else 0."""
    if requested is not None:
        return requested
    return -1 if remote or gpu_offload() else 0


def rpc_servers(pair: Pair, opts: ModelOptions) -> tuple[str, ...]:
    """The rpc servers for the target's layers: the option's, else the manifest's; () for none."""
    if opts.rpc is not None:
        return opts.rpc
    return (pair.manifest.rpc if pair.manifest else None) or ()


def open_placement(servers: tuple[str, ...], target: Path, backend: str) -> Placement:
    """The checked servers, each behind its guard (runtime/backends/rpc.py), named on stderr before any
    weight goes out."""
    if _backend_for(target, backend) != "llama.cpp":
        raise MtadEdgeError(f"--rpc places a llama.cpp model's layers; {target} runs on ONNX Runtime")
    from mtad_edge.runtime.backends.llama_cpp_backend import quiet_llama_logs

    quiet_llama_logs()  # llama.cpp's log (the RPC backend's too) off the terminal
    placement = Placement.open(servers, rpc_build.library())
    print(
        f"mtad-edge: the target's layers go to rpc servers {placement.describe()} "
        "(ggml-rpc-server has no authentication: only on a network you trust)",
        file=sys.stderr,
    )
    return placement


def aux_gpu_layers(pair: Pair, opts: ModelOptions) -> Optional[int]:
    """The aux's n_gpu_layers as asked for: the option's, else the manifest's; None: as the target."""
    if opts.aux_gpu_layers is not None:
        return opts.aux_gpu_layers
    return pair.manifest.aux_gpu_layers if pair.manifest else None


def pair_vocabulary(
    target: Backend, aux: Backend, paths: tuple[Path, Path], mode: str, say: Callable[[str], None] = lambda s: None
) -> Optional[VocabMap]:
    """None for identical vocabularies; else the map to draft with, by the --vocab-mismatch policy
    (the notice goes to ``say``). The map is cached per pair of model files in the cache dir."""
    difference = vocab_difference(target, aux)
    if difference is None:
        return None
    names = f"target {paths[0].name} and aux {paths[1].name}"
    if mode == "refuse":
        mismatch_verdict(mode, difference, 0.0, 0, aux.n_vocab, names)  # raises
    vocab = _cached_map(target, aux, paths)
    coverage = vocab.coverage_of(target.tokenize(COVERAGE_SAMPLE, add_special=False))
    say(mismatch_verdict(mode, difference, coverage, vocab.mapped, aux.n_vocab, names))
    return vocab


def _cached_map(target: Backend, aux: Backend, paths: tuple[Path, Path]) -> VocabMap:
    path = store.path("vocab", store.key([store.file_identity(*paths), target.n_vocab, aux.n_vocab]), "npz")
    try:
        return VocabMap.load(str(path), target.n_vocab, aux.n_vocab)
    except ValueError:  # missing or damaged: derived again
        pass
    vocab = map_models(target, aux)

    def write() -> None:
        with store.atomic(path) as tmp:
            vocab.save(str(tmp))

    store.remember(write)
    return vocab


def open_pair(
    pair: Pair,
    method_names: Optional[Iterable[str]],
    gamma: int,
    width: int,
    opts: ModelOptions = ModelOptions(),
    say: Callable[[str], None] = lambda s: None,
) -> LoadedPair:
    """Load the target, and the aux when the pair has one and one of ``method_names`` (None: every
    method) drafts, with contexts that hold ``n_ctx`` committed tokens plus what a step of any of
    those methods needs at ``gamma`` and ``width``. Each model runs on the backend its file calls
    for, so mixed GGUF/ONNX pairs work."""
    target_path, aux_path = pair.target, pair.aux
    names = list(methods.expand(methods.names() if method_names is None else method_names))
    chosen = [methods.get(m) for m in names]
    if target_path is None:
        raise MtadEdgeError("--aux needs --target")
    drafting = [m.name for m in chosen if m.drafts]
    layout = reduce(lambda a, b: a.union(b), (m.layout(gamma, width) for m in chosen))
    n_ctx = opts.n_ctx or (pair.manifest.context_size if pair.manifest else 2048)
    servers = rpc_servers(pair, opts)
    rpc = open_placement(servers, Path(target_path), opts.backend) if servers else None
    loaded: list[Backend] = []
    try:
        target = load_backend(
            Path(target_path),
            n_ctx + layout.target_cells,
            layout.target_seqs,
            opts,
            spin=not drafting,
            positions=n_ctx,
            rpc=rpc,
        )
        loaded.append(target)
        if aux_path is None or not drafting:
            return LoadedPair(target, None, pair, method_names=names, rpc=rpc)
        layers = aux_gpu_layers(pair, opts)  # an ONNX aux ignores it, as it does n_gpu_layers
        aux_opts = opts if layers is None else replace(opts, n_gpu_layers=layers)
        if opts.aux_threads is not None:
            aux_opts = replace(aux_opts, threads=opts.aux_threads)
        aux = load_backend(  # the aux stays on this machine: no rpc
            Path(aux_path),
            n_ctx + layout.draft_cells,
            layout.draft_seqs,
            aux_opts,
            spin=False,
            positions=n_ctx,
            one_row=True,
        )
        loaded.insert(0, aux)
        vocab = pair_vocabulary(target, aux, (Path(target_path), Path(aux_path)), opts.vocab_mismatch, say)
    except BaseException:
        for m in loaded:
            m.close()
        if rpc is not None:
            rpc.close()
        raise
    return LoadedPair(target, aux, pair, vocab, names, rpc=rpc)
