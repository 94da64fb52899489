"""Open a target/aux pair on llama.cpp, sized for a decoding config, and check they match."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mtad_edge.pairs import Pair
from mtad_edge.runtime.compat import check_pair
from mtad_edge.runtime.decoding import DecodeConfig
from mtad_edge.runtime.drafter import beam_slots
from mtad_edge.runtime.errors import MtadEdgeError


BACKENDS = ("auto", "llama.cpp", "onnx")


@dataclass(frozen=True)
class ModelOptions:
    n_ctx: Optional[int] = None  # None: the manifest's context_size, else 2048
    n_threads: Optional[int] = None
    n_gpu_layers: Optional[int] = None  # llama.cpp; None: all layers when the build can offload, else 0
    flash_attn: Optional[bool] = None  # llama.cpp
    backend: str = "auto"  # auto: llama.cpp for .gguf files, ONNX Runtime for model folders / .onnx
    provider: str = "auto"  # ONNX Runtime: auto (CUDA when available) | cpu | cuda


def _backend_for(path: Path, requested: str) -> str:
    kind = "onnx" if Path(path).is_dir() or Path(path).suffix == ".onnx" else "llama.cpp"
    if requested not in BACKENDS:
        raise MtadEdgeError(f"unknown backend {requested!r} (choose from {', '.join(BACKENDS)})")
    if requested != "auto" and requested != kind:
        raise MtadEdgeError(f"--backend {requested} cannot run {path} (that is a {kind} model)")
    return kind


def load_backend(path: Path, n_ctx: int, n_seq_max: int, opts: ModelOptions, spin: bool = True):
    """A Backend for one model file: LlamaCppBackend for GGUF, OrtBackend for ONNX. ``spin``:
    ONNX Runtime's idle threads may spin-wait (only for a model loaded alone, see OrtConfig.spin)."""
    if _backend_for(path, opts.backend) == "onnx":
        from mtad_edge.runtime.ort_backend import OrtBackend, OrtConfig

        return OrtBackend(
            path,
            OrtConfig(n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=opts.n_threads, provider=opts.provider, spin=spin),
        )
    from mtad_edge.runtime.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig

    return LlamaCppBackend(
        path,
        LlamaCppConfig(
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            n_threads=opts.n_threads,
            n_gpu_layers=_gpu_layers(opts.n_gpu_layers),
            flash_attn=opts.flash_attn,
        ),
    )


class LoadedPair:
    """The two backends of a pair; a context manager that closes both."""

    def __init__(self, target, aux, pair: Pair):
        self.target, self.aux, self.pair = target, aux, pair

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """Messages -> prompt text with the template the manifest names (default: the GGUF's)."""
        spec = (self.pair.manifest.data.get("chat_template") or {}) if self.pair.manifest else {}
        name = spec.get("name") if spec.get("source") == "builtin" else None
        return self.target.apply_chat_template(messages, template=name)

    def close(self) -> None:
        for m in (self.target, self.aux):
            if m is not None:
                m.close()

    def __enter__(self) -> "LoadedPair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _gpu_layers(requested: Optional[int]) -> int:
    if requested is not None:
        return requested
    import llama_cpp

    return -1 if llama_cpp.llama_supports_gpu_offload() else 0


def open_pair(pair: Pair, cfg: DecodeConfig, opts: ModelOptions = ModelOptions()) -> LoadedPair:
    """Load the target (and the aux unless ``cfg.method`` is ar) with contexts sized for ``cfg``.
    Each model runs on the backend its file calls for, so mixed GGUF/ONNX pairs work."""
    if pair.target is None:
        raise MtadEdgeError("--aux needs --target")
    if cfg.method != "ar" and pair.aux is None:
        raise MtadEdgeError(f"method {cfg.method} needs an auxiliary model: give --aux (or use --method ar)")
    n_ctx = opts.n_ctx or (pair.manifest.context_size if pair.manifest else 2048)
    tree = cfg.method == "mmtad"  # the target then verifies w beams as w sequences at once
    target = load_backend(
        Path(pair.target),
        n_ctx + (cfg.lookahead - cfg.gamma - 1 if tree else 0),
        cfg.width + 1 if tree else 1,
        opts,
        spin=cfg.method == "ar",
    )
    if cfg.method == "ar":
        return LoadedPair(target, None, pair)
    slots = beam_slots(cfg.width)
    try:
        # Beams add up to 2w(gamma-1) cells beside the committed text in the unified cache.
        aux = load_backend(Path(pair.aux), n_ctx + slots * cfg.gamma, slots, opts, spin=False)
    except Exception:
        target.close()
        raise
    try:
        check_pair(target, aux, f"target {Path(pair.target).name}", f"aux {Path(pair.aux).name}")
    except Exception:
        target.close()
        aux.close()
        raise
    return LoadedPair(target, aux, pair)
