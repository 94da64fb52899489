"""Decoding methods, one object each, in one registry.

A method says what it needs (an aux model, beams, how many sequences and KV cells a step uses:
``layout``) and does one step (``step``): it asks the running ``Generation`` for target and draft
passes and returns the tokens it commits. Adding a method is one module plus one registry line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

if TYPE_CHECKING:
    from ..config import DecodeConfig
    from ..decoding import Generation


@dataclass(frozen=True)
class Layout:
    """What one step needs of each model's context, for gamma and width at most as given.
    ``*_cells``: KV cells a step may fill beyond the committed text."""

    target_seqs: int = 1
    target_cells: int = 1
    aux_seqs: int = 0
    aux_cells: int = 0

    def union(self, other: Layout) -> Layout:
        return Layout(*(max(a, b) for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.target_seqs, self.target_cells, self.aux_seqs, self.aux_cells)


class Method:
    name: ClassVar[str]
    summary: ClassVar[str]  # one line for --help
    needs_aux: ClassVar[bool] = True
    uses_beams: ClassVar[bool] = False  # the beam width applies
    tree: ClassVar[bool] = False  # the target verifies every beam's tree nodes (its rows grow with the width)
    # The shortest draft gamma 'auto' may choose: 0 (a plain target step) only where skipping the
    # draft leaves the output distribution as it is (lossless sd); MTAD sets 4, a joint draft.
    # Greedy decoding gives ar's text at any length, so there 'auto' starts at 0 for every method.
    min_auto_gamma: ClassVar[int] = 1

    def layout(self, gamma: int, width: int, cfg: Optional[DecodeConfig] = None) -> Layout:
        """What one step needs at gamma and width for the request ``cfg`` (None: for any request,
        the upper bound the loader sizes contexts for)."""
        raise NotImplementedError

    def fixed_plan(self, cfg: DecodeConfig) -> tuple[int, int]:
        """(gamma, width) of every step of a method without an aux, which no controller adapts."""
        return 0, 1

    def step(self, run: Generation, gamma: int, width: int) -> list[int]:
        """One target call (and its draft): the tokens to commit, at least one."""
        raise NotImplementedError


def _registry() -> dict[str, Method]:
    from .ar import AR
    from .beam import Beam
    from .mmtad import MMTAD
    from .mtad import MTAD
    from .sd import SD

    return {m.name: m for m in (AR(), SD(), MTAD(), MMTAD(), Beam())}


_METHODS: dict[str, Method] = {}


def get(name: str) -> Method:
    if not _METHODS:
        _METHODS.update(_registry())
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r} (choose from {', '.join(names())})") from None


def names() -> tuple[str, ...]:
    if not _METHODS:
        _METHODS.update(_registry())
    return tuple(_METHODS)
