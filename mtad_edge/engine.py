"""The embeddable Python API: ``Engine.load(...)``, ``engine.generate(...)`` -> lazy ``Response``.

    from mtad_edge import Engine

    with Engine.load(pair="smollm2-135m") as engine:
        for chunk in engine.chat([{"role": "user", "content": "Hi!"}], max_tokens=64):
            print(chunk, end="", flush=True)
        print(engine.generate("The capital of France is", method="ar", max_tokens=8).text())

One request runs at a time per engine (others wait on a lock); a response holds the lock while
it is being iterated, so finish it (iterate to the end, ``.text()``) or ``close()`` it.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Optional, Sequence

from mtad_edge.loader import LoadedPair, ModelOptions, open_pair
from mtad_edge.pairs import resolve
from mtad_edge.runtime.decoding import DecodeConfig, Generation, KVState, Stats
from mtad_edge.runtime.sampling import SamplingConfig
from mtad_edge.textstream import TextStream


class StopText:
    """Cuts streamed text at the first stop string, holding back any tail that could still
    become one, so a stop string is never emitted in part."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, piece: str) -> tuple[str, bool]:
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Response:
    """A lazy generation: iterate for text chunks (never a split UTF-8 character, never part of
    a stop string) or call ``text()``. ``tokens``, ``stats`` and ``finish_reason`` are filled as
    it runs. ``cancel()`` may be called from any thread."""

    def __init__(self, engine: "Engine", gen: Generation, stop: Sequence[str]):
        self._engine, self._gen, self._stop = engine, gen, list(stop)
        self.prompt_tokens = len(gen.tokens)
        self._cancel = threading.Event()
        self._chunks: Optional[Iterator[str]] = None
        self._text: list[str] = []
        self.tokens: list[int] = []
        self.stats: Optional[Stats] = None
        self.finish_reason: Optional[str] = None

    def cancel(self) -> None:
        self._cancel.set()

    def __iter__(self) -> Iterator[str]:
        if self._chunks is None:
            self._chunks = self._run()
        return self._chunks

    def text(self) -> str:
        for _ in self:
            pass
        return "".join(self._text)

    def close(self) -> None:
        if self._chunks is not None:
            self._chunks.close()

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _emit(self, piece: str) -> Iterator[str]:
        if piece:
            self._text.append(piece)
            yield piece

    def _run(self) -> Iterator[str]:
        eng, gen = self._engine, self._gen
        with eng._lock:
            models = eng._require_open()
            self.stats = gen.stats
            text, stop = TextStream(models.target), StopText(self._stop)
            blocks = iter(gen)
            try:
                for block in blocks:
                    self.tokens += block
                    out, hit = stop.push(text.push(block))
                    yield from self._emit(out)
                    if hit:
                        self.finish_reason = "stop"
                        return
                    if self._cancel.is_set():
                        self.finish_reason = "cancelled"
                        return
                out, _ = stop.push(text.flush())
                yield from self._emit(out + stop.flush())
                self.finish_reason = gen.stats.finish_reason
            finally:
                blocks.close()  # ends the run cleanly (the KV state stays reusable)
                if self.finish_reason is None:
                    self.finish_reason = "cancelled"


class Engine:
    """A loaded target/aux pair serving one request at a time."""

    def __init__(self, models: LoadedPair, defaults: DecodeConfig):
        self._models: Optional[LoadedPair] = models
        self._defaults = defaults
        self._lock = threading.Lock()
        self._kv = KVState()

    @classmethod
    def load(
        cls,
        pair: Optional[str] = None,
        *,
        target: Optional[str] = None,
        aux: Optional[str] = None,
        manifest: Optional[str] = None,
        backend: str = "auto",
        provider: str = "auto",
        method: str = "mtad",
        gamma: int = 4,
        beam_width: int = 4,
        n_ctx: Optional[int] = None,
        threads: Optional[int] = None,
        n_gpu_layers: Optional[int] = None,
        flash_attn: Optional[bool] = None,
        **defaults: Any,
    ) -> "Engine":
        """Load a named pair / manifest, or ``target`` (+ ``aux``) model files: GGUF files run on
        llama.cpp, ONNX model folders on ONNX Runtime (``backend`` forces one). ``gamma`` and
        ``beam_width`` are also the most a request may ask for; other keyword arguments become
        request defaults (temperature, top_k, top_p, accept_threshold, max_tokens, seed)."""
        base = _config(DecodeConfig(method=method, gamma=gamma, beam_width=beam_width), defaults)
        paths = resolve(pair or manifest, target, aux)
        sizing = DecodeConfig(method="mmtad" if paths.aux else "ar", gamma=gamma, beam_width=beam_width)
        models = open_pair(
            paths,
            sizing,
            ModelOptions(
                n_ctx=n_ctx,
                n_threads=threads,
                n_gpu_layers=n_gpu_layers,
                flash_attn=flash_attn,
                backend=backend,
                provider=provider,
            ),
        )
        return cls(models, base)

    def generate(self, prompt: str, *, stop: Sequence[str] = (), **options: Any) -> Response:
        """Complete raw ``prompt`` text. Options: method, max_tokens, temperature, top_k, top_p,
        gamma, beam_width, accept_threshold, seed."""
        models = self._require_open()
        gen = Generation(models.target, models.aux, models.target.tokenize(prompt), self._request(options), kv=self._kv)
        return Response(self, gen, stop)  # prompt length is checked here, before any work

    def chat(self, messages: list[dict[str, str]], *, stop: Sequence[str] = (), **options: Any) -> Response:
        """Answer a conversation rendered with the pair's chat template."""
        return self.generate(self._require_open().render_chat(messages), stop=stop, **options)

    def tokenize(self, text: str) -> list[int]:
        return self._require_open().target.tokenize(text)

    @property
    def n_ctx(self) -> int:
        return self._require_open().target.n_ctx

    def close(self) -> None:
        with self._lock:
            if self._models is not None:
                self._models.close()
                self._models = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require_open(self) -> LoadedPair:
        if self._models is None:
            raise RuntimeError("this engine is closed")
        return self._models

    def _request(self, options: dict) -> DecodeConfig:
        cfg = _config(self._defaults, options)
        if cfg.method != "ar" and self._require_open().aux is None:
            raise ValueError(f"method {cfg.method} needs an auxiliary model; this engine has only a target")
        if cfg.gamma > self._defaults.gamma or cfg.beam_width > self._defaults.beam_width:
            raise ValueError(
                f"this engine was loaded for gamma <= {self._defaults.gamma} and "
                f"beam_width <= {self._defaults.beam_width}"
            )
        return cfg


_SAMPLING = ("temperature", "top_k", "top_p")
_DECODE = ("method", "max_tokens", "gamma", "beam_width", "accept_threshold", "seed")


def _config(base: DecodeConfig, options: dict) -> DecodeConfig:
    """``base`` with per-request options; unknown names and bad values raise ValueError."""
    unknown = set(options) - set(_SAMPLING) - set(_DECODE)
    if unknown:
        raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
    s = base.sampling
    sampling = SamplingConfig(**{k: options.get(k, getattr(s, k)) for k in _SAMPLING})
    return DecodeConfig(sampling=sampling, **{k: options.get(k, getattr(base, k)) for k in _DECODE})
