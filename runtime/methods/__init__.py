"""Decoding methods, one object each, in one registry.

A method says what it needs (an aux model, beams, how many sequences and KV cells a step uses:
``layout``) and does one step (``step``: base.py has the contract). Adding a method is one module
plus one registry line.
"""

from __future__ import annotations

from collections.abc import Iterable

from .ar import AR
from .auto import Auto
from .base import Call, Layout, Method, StepResult, StepView
from .beam import Beam
from .mmtad import MMTAD
from .mtad import MTAD
from .sd import SD

__all__ = ["Call", "Layout", "Method", "StepResult", "StepView", "get", "names"]

_METHODS: dict[str, Method] = {m.name: m for m in (Auto(), AR(), SD(), MTAD(), MMTAD(), Beam())}


def get(name: str) -> Method:
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r} (choose from {', '.join(names())})") from None


def names() -> tuple[str, ...]:
    return tuple(_METHODS)


def expand(names: Iterable[str]) -> tuple[str, ...]:
    """Method names with what each may run in their place (``auto``: mtad and sd), in order."""
    out: list[str] = []
    for name in names:
        out += [name, *getattr(get(name), "picks", ())]
    return tuple(dict.fromkeys(out))
