"""OpenAI request parsing and response shapes for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from mtad_edge.logprobs import TokenLogprob
from mtad_edge.runtime.config import DECODE_FIELDS, SAMPLING_FIELDS
from mtad_edge.runtime.errors import quoted
from mtad_edge.runtime.text.chat import ROLES


class BadRequest(Exception):
    """A 4xx with an OpenAI-style error body; ``close``: the connection is closed after it."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.close = close

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Request field (OpenAI's name, or one of our extra fields) -> the option it sets: every request
# option under its own name, and OpenAI's newer name for max_tokens. Values are checked by the
# option table when the engine builds the request (runtime/options.py).
REQUEST_FIELDS = {**{name: name for name in DECODE_FIELDS + SAMPLING_FIELDS}, "max_completion_tokens": "max_tokens"}
# Fields read below, by kind of request.
HANDLED = {
    "chat": {"model", "messages", "stream", "stream_options", "n", "stop", "logprobs", "top_logprobs", "mtad_blocks"},
    "text": {"model", "prompt", "stream", "stream_options", "n", "stop", "logprobs", "parse_special", "mtad_blocks"},
}
# Structured output (runtime/text/structured.py), passed to the engine as they come: it checks them,
# and compiles the grammar in the request's worker.
FORMATS = ("response_format", "json_schema", "grammar")  # OpenAI's, and llama-server's two
TOOLS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only
HANDLED["chat"] |= {*FORMATS, *TOOLS}
HANDLED["text"] |= set(FORMATS)
# OpenAI fields that do not change the answer (bookkeeping for the caller): accepted, unused.
IGNORED = {"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
# OpenAI features this server does not implement, with the values that mean "not used" (what
# clients send by default); any other value is a 400 naming the field, as OpenAI answers for a
# parameter a model does not support. An unknown field is a 400 too (OpenAI's "Unrecognized
# request argument"), so nothing a client asks for is silently ignored.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "modalities": (["text"],),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
}
TOP_LOGPROBS_MAX = {"chat": 20, "text": 5}  # OpenAI's bounds
# stream_options: OpenAI's keys, each a boolean, with the values this server accepts.
# include_obfuscation pads every chunk with random text against length side channels: no padding
# is added here, so only false is accepted (true is a 400, not a promise silently broken).
STREAM_OPTIONS: dict[str, tuple[bool, ...]] = {"include_usage": (True, False), "include_obfuscation": (False,)}
# Message fields besides role and content, with the values that mean "not used" (an assistant
# message as some servers return it); any other field, or value, is a 400 naming it.
MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {"tool_calls": ([],), "refusal": (None,)}
# What each role's message may carry besides role and content: an assistant's tool calls, a tool
# result's call id (and a name, as older clients send it).
MESSAGE_FIELDS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}


@dataclass
class Parsed:
    """A checked request: what to generate and how to answer."""

    options: dict[str, Any]
    stop: Any
    stream: bool
    logprobs: Optional[int]  # None: not asked for; else how many alternatives per token
    include_usage: bool = False  # a stream ends with a chunk of no choices that carries the usage
    blocks: bool = False  # each streamed chunk carries "mtad_blocks": how its tokens came (the chat page asks)
    prompt: Optional[str] = None  # text completions
    parse_special: bool = True  # text completions: special tokens written in the prompt become control tokens
    messages: Optional[list[dict[str, Any]]] = None  # chat
    structured: Optional[dict[str, Any]] = None  # FORMATS and TOOLS as given (the engine checks them)


def parse(body: dict[str, Any], kind: str, model_name: Optional[str]) -> Parsed:
    """Check every field of a /v1/chat/completions ("chat") or /v1/completions ("text") body;
    BadRequest on the first problem. JSON null means "not given", as for OpenAI. ``model_name``:
    the one name served (another is a 404); None: any name is served."""
    for key, value in body.items():
        if value is None or key in HANDLED[kind] or key in REQUEST_FIELDS or key in IGNORED:
            continue
        if key in NEUTRAL:
            if any(_same(value, v) for v in NEUTRAL[key]):
                continue
            raise BadRequest(
                f"Unsupported parameter: '{key}' is not supported by this server"
                f" (accepted only as {' or '.join(json.dumps(v) for v in NEUTRAL[key])})",
                key,
                code="unsupported_parameter",
            )
        raise BadRequest(f"Unrecognized request argument supplied: {quoted(key, bare=True)}", quoted(key, bare=True))
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string", "model")
        if model_name is not None and model != model_name:
            raise model_not_found(model)
    stream = _typed(body, "stream", bool, False)
    include_usage = _stream_options(body, stream)
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
        raise BadRequest("only n=1 is supported", "n")
    logprobs = _logprobs(body, kind)
    if logprobs is not None and stream:
        raise BadRequest("logprobs are only returned without streaming: leave out 'stream' or 'logprobs'", "logprobs")
    blocks = _typed(body, "mtad_blocks", bool, False)
    if blocks and not stream:
        raise BadRequest("'mtad_blocks' describes streamed chunks: it needs 'stream': true", "mtad_blocks")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise BadRequest(
            "give 'max_tokens' or 'max_completion_tokens' (its newer name), not both", "max_completion_tokens"
        )
    opts = {name: body[key] for key, name in REQUEST_FIELDS.items() if body.get(key) is not None}
    stop = body.get("stop")  # null is "not given"; 0 or false is a bad value (it was read as no stop strings)
    parsed = Parsed(opts, () if stop is None else stop, stream, logprobs, include_usage, blocks)
    parsed.structured = {k: body[k] for k in (*FORMATS, *TOOLS) if k in HANDLED[kind] and body.get(k) is not None}
    if kind == "chat":
        parsed.messages = chat_messages(body)
    else:
        parsed.prompt = completion_prompt(body)
        parsed.parse_special = _typed(body, "parse_special", bool, True)
    return parsed


