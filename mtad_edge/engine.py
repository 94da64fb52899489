"""The one path every command takes: ``Engine`` loads a pair, ``Response`` runs a request.

    from mtad_edge import Engine

    with Engine.load(pair="smollm2-135m") as engine:
        for chunk in engine.chat([{"role": "user", "content": "Hi!"}], max_tokens=64):
            print(chunk, end="", flush=True)
        print(engine.generate("The capital of France is", method="ar", max_tokens=8).text())

One request runs at a time per engine (others wait on a lock); a response holds the lock while
it is being iterated, so finish it (iterate to the end, ``.text()``) or ``close()`` it. Closing the
engine closes its responses; a response left half-iterated by a thread that ended is closed by
the next request that needs the engine.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
import weakref
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from dataclasses import fields
from typing import Any, Optional

import numpy as np

from mtad_edge.floors import floor_for
from mtad_edge.loader import LoadedPair, ModelOptions, open_pair
from mtad_edge.logprobs import TokenLogprob, score, token_logprobs
from mtad_edge.pairs import Pair, recommended_options, resolve
from mtad_edge.runtime import methods
from mtad_edge.runtime.backend import Segments
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.drafting.controller import Model
from mtad_edge.runtime.errors import (
    ContextOverflowError,
    MtadEdgeError,
    NonFiniteLogits,
    OptionError,
    json_int,
    quoted,
)
from mtad_edge.runtime.options import AUTO, AUTO_WIDTH_MAX, check
from mtad_edge.runtime.stats import Stats
from mtad_edge.runtime.text import structured
from mtad_edge.runtime.text.chat import ROLES
from mtad_edge.runtime.text.constraint import Compiled, Grammar
from mtad_edge.runtime.text.constraint import compile as compile_grammar
from mtad_edge.runtime.text.special import TooLong
from mtad_edge.runtime.text.structured import CallStream, Event, ToolPlan
from mtad_edge.textstream import StopText, TextStream


class Response:
    """A lazy generation: iterate for text chunks (never a split UTF-8 character, never part of
    a stop string) or call ``text()``. ``tokens``, ``stats`` and ``finish_reason`` are filled as
    it runs. ``cancel()`` may be called from any thread.

    Under a constraint ``finish_reason`` is "stop" only where the answer is complete: "dead_end"
    where nothing the grammar allows could follow, "cut" where a stop string cut it short. With
    tools (``Engine.chat(tools=...)``) an answer of calls ends "tool_calls" and ``tool_calls`` holds
    them in OpenAI's shape (the text keeps the calls as the model wrote them);
    ``take_tool_deltas`` reads the answer as content and calls while it streams."""

    def __init__(
        self,
        engine: Engine,
        gen: Generation,
        stop: Sequence[str],
        logprobs: Optional[int] = None,
        constraint: Optional[Compiled] = None,
        calls: bool = False,
    ):
        self._engine, self._gen, self._stop, self._top = engine, gen, list(stop), logprobs
        self._constraint = constraint
        self._calls: Optional[CallStream] = CallStream() if calls else None
        self._deltas: list[Event] = []
        self.tool_calls: Optional[list[dict[str, Any]]] = None  # with tools: the calls the answer made
        self.prompt_ids: list[int] = list(gen.tokens)
        self.prompt_tokens = len(self.prompt_ids)
        self._cancel = threading.Event()
        self._chunks: Optional[Generator[str, None, None]] = None
        self._turn = threading.Lock()  # held while a thread takes the next chunk
        self._text: list[str] = []
        self.tokens: list[int] = []
        self.stats: Stats = gen.stats
        self.finish_reason: Optional[str] = None
        self.logprobs: Optional[list[TokenLogprob]] = None  # with generate(logprobs=N), once it ended
        self._meter: Optional[BlockMeter] = None  # with watch_blocks(): how each block's tokens came
        self._blocks: list[dict[str, Any]] = []  # its records not taken yet

    def cancel(self) -> None:
        self._cancel.set()

    def watch_blocks(self) -> None:
        """Record how each block of committed tokens came (``BlockMeter.record``), for
        ``take_blocks``; call it before iterating. Off by default: a plain request pays nothing."""
        if self._chunks is not None:
            raise RuntimeError("watch_blocks() must be called before the response is iterated")
        self._meter = BlockMeter(self.stats)

    def take_blocks(self) -> list[dict[str, Any]]:
        """The records of the blocks decoded since the last call, in order. A chunk's text comes
        from the blocks taken with it and before it: a chunk may hold back a partial character or
        the start of a stop string, so a block's text may come in a later chunk (or, cut by a stop
        string, never), and a chunk may bring several blocks or none. Once the run ended, the last
        call also holds a record of steps that committed no token (one that drew end-of-text)."""
        taken, self._blocks = self._blocks, []
        return taken

    @property
    def reads_calls(self) -> bool:
        """Whether the answer may be tool calls (``take_tool_deltas`` then says what it is)."""
        return self._calls is not None

    def take_tool_deltas(self) -> list[Event]:
        """With tools: the answer so far since the last call, as structured.CallStream's events
        (content, a call's name, its arguments' text); text that may still become a call is held
        back until it is known."""
        taken, self._deltas = self._deltas, []
        return taken

    def __iter__(self) -> Iterator[str]:
        if self._chunks is None:
            self._chunks = self._run()
        return self

    def __next__(self) -> str:
        """The next chunk. One thread at a time: a second one gets a RuntimeError saying so (it
        got the generator's 'already executing' ValueError)."""
        if self._chunks is None:
            self._chunks = self._run()
        chunks = self._chunks
        if not self._turn.acquire(blocking=False):
            raise RuntimeError("this response is being read by another thread: read a response from one thread")
        try:
            return next(chunks)
        finally:
            self._turn.release()

    def text(self) -> str:
        """The whole answer (runs it to the end first); the text so far once it stopped."""
        for _ in self:
            pass
        return "".join(self._text)

    def text_so_far(self) -> str:
        return "".join(self._text)

    def interrupted(self) -> None:
        """Record that the caller stopped the run (Ctrl-C, SIGTERM): what was made is kept, and
        the finish reason is "cancelled", as for any stopped answer."""
        self.close()
        self.finish_reason = self.stats.finish_reason = CANCELLED

    def close(self) -> None:
        """End the run here (its text so far is kept). A run that another thread is executing at
        this moment is cancelled instead: it ends at its next step."""
        chunks = self._chunks
        if chunks is None:
            return
        if inspect.getgeneratorstate(chunks) == inspect.GEN_RUNNING:
            self.cancel()
            return
        with contextlib.suppress(ValueError):  # it started running in another thread just now
            chunks.close()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _emit(self, piece: str) -> Iterator[str]:
        if piece:
            self._text.append(piece)
            if self._calls is not None:
                self._deltas += self._calls.push(piece)
            yield piece

    def _settle(self, hit: bool = False) -> None:
        """The answer ended (finish_reason set; ``hit``: by a stop string): a stop string that cut
        a constrained answer short makes it "cut"; an answer of tool calls makes it "tool_calls"."""
        if hit and self._constraint is not None and not self._constraint.complete("".join(self._text)):
            self.finish_reason = self.stats.finish_reason = "cut"
        if self._calls is not None:
            self._deltas += self._calls.finish()
            calls = self._calls.calls()
            if calls and self.finish_reason == "stop":
                self.tool_calls, self.finish_reason = calls, "tool_calls"

    def _run(self) -> Generator[str, None, None]:
        eng, gen = self._engine, self._gen
        with eng._hold(self._cancel, self) as started:
            if not started:  # cancelled while it waited for the engine: it never ran
                self.finish_reason = self.stats.finish_reason = CANCELLED
                return
            models = eng._require_open()
            text, stop = TextStream(models.target), StopText(self._stop)
            blocks, meter = _named(iter(gen), models), self._meter
            mark = time.perf_counter()
            try:
                for block in blocks:
                    self.tokens += block
                    if meter is None:
                        piece = text.push(block)
                    else:  # the drafted tokens kept and the rest decoded apart, for their characters
                        kept = meter.kept(len(block))
                        head, tail = text.push(block[:kept]), text.push(block[kept:])
                        self._blocks.append(meter.record(len(block), time.perf_counter() - mark, head, tail))
                        piece = head + tail
                    out, hit = stop.push(piece)
                    yield from self._emit(out)
                    if hit:
                        self.finish_reason = "stop"
                        self._settle(hit=True)
                        return
                    if self._cancel.is_set():
                        self.finish_reason = CANCELLED
                        return
                    mark = time.perf_counter()  # the consumer's time between chunks is not the run's
                if meter is not None and meter.steps_since():  # the last step committed nothing (end-of-text)
                    self._blocks.append(meter.record(0, time.perf_counter() - mark, "", ""))
                out, _ = stop.push(text.flush())
                yield from self._emit(out + stop.flush())
                self.finish_reason = gen.stats.finish_reason
                self._settle()
            finally:
                blocks.close()  # ends the run cleanly (the caches stay reusable)
                if self.finish_reason is None:
                    self.finish_reason = CANCELLED
                elif self._top is not None and self.finish_reason != CANCELLED:
                    try:
                        self.logprobs = score(models.target, self.prompt_ids, self.tokens, self._top)
                    except NonFiniteLogits:
                        raise NonFiniteLogits(_nonfinite(models)) from None
                self.stats.finish_reason = self.finish_reason  # a stop string or a cancel ends it here, not the loop


class BlockMeter:
    """How each block of committed tokens came, read as deltas of the run's ``Stats`` between
    blocks: every step of the loop yields one block (a step that commits no token, only an
    end-of-text, yields none: its figures go to the next record). The one place that knows which
    Stats counters say what a block is (the server's ``mtad_blocks``, the chat page)."""

    def __init__(self, stats: Stats):
        self.stats = stats
        self.last = self._marks()

    def _marks(self) -> dict[str, Any]:
        st = self.stats
        return {
            "calls": st.target_calls,
            "prefill_s": st.prefill_s,
            "gamma_hist": dict(st.gamma_hist),  # a handful of keys: one per drafted length
            "width_hist": dict(st.width_hist),
            # drafted and accepted by source: each drafter's counters (runtime/drafting/)
            "by": {name: (c["drafted"], c["accepted"]) for name, c in st.drafters.items()},
        }

    def steps_since(self) -> int:
        """Steps run since the last record."""
        return sum(self.stats.gamma_hist.values()) - sum(self.last["gamma_hist"].values())

    def kept(self, tokens: int) -> int:
        """Of a block of ``tokens`` about to be recorded, the drafted ones the target kept (its
        first ones; the rest is the target's own token, or a plain step's)."""
        accepted = self.stats.accepted - sum(a for _, a in self.last["by"].values())
        return max(0, min(tokens, accepted))

    def record(self, tokens: int, seconds: float, head: str, tail: str) -> dict[str, Any]:
        """The block since the last record: ``tokens`` committed in ``seconds`` (the prefill
        excluded) whose text is ``head`` (the kept drafted tokens) then ``tail``. ``source``: who
        drafted (None: a plain step); ``gamma``: the drafted length; ``width``: the beams drafted
        (None without a draft); ``chars``: the characters of head and tail (a character split
        between blocks counts in the block that completed it)."""
        now, last = self._marks(), self.last
        self.last = now
        was = last["by"]
        by = {s: (d - was.get(s, (0, 0))[0], a - was.get(s, (0, 0))[1]) for s, (d, a) in now["by"].items()}
        gammas = _grown(last["gamma_hist"], now["gamma_hist"])
        widths = _grown(last["width_hist"], now["width_hist"])
        drafted = sum(d for d, _ in by.values())
        return {
            "tokens": tokens,
            "drafted": drafted,
            "accepted": sum(a for _, a in by.values()),
            "source": max(by, key=lambda s: by[s][0]) if drafted else None,
            "gamma": max(gammas, default=0),
            "width": max(widths) if widths else None,
            "calls": now["calls"] - last["calls"],
            "steps": sum(now["gamma_hist"].values()) - sum(last["gamma_hist"].values()),
            "seconds": round(max(0.0, seconds - (now["prefill_s"] - last["prefill_s"])), 6),
            "chars": [len(head), len(tail)],
        }


def _grown(before: dict[int, int], after: dict[int, int]) -> list[int]:
    """The keys of a histogram whose count grew (the plans of the steps between two records)."""
    return [k for k, n in after.items() if n > before.get(k, 0)]


# The finish reason of an answer stopped before its end (cancel(), Ctrl-C, a client gone, shutdown).
CANCELLED = "cancelled"
_LOAD_FIELDS = tuple(f.name for f in fields(ModelOptions))
# The most alternatives a token's logprobs list, as the server's top_logprobs allows: each costs a
# row of the vocabulary kept per token (10**9 kept the whole vocabulary, +2.4 GB for 256 tokens).
LOGPROBS_MAX = 20


def check_text(text: Any, param: str, what: Optional[str] = None) -> None:
    """A prompt or message must be a str that UTF-8 can encode: a lone surrogate (what Python
    makes of invalid UTF-8 in a command-line argument, or a JSON "\\udcff" escape) cannot be
    tokenized."""
    what = what or param
    if not isinstance(text, str):
        raise OptionError(f"{what} must be a string, got {type(text).__name__}", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : min(e.end, e.start + 16)]  # the first few: a message is one short line
        try:
            shown = repr(bad.encode("utf-8", "surrogateescape"))  # the bytes a command line had
        except UnicodeEncodeError:
            shown = ascii(bad)
        raise OptionError(
            f"{what} is not valid UTF-8 text: {shown} at character {e.start} (undecodable bytes or lone surrogates)",
            param,
        ) from None


class Engine:
    """A loaded target/aux pair serving one request at a time."""

    def __init__(self, models: LoadedPair, defaults: DecodeConfig, capacity: Optional[tuple[int, int]] = None):
        self._models: Optional[LoadedPair] = models
        self._defaults = defaults
        self._gamma_cap, self._width_cap = capacity or _capacity(defaults)
        self.calibrated = Model()  # the load-time calibration: what seeded requests plan with
        self.learned = Model()  # what the adaptive controller learns about this pair, kept across requests
        self._lock = threading.Lock()
        self._owner: Optional[threading.Thread] = None  # the thread iterating a response (not its ident: reused)
        self._holder: Optional[Response] = None  # that response
        self._responses: weakref.WeakSet[Response] = weakref.WeakSet()  # what close() ends
        # The defaults the model recommended and open() applied: option -> (value, where from)
        self.recommended: dict[str, tuple[Any, str]] = {}

    @classmethod
    def open(
        cls,
        pair: Pair,
        options: ModelOptions = ModelOptions(),
        defaults: DecodeConfig = DecodeConfig(),
        method_names: Optional[Sequence[str]] = None,
        capacity: Optional[tuple[int, int]] = None,
        say: Callable[[str], None] = lambda s: None,
        given: Optional[Collection[str]] = None,
    ) -> Engine:
        """Load ``pair`` for ``method_names`` (default: every method it can run) with room for
        ``capacity`` = (gamma, beam width) at most (default: the defaults' own). ``given``: the
        request options the caller chose; the others the model recommends a value for (the pair's
        manifest, the GGUF's general.sampling.*) take it (None: ``defaults`` are used as they are)."""
        gamma, width = capacity or _capacity(defaults)
        if defaults.drafts_with_aux and pair.aux is None and defaults.method != AUTO:
            raise MtadEdgeError(_no_aux(defaults.method))
        names = methods.names() if method_names is None else method_names
        models = open_pair(pair, [*names, defaults.method], gamma, width, options, say)
        recommended: dict[str, tuple[Any, str]] = {}
        if given is not None:  # read once loaded: llama.cpp looks the GGUF's keys up in its own table
            try:
                found = recommended_options(pair, getattr(models.target, "meta", None), say)
                recommended = {k: v for k, v in found.items() if k not in given}
                defaults = defaults.with_options({k: value for k, (value, _) in recommended.items()})
            except BaseException:
                models.close()
                raise
        engine = cls(models, defaults, (gamma, width))
        engine.recommended = recommended
        if defaults.adaptive and models.aux is not None:
            from mtad_edge.calibrate import calibrated_model

            tree = any(methods.get(m).tree for m in models.methods)
            engine.calibrated = calibrated_model(models, options, gamma, width, tree)
            engine.learned = engine.calibrated.copy(frozen=False)
        return engine

    @classmethod
    def load(
        cls,
        pair: Optional[str] = None,
        *,
        target: Optional[str] = None,
        aux: Optional[str] = None,
        manifest: Optional[str] = None,
        method_names: Optional[Sequence[str]] = None,
        say: Callable[[str], None] = lambda s: None,
        **kwargs: Any,
    ) -> Engine:
        """Load a named pair / manifest, or ``target`` (+ ``aux``) model files: GGUF files run on
        llama.cpp, ONNX model folders on ONNX Runtime. Keyword arguments are ModelOptions
        (n_ctx, threads, n_gpu_layers, aux_gpu_layers, flash_attn, backend, provider, rpc) or request
        defaults (method, gamma, beam_width, temperature, ...); ``gamma`` and ``beam_width`` are
        also the most a request may ask for. Temperature, top-k, top-p and max_tokens not given
        take the model's recommended values where it has them (``Engine.recommended``)."""
        for name, value in (("pair", pair), ("target", target), ("aux", aux), ("manifest", manifest)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise OptionError(f"{name} must be a name or a path, got {quoted(value)}", name)
        known = methods.names()
        if method_names is not None and (
            isinstance(method_names, (str, bytes))
            or not isinstance(method_names, Sequence)
            or not all(isinstance(m, str) and m in known for m in method_names)
        ):
            raise OptionError(
                f"method_names must be a list of method names ({', '.join(known)}), got {quoted(method_names)}",
                "method_names",
            )
        options = ModelOptions(**{k: kwargs.pop(k) for k in _LOAD_FIELDS if k in kwargs})
        defaults = DecodeConfig().with_options(kwargs)
        named, t, a = (None if p is None else os.fspath(p) for p in (pair or manifest, target, aux))
        return cls.open(resolve(named, t, a, say=say), options, defaults, method_names, say=say, given=set(kwargs))

    def generate(
        self,
        prompt: str,
        *,
        stop: Sequence[str] = (),
        logprobs: Optional[int] = None,
        learned_costs: bool = False,
        parse_special: bool = True,
        constraint: Optional[Grammar] = None,
        response_format: Optional[dict[str, Any]] = None,
        json_schema: Optional[dict[str, Any]] = None,
        grammar: Optional[str] = None,
        **options: Any,
    ) -> Response:
        """Complete raw ``prompt`` text. Options: method, max_tokens, temperature, top_k, top_p,
        gamma, gamma_max, gamma_min, beam_width, tree, accept_threshold, seed. ``logprobs=N``
        (0..20): once the answer is complete, ``Response.logprobs`` holds each token's log-probability
        under the target's raw distribution and its N most likely alternatives
        (mtad_edge/logprobs.py). ``parse_special``: special tokens written in the prompt
        (``<|im_start|>``) become control tokens, as llama.cpp's tools read a raw prompt; False
        keeps them text. ``constraint``: a ``Grammar`` the answer follows (JSON schema, JSON object,
        Lark, GBNF, regex: docs/structured-output.md); the answer ends with finish reason "stop"
        where it is complete, "dead_end" where nothing the grammar allows can follow, "cut" where a
        stop string cut it short. Or, as the server's fields: ``response_format`` (OpenAI's
        {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...,
        "strict": ...}}), ``json_schema`` (a schema) or ``grammar`` (GBNF or Lark text); one at most.

        Without a seed the cached prefix of the last request is reused (a chat's next turn
        prefills only what is new). With one, the caches are cleared first: llama.cpp's logits
        depend on the batch shape the cached prefix was evaluated in, so only a prefill laid out
        as in a fresh context gives exactly what a fresh engine gives for that seed.

        ``learned_costs``: what gamma/width 'auto' plans with. False: a seeded request the frozen
        load-time calibration (its text depends on the seed only), an unseeded one what the engine
        has learned from the calls it made; True: what it learned, seed or not (``bench``: the
        speed an unseeded user gets, with seeds so that variants sample alike)."""
        check_text(prompt, "prompt")
        if not isinstance(parse_special, bool):
            raise OptionError(f"parse_special must be True or False, got {quoted(parse_special)}", "parse_special")
        asked = _constraint(constraint, response_format, json_schema, grammar, None)
        return self._start(lambda _: [(prompt, parse_special)], stop, logprobs, learned_costs, options, asked)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        stop: Sequence[str] = (),
        logprobs: Optional[int] = None,
        learned_costs: bool = False,
        constraint: Optional[Grammar] = None,
        response_format: Optional[dict[str, Any]] = None,
        json_schema: Optional[dict[str, Any]] = None,
        grammar: Optional[str] = None,
        tools: Optional[list[dict[str, Any]]] = None,
        tool_choice: Any = None,
        parallel_tool_calls: Optional[bool] = None,
        **options: Any,
    ) -> Response:
        """Answer a conversation rendered with the pair's chat template. Only the template's markup
        becomes control tokens: a message's text stays text, whatever it holds (a user's
        ``<|im_end|>`` closes no turn). ``constraint``, ``response_format``, ``json_schema``,
        ``grammar``: as ``generate``'s.

        ``tools`` (OpenAI's function list), ``tool_choice`` ("auto" by default, "none", "required"
        or {"type": "function", "function": {"name": ...}}), ``parallel_tool_calls`` (True: up to
        8 calls; default one, as llama-server): the answer may be (auto) or must be (required, named) calls,
        ``Response.tool_calls`` (docs/structured-output.md#tool-calls). Messages may hold an
        assistant's ``tool_calls`` and ``tool`` results."""
        self._check_messages(messages)
        plan = structured.tool_plan(tools, tool_choice, parallel_tool_calls)
        asked = _constraint(constraint, response_format, json_schema, grammar, plan)

        def segments(limit: int) -> Segments:
            if len(messages) > limit:  # every message renders to a token or more
                raise TooLong(limit, f"{len(messages)} messages, each a token or more")
            return self._require_open().chat_segments(messages, plan)

        calls = plan is not None and plan.mode != "none"
        return self._start(segments, stop, logprobs, learned_costs, options, asked, calls)

    @property
    def has_chat_template(self) -> bool:
        """Whether the pair has a chat template that renders (its own, or one its manifest names)."""
        try:
            self.render_chat([{"role": "user", "content": "Hi"}])
        except MtadEdgeError:
            return False
        return True

    def render_chat(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> str:
        """Messages (and ``tools``, offered as ``chat`` offers them) -> prompt text with the pair's
        chat template."""
        self._check_messages(messages)
        return self._require_open().render_chat(messages, structured.tool_plan(tools))

    def _check_messages(self, messages: Any) -> None:
        structured.check_messages(messages)
        for m in messages:
            check_text(m.get("role"), "messages", "each message's role")
            if m["role"] not in ROLES:  # as the server refuses it: a template would render it any way it likes
                raise OptionError(
                    f"a message's role must be {', '.join(ROLES[:-1])} or {ROLES[-1]}, got {quoted(m['role'])}",
                    "messages",
                )
            if m.get("content") is not None or not m.get("tool_calls"):  # an assistant's calls may come alone
                check_text(m.get("content"), "messages", "each message's content")

    def _start(
        self,
        text: Callable[[int], Segments],
        stop: Sequence[str],
        logprobs: Optional[int],
        learned_costs: bool,
        options: dict[str, Any],
        constraint: Optional[tuple[Grammar, str]] = None,
        calls: bool = False,
    ) -> Response:
        """A response to the prompt ``text(limit)`` makes: the request's options are checked first,
        then the prompt is tokenised, refused from its size where it cannot fit the context's
        ``limit`` tokens (before tokenising where its bytes or messages tell, else as it is), then
        the constraint compiled for the target's vocabulary (bounded in time, cached; a refusal
        names the argument it came from). ``calls``: the answer may be tool calls."""
        models = self._require_open()
        cfg, model, why = self._request(options, learned_costs)
        stops = check("stop", list(stop) if isinstance(stop, tuple) else stop)
        if logprobs is not None and not json_int(logprobs, 0, LOGPROBS_MAX):
            raise OptionError(f"logprobs must be an integer in 0..{LOGPROBS_MAX}, got {quoted(logprobs)}", "logprobs")
        seeded = cfg.seed is not None  # as a fresh engine: cleared caches, the load-time plan
        limit = models.target.n_positions
        try:
            ids = models.target.tokenize_segments(text(limit), limit=limit)
        except TooLong as e:
            raise ContextOverflowError(
                f"prompt has {e} but the context holds {limit} (--ctx-size); shorten it or raise --ctx-size"
            ) from None
        compiled = None
        if constraint is not None:
            try:
                compiled = compile_grammar(constraint[0], models.target)
            except OptionError as e:
                raise OptionError(str(e), constraint[1]) from None
        gen = Generation(
            models.target,
            models.aux,
            ids,
            cfg,
            reuse=not seeded,
            model=model,
            vocab=models.vocab,
            learn=learned_costs,
            constraint=compiled,
        )
        gen.stats.auto = why
        response = Response(
            self, gen, stops, logprobs, compiled, calls
        )  # prompt length is checked here, before any work
        self._responses.add(response)
        return response

    def score(self, prompt_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """log p_target(token | prefix) of each of ``tokens`` after ``prompt_ids`` (raw logits)."""
        with self._hold():
            models = self._require_open()
            n_vocab = models.target.n_vocab
            _check_ids(prompt_ids, "prompt_ids", n_vocab, least=1)
            _check_ids(tokens, "tokens", n_vocab)
            if len(prompt_ids) + len(tokens) > models.target.n_positions:
                raise OptionError(
                    f"prompt_ids and tokens hold {len(prompt_ids) + len(tokens)} tokens; the context holds "
                    f"{models.target.n_positions} (--ctx-size)",
                    "tokens",
                )
            try:
                return token_logprobs(models.target, list(prompt_ids), list(tokens))
            except NonFiniteLogits:
                raise NonFiniteLogits(_nonfinite(models)) from None

    def tokenize(self, text: str) -> list[int]:
        check_text(text, "text")
        return self._require_open().target.tokenize(text)

    @property
    def n_params(self) -> Optional[int]:
        """The target's parameters, where its backend says (llama.cpp does)."""
        return getattr(self._require_open().target, "n_params", None)

    @property
    def flash_attn(self) -> Optional[bool]:
        """Whether the target's context runs flash attention; None where its backend decided."""
        return getattr(self._require_open().target, "flash_attn", None)

    @property
    def rpc_traffic(self) -> Optional[dict[str, dict[str, int]]]:
        """Per RPC command, the target's traffic with its rpc servers so far (calls, bytes sent,
        bytes received); None where the target runs on this machine."""
        rpc = self._require_open().rpc
        return rpc.traffic() if rpc is not None else None

    @property
    def amx(self) -> bool:
        """Whether llama.cpp multiplies the target's weights with AMX (runtime/backends/amx.py)."""
        return bool(getattr(self._require_open().target, "amx", 0))

    @property
    def kernels(self) -> dict[str, Optional[dict[str, int]]]:
        """Per model, the matrix kinds llama.cpp multiplies with AMX (``amx``) and those we named
        for its repacked kernels (``repacked``); None for a model whose backend does not say."""
        pair = self._require_open()

        def of(model: Any) -> Optional[dict[str, int]]:
            return {"amx": model.amx, "repacked": model.repacked} if hasattr(model, "amx") else None

        return {"target": of(pair.target), "aux": of(pair.aux)}

    @property
    def n_ctx(self) -> int:
        """Tokens of prompt and answer a run may hold (--ctx-size; llama.cpp's context has more cells)."""
        return self._require_open().target.n_positions

    @property
    def pair(self) -> Pair:
        return self._require_open().pair

    @property
    def defaults(self) -> DecodeConfig:
        return self._defaults

    def close(self) -> None:
        """Free the models. Every response of the engine is cancelled first, and the one holding
        the engine is closed when this thread left it (a ``break`` out of it inside ``with
        Engine.load()``: close raised, the models stayed) or its thread has ended; one that another
        thread is iterating ends at its next step."""
        for response in list(self._responses):
            response.cancel()
        owner, holder = self._owner, self._holder
        if owner is not None and holder is not None and (owner is threading.current_thread() or not owner.is_alive()):
            holder.close()
        with self._hold():
            if self._models is not None:
                self._models.close()
                self._models = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------
    def _hold(self, cancel: Optional[threading.Event] = None, holder: Optional[Response] = None) -> _Held:
        if self._owner is threading.current_thread():
            raise RuntimeError(
                "another response of this engine is being iterated in this thread: "
                "finish it (or close() it) before starting the next"
            )
        return _Held(self, cancel, holder)

    def _require_open(self) -> LoadedPair:
        if self._models is None:
            raise RuntimeError("this engine is closed")
        return self._models

    def _request(
        self, options: dict[str, Any], learned_costs: bool = False
    ) -> tuple[DecodeConfig, Model, Optional[str]]:
        """The request's config (method 'auto' resolved, a tuned floor applied), the model it plans
        with (a seeded request: the frozen load-time calibration, its text the seed's alone; else
        what the engine has learned), and why 'auto' chose its method (None: not asked)."""
        models = self._require_open()
        cfg = self._defaults.with_options(options)
        model = self.learned if learned_costs or cfg.seed is None else self.calibrated
        cfg, why = cfg.resolved(model, models.aux is not None)
        cfg = floor_for(models.pair, cfg)
        self._can_run(cfg, chosen=why is not None)
        width = cfg.beam_width if isinstance(cfg.beam_width, int) else 0
        if cfg.max_gamma > self._gamma_cap or width > self._width_cap:
            param = (
                ("gamma" if isinstance(cfg.gamma, int) else "gamma_max") if width <= self._width_cap else "beam_width"
            )
            raise OptionError(
                f"this engine was loaded for gamma <= {self._gamma_cap} and beam_width <= {self._width_cap}", param
            )
        return cfg, model, why

    def _can_run(self, cfg: DecodeConfig, chosen: bool = False) -> None:
        """OptionError unless the engine was opened for the request's method and holds what drafts
        (``chosen``: by method 'auto', which drafts by prompt lookup where the pair has no aux)."""
        models = self._require_open()
        if cfg.method not in models.methods:
            opened = ", ".join(models.methods)
            raise OptionError(f"this engine was opened for {opened}: method {cfg.method} was not among them", "method")
        if cfg.drafts_with_aux and models.aux is None and not chosen:
            raise OptionError(_no_aux(cfg.method), "drafter" if cfg.drafter != AUTO else "method")


def _check_ids(ids: Any, param: str, n_vocab: int, least: int = 0) -> None:
    """Token ids handed over by a caller: a list of integers of the vocabulary (0..n_vocab-1), at
    least ``least`` of them; an OptionError naming ``param`` (an id past the vocabulary was an
    IndexError, a negative one llama.cpp's "decode failed", a float was scored as its integer)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise OptionError(f"{param} must be a list of token ids, got {quoted(ids)}", param)
    bad = next((t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
    if bad is not None:
        raise OptionError(f"{param} must hold integer token ids, got {quoted(bad)}", param)
    out = next((int(t) for t in ids if not 0 <= t < n_vocab), None)
    if out is not None:
        raise OptionError(f"{param}: token id {out} is not in the vocabulary (0..{n_vocab - 1})", param)
    if len(ids) < least:
        raise OptionError(f"{param} must hold at least {least} token id{'s' if least > 1 else ''}", param)


def _named(blocks: Iterator[list[int]], models: LoadedPair) -> Generator[list[int], None, None]:
    """A run's blocks; where a model's logits were not finite (runtime/rules/sampling.py), the error
    names the model and where its logits were computed."""
    try:
        yield from blocks
    except NonFiniteLogits:
        raise NonFiniteLogits(_nonfinite(models)) from None
    finally:
        close = getattr(blocks, "close", None)
        if close is not None:
            close()


def _nonfinite(models: LoadedPair) -> str:
    """Which model gave the non-finite logits, where its backend can tell (its last call's)."""
    for role, model in (("target", models.target), ("aux", models.aux)):
        finite = getattr(model, "last_logits_finite", None)
        if model is not None and finite is not None and not finite():
            name = os.path.basename(str(getattr(model, "path", ""))) or role
            origin = model.logits_origin() if hasattr(model, "logits_origin") else "its backend"
            return f"the {role} model {name} gave non-finite logits (NaN or inf), computed by {origin}; the run stopped"
    return "a model gave non-finite logits (NaN or inf); the run stopped"


def _constraint(
    constraint: Optional[Grammar],
    response_format: Any,
    json_schema: Any,
    grammar: Any,
    plan: Optional[ToolPlan],
) -> Optional[tuple[Grammar, str]]:
    """The request's grammar and the argument a refusal names: one of ``constraint`` and the
    format fields, joined with the tools' calls where they may be made."""
    found = structured.constraint_of(response_format, json_schema, grammar)
    if constraint is not None:
        if not isinstance(constraint, Grammar):
            raise OptionError(f"constraint must be a Grammar, got {quoted(constraint)}", "constraint")
        if found is not None:
            raise OptionError(f"give constraint or {found[1]}, not both", found[1])
        found = (constraint, "constraint")
    if plan is None or plan.mode == "none":
        return found
    joined = plan.grammar(found[0] if found else None)
    return (joined, "tools") if joined is not None else None


def _no_aux(method: str) -> str:
    return (
        f"method {method} drafts with an auxiliary model and there is none: "
        "give --aux, or draft by prompt lookup (--drafter ngram), or use --method ar"
    )


def _capacity(cfg: DecodeConfig) -> tuple[int, int]:
    """The longest draft and widest beam the contexts are sized for: the request defaults' own
    (an 'auto' width: up to AUTO_WIDTH_MAX)."""
    return cfg.max_gamma, cfg.beam_width if isinstance(cfg.beam_width, int) else AUTO_WIDTH_MAX


class _Held:
    """The engine's lock, owned by the thread that runs a request (``holder``). A request waiting
    for it gives up when ``cancel`` is set (a server client that went away frees its place in the
    queue at once); ``__enter__`` then returns False and the lock is not held. A holder whose
    thread has ended (it left its response half-iterated) is closed, which frees the lock."""

    POLL_S = 0.05  # how often a waiting request looks at its cancel flag and the holder's thread

    def __init__(self, engine: Engine, cancel: Optional[threading.Event] = None, holder: Optional[Response] = None):
        self.engine, self.cancel, self.holder, self.held = engine, cancel, holder, False

    def __enter__(self) -> bool:
        engine, lock = self.engine, self.engine._lock
        while not lock.acquire(timeout=self.POLL_S):
            if self.cancel is not None and self.cancel.is_set():
                return False
            owner, holder = engine._owner, engine._holder
            if owner is not None and holder is not None and not owner.is_alive():
                holder.close()  # suspended for ever: closing it runs its cleanup and releases the lock
        if self.cancel is not None and self.cancel.is_set():
            lock.release()
            return False
        self.held = True
        engine._owner, engine._holder = threading.current_thread(), self.holder
        return True

    def __exit__(self, *exc: Any) -> None:
        if self.held:
            self.held = False
            self.engine._owner = self.engine._holder = None
            self.engine._lock.release()
