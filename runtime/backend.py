"""The Backend protocol: what a decoder needs from a model runtime, and nothing more.

A backend owns one model and one KV cache holding several sequences (seq ids 0..n_seq_max-1).
The cache is indexed by position, so rolling back is bookkeeping: drop positions >= n.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np


@dataclass
class Batch:
    """Tokens to evaluate. Row i puts ``tokens[i]`` at ``pos[i]`` in every sequence of
    ``seq_ids[i]`` (several ids = a shared tree node); ``logits[i]`` asks for its logits."""

    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq_ids: list[tuple[int, ...]] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(self, token: int, pos: int, seq_ids: Sequence[int], logits: bool) -> "Batch":
        self.tokens.append(int(token))
        self.pos.append(int(pos))
        self.seq_ids.append(tuple(int(s) for s in seq_ids))
        self.logits.append(bool(logits))
        return self

    @classmethod
    def run(cls, tokens: Sequence[int], start: int, seq: int = 0, logits: str = "last") -> "Batch":
        """Consecutive tokens of one sequence from position ``start``; logits 'last', 'all' or 'none'."""
        b = cls()
        n = len(tokens)
        for i, t in enumerate(tokens):
            b.add(t, start + i, (seq,), logits == "all" or (logits == "last" and i == n - 1))
        return b

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class VocabInfo:
    kind: str  # tokenizer family, e.g. "bpe", "spm"
    n_tokens: int
    bos: int
    eos: int
    add_bos: bool
    text: Callable[[int], bytes]  # token id -> its text in the vocabulary


class Backend(Protocol):
    n_vocab: int
    n_ctx: int
    n_seq_max: int

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def vocab_info(self) -> VocabInfo: ...

    def decode(self, batch: Batch) -> np.ndarray:
        """Evaluate the batch; return logits (rows flagged in ``batch.logits``, V), float32.
        May be a read-only view valid until the next ``decode``: copy it to keep it."""
        ...

    def copy_seq(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` also hold ``src``'s cells in positions [p0, p1) (-1 = open end)."""
        ...

    def rollback(self, seq: int, n_keep: int) -> None:
        """Drop positions >= n_keep of ``seq`` (n_keep=0 clears it). Always succeeds."""
        ...

    def close(self) -> None: ...