def model_not_found(model: str) -> BadRequest:
    name = quoted(model, bare=True)
    return BadRequest(
        f"The model '{name}' does not exist", "model", status=404, kind="invalid_request_error", code="model_not_found"
    )


def _unused(value: Any, neutral: Optional[tuple[Any, ...]]) -> bool:
    """JSON null, or one of the ``neutral`` values that mean "not used"."""
    return value is None or any(_same(value, v) for v in neutral or ())


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and not isinstance(a, bool) and a == b == 0)


_JSON_KINDS = {bool: "a boolean", int: "an integer"}  # what a client's JSON calls the types _typed takes


def _typed(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"'{key}' must be {_JSON_KINDS[kind]}, got {quoted(value)}", key)
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether the stream ends with a usage chunk. ``stream_options`` is read only with a stream
    (OpenAI refuses it without one too), and each of its keys is read or refused."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    for key, value in options.items():
        if value is None:
            continue
        if key not in STREAM_OPTIONS:
            known = " and ".join(f"'{k}'" for k in STREAM_OPTIONS)
            raise BadRequest(
                f"Unrecognized stream option {quoted(key)} in 'stream_options' ({known} are read)", "stream_options"
            )
        if not isinstance(value, bool):
            raise BadRequest(f"'stream_options.{key}' must be a boolean, got {quoted(value)}", "stream_options")
        if value not in STREAM_OPTIONS[key]:
            raise BadRequest(
                f"Unsupported parameter: 'stream_options.{key}' is not supported by this server"
                f" (accepted only as {' or '.join(json.dumps(v) for v in STREAM_OPTIONS[key])})",
                "stream_options",
                code="unsupported_parameter",
            )
    return bool(options.get("include_usage"))


