"""OpenAI request parsing and response shapes for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from mtad_edge.runtime.decoding import METHODS


class BadRequest(Exception):
    """A 400 with an OpenAI-style error body."""

    def __init__(
        self, message: str, param: Optional[str] = None, status: int = 400, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def _number(body: dict, name: str, kind, lo=None, hi=None, lo_open=False):
    if name not in body or body[name] is None:
        return None
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise BadRequest(f"'{name}' must be {'a number' if kind is float else 'an integer'}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        bound = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
        raise BadRequest(
            f"'{name}' is out of range ({bound}{' and ' if lo is not None and hi is not None else ''}"
            f"{f'<= {hi}' if hi is not None else ''})",
            name,
        )
    return kind(v)


def generation_options(body: dict) -> dict:
    """The sampling/MTAD options of a request (OpenAI names plus our extra fields)."""
    opts = {
        "max_tokens": _number(body, "max_tokens", int, 1) or _number(body, "max_completion_tokens", int, 1),
        "temperature": _number(body, "temperature", float, 0, 2),
        "top_p": _number(body, "top_p", float, 0, 1, lo_open=True),
        "top_k": _number(body, "top_k", int, 0),
        "seed": _number(body, "seed", int, 0),
        "gamma": _number(body, "gamma", int, 1, 64),
        "beam_width": _number(body, "beam_width", int, 1, 64),
        "accept_threshold": _number(body, "accept_threshold", float, 0, 1, lo_open=True),
    }
    method = body.get("method")
    if method is not None:
        if method not in METHODS:
            raise BadRequest(f"'method' must be one of {', '.join(METHODS)}", "method")
        opts["method"] = method
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("only n=1 is supported", "n")
    return {k: v for k, v in opts.items() if v is not None}


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return stop
    raise BadRequest("'stop' must be a string or a list of up to 4 strings", "stop")


def chat_messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest("each message needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}] parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest("message content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string", "prompt")
    return prompt


def finish_reason(reason: Optional[str]) -> str:
    return "length" if reason in ("length", "context") else "stop"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chunk(
    kind: str, rid: str, model: str, created: int, text: Optional[str], reason: Optional[str], role: bool = False
) -> dict:
    """One streamed SSE event body."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def full(kind: str, rid: str, model: str, text: str, reason: str, prompt_tokens: int, tokens: int, stats: dict) -> dict:
    created = int(time.time())
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
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
