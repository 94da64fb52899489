"""OpenAI request parsing and response shapes for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional


class BadRequest(Exception):
    """A 400 with an OpenAI-style error body."""

    def __init__(
        self, message: str, param: Optional[str] = None, status: int = 400, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


# Request field (OpenAI's name, or one of our extra fields) -> the option it sets. Values are
# checked by the option table when the engine builds the request (runtime/options.py).
REQUEST_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "method": "method",
    "gamma": "gamma",
    "gamma_max": "gamma_max",
    "tree": "tree",
    "beam_width": "beam_width",
    "accept_threshold": "accept_threshold",
}


def generation_options(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling/MTAD options of a request (OpenAI names plus our extra fields)."""
    opts: dict[str, Any] = {}
    for key, name in REQUEST_FIELDS.items():
        if body.get(key) is not None and name not in opts:
            opts[name] = body[key]
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    return opts


def stop_strings(body: dict[str, Any]) -> Any:
    """The stop strings as given (the engine checks them: a string or up to 4 strings)."""
    return body.get("stop") or ()


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
