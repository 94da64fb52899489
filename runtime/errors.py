"""Errors the runtime raises on bad input. Each message is one line meant for the user."""

from __future__ import annotations

import json
import reprlib
import sys
from typing import Any, Optional, TypeGuard


class MtadEdgeError(Exception):
    """Base class: the CLI prints the message as a one-line error and exits non-zero; the server
    answers 400 (or the status its subclass names)."""


class OptionError(MtadEdgeError, ValueError):
    """A request option has a bad value; ``param`` names it (a ValueError too, for API users)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(MtadEdgeError):
    """A model file is missing, not a GGUF file, corrupt, or unsupported by the backend."""


class IncompatiblePairError(MtadEdgeError):
    """Target and auxiliary models do not share a vocabulary."""


class RpcError(MtadEdgeError):
    """An rpc server of the target's cannot be used (unreachable, refused, another protocol
    version), or was lost during a call; or llama.cpp's RPC backend is not built."""


class NonFiniteLogits(MtadEdgeError):
    """A model's logits held NaN or inf (a damaged file, a kernel bug, a peer's reply): the run
    cannot go on. Raised where a row is read (runtime/rules/sampling.py), then told again with the model
    and where its logits were computed, where that is known (mtad_edge/engine.py)."""


class ContextOverflowError(MtadEdgeError):
    """The prompt does not fit in the context window."""


def json_int(value: Any, lo: Optional[int] = None, hi: Optional[int] = None) -> TypeGuard[int]:
    """``value`` (read from JSON) is an integer in lo..hi: not a bool, which Python counts as one,
    and not a float such as 1.0."""
    return type(value) is int and (lo is None or lo <= value) and (hi is None or value <= hi)


def json_problem(e: BaseException) -> str:
    """What is wrong with a text ``json.loads`` refused, in one line for the user: the parser's own
    message, or what its other refusals mean (Python's message for an integer past its digit limit
    tells a programmer to call sys.set_int_max_str_digits)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return str(e)
    if isinstance(e, ValueError) and "digits" in str(e):
        return f"a number over {sys.get_int_max_str_digits()} digits long"
    return first_line(e)


def first_line(e: BaseException) -> str:
    """An exception's message as a one-line error quotes it: its first non-empty line (another
    library's messages run to several), else its type's name."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(e).__name__


# Characters of a user's value an error message quotes: enough to recognise it, never the whole
# of a 1 MB request body (a one-line error stays one short line).
QUOTE_MAX = 60


def quoted(value: Any, bare: bool = False) -> str:
    """``value`` as an error message quotes it: its repr (``bare``: a printable string as it is), cut to
    about QUOTE_MAX characters and followed by its length when it was longer. Cheap and safe for
    any input: a long string is never copied whole, a deeply nested list is shown a few levels deep."""
    if isinstance(value, str):
        head = value[:QUOTE_MAX]
        # Bare text keeps its characters, but a newline or a lone surrogate ("\ud800" in JSON) is
        # escaped as repr does: the message stays one line, and a server's reply can be encoded.
        head = (head if head.isprintable() else repr(head)[1:-1]) if bare else repr(head)
        if len(value) <= QUOTE_MAX:
            return head
        return f"{head if bare else head[:-1]}... ({len(value)} characters)"
    text = _REPR.repr(value)
    if len(text) > 2 * QUOTE_MAX:
        text = text[: 2 * QUOTE_MAX] + "..."
    if "..." in text and isinstance(value, (list, tuple, dict, set)):
        chars = sum(len(v) for v in value if isinstance(v, str))
        items = f"{len(value)} item{'s' if len(value) != 1 else ''}"
        return f"{text} ({items}" + (f", {chars} characters of text)" if chars else ")")
    return text


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, 24, 24, 24
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = 4
    return r


_REPR = _short_repr()