def _logprobs(body: dict[str, Any], kind: str) -> Optional[int]:
    """How many alternatives per token the request wants, or None. Chat: ``logprobs`` (bool) and
    ``top_logprobs`` (0..20); completions: ``logprobs`` (0..5) is both."""
    top_max = TOP_LOGPROBS_MAX[kind]
    if kind == "chat":
        wanted = _typed(body, "logprobs", bool, False)
        top = _typed(body, "top_logprobs", int, None)
        if top is not None and not wanted:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        key = "top_logprobs"
    else:
        top = _typed(body, "logprobs", int, None)
        wanted, key = top is not None, "logprobs"
    if top is not None and not 0 <= top <= top_max:
        raise BadRequest(f"'{key}' must be an integer in 0..{top_max}, got {top}", key)
    return (top or 0) if wanted else None


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """The conversation: role and content (text, or text parts joined), an assistant's tool calls
    (its content may then be null) and a tool result's call id, each checked for its shape (the
    engine checks the calls' arguments)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest("each message needs a role of system, user, assistant or tool", "messages")
        role = m["role"]
        # The template reads these fields only: a name or a field of another role would be lost without a word.
        read = ("role", "content", *MESSAGE_FIELDS.get(role, ()))
        unread = [k for k, v in m.items() if k not in read and not _unused(v, MESSAGE_NEUTRAL.get(k))]
        if unread:
            name = quoted(unread[0], bare=True)
            raise BadRequest(
                f"messages[{i}] has a field '{name}' this server does not support for a {role} message"
                f" (it reads {', '.join(repr(k) for k in read)})",
                f"messages[{i}].{name}",
            )
        msg: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls:
            msg["tool_calls"] = _tool_calls(calls, i)
        content = m.get("content")
        if content is None and calls:
            msg["content"] = None
            out.append(msg)
            continue
        if isinstance(content, list):  # [{"type": "text", "text": ...}] parts
            if not content:
                raise BadRequest(f"messages[{i}].content is an empty list: give a string or text parts", "messages")
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest("only text content parts are supported", "messages")
            if not all(isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content: each text part needs a string 'text'", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest("message content must be a string", "messages")
        msg["content"] = content
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise BadRequest(
                    f"messages[{i}] (a tool result) needs its 'tool_call_id'", f"messages[{i}].tool_call_id"
                )
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls, in OpenAI's shape."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(f, dict)
            or c.get("type", "function") != "function"
            or not isinstance(f.get("name"), str)
            or not isinstance(f.get("arguments"), str)
        ):
            raise BadRequest(
                f"{where}[{j}] must be "
                '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "..."}}',
                where,
            )
        out.append(
            {"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": f["arguments"]}}
        )
    return out


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string", "prompt")
    return prompt


# The engine's finish reasons OpenAI's client reads as an answer cut short: a constrained answer that
# reached a dead end or was cut by a stop string is never "stop" (then it would be taken as whole);
# mtad_stats.finish_reason says which.
CUT_SHORT = ("length", "context", "dead_end", "cut")


def finish_reason(reason: Optional[str]) -> str:
    """OpenAI's finish_reason for ours: "tool_calls" where the answer is tool calls, "length" where it
    was cut short (max_tokens, the context, a constrained answer's dead end or stop-string cut), else
    "stop" (mtad_stats.finish_reason keeps ours: stop, length, context, dead_end, cut, cancelled)."""
    if reason == "tool_calls":
        return reason
    return "length" if reason in CUT_SHORT else "stop"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chunk(
    kind: str,
    rid: str,
    model: str,
    created: int,
    text: Optional[str],
    reason: Optional[str],
    role: bool = False,
    calls: Optional[list[dict[str, Any]]] = None,
) -> dict:
    """One streamed SSE event body; ``calls``: tool call deltas (``call_deltas``)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def call_deltas(events: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    """structured.CallStream's events as one chunk's content and OpenAI's tool call deltas: a
    call's first delta names it (index, id, type, name, arguments ""), the next ones carry its
    arguments' text."""
    text, calls = "", []
    for e in events:
        if e[0] == "content":
            text += e[1]
        elif e[0] == "call":
            _, index, cid, name = e
            calls.append({"index": index, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}})
        elif calls and calls[-1]["index"] == e[1]:
            calls[-1]["function"]["arguments"] += e[2]  # one delta per call and chunk
        else:
            calls.append({"index": e[1], "function": {"arguments": e[2]}})
    return text, calls


def usage_chunk(kind: str, rid: str, model: str, created: int, usage: dict, stats: dict) -> dict:
    """The last event of a stream with ``stream_options.include_usage``: no choices, the usage
    and the run's ``mtad_stats``."""
    return {**chunk(kind, rid, model, created, None, None), "choices": [], "usage": usage, "mtad_stats": stats}


def full(
    kind: str,
    rid: str,
    model: str,
    text: str,
    reason: str,
    prompt_tokens: int,
    tokens: int,
    stats: dict,
    logprobs: Optional[dict] = None,
    tool_calls: Optional[list[dict[str, Any]]] = None,
) -> dict:
    """A whole answer; ``tool_calls``: the calls it made (its content is then null)."""
    created = int(time.time())
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls else text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, tokens),
        "mtad_stats": stats,
    }


def logprobs_object(kind: str, entries: list[TokenLogprob], text: str) -> dict:
    """OpenAI's logprobs for the tokens of ``text`` (a stop string may have cut the text inside
    the last tokens: only tokens that begin inside it are listed)."""
    size = len(text.encode("utf-8"))
    kept, offset, offsets = [], 0, []
    for e in entries:
        if offset >= size:
            break
        kept.append(e)
        offsets.append(offset)
        offset += len(e.text)
    if kind == "chat":
        return {
            "content": [
                {**_token(e.text, e.logprob), "top_logprobs": [_token(b, lp) for _, b, lp in e.top]} for e in kept
            ],
            "refusal": None,
        }
    raw = b"".join(e.text for e in kept)
    return {
        "tokens": [_text(e.text) for e in kept],
        "token_logprobs": [e.logprob for e in kept],
        "top_logprobs": [{**{_text(b): lp for _, b, lp in e.top}, _text(e.text): e.logprob} for e in kept],
        "text_offset": [len(raw[:o].decode("utf-8", "ignore")) for o in offsets],
    }


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _token(b: bytes, logprob: float) -> dict:
    return {"token": _text(b), "logprob": logprob, "bytes": list(b)}
