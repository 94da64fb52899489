"""The Backend protocol: every call the runtime makes on a model runtime, and nothing more.

A backend owns one model and one KV cache holding several sequences (seq ids 0..n_seq_max-1).
The cache is indexed by position, so rolling back is bookkeeping: drop positions >= n. The
backend is the one place that records which tokens each sequence holds (``held``); decoders
derive everything else from it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Protocol, Union

import numpy as np

from .errors import ModelLoadError, quoted

LogitsWanted = Literal["last", "all", "none"]
TokenIds = Union[Sequence[int], np.ndarray]  # token ids as a list or a numpy array


@dataclass
class Batch:
    """Tokens to evaluate. Row i puts ``tokens[i]`` at ``pos[i]`` in every sequence of
    ``seq_ids[i]`` (several ids = a shared tree node); ``logits[i]`` asks for its logits."""

    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq_ids: list[tuple[int, ...]] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(self, token: int, pos: int, seq_ids: Sequence[int], logits: bool) -> Batch:
        self.tokens.append(int(token))
        self.pos.append(int(pos))
        self.seq_ids.append(tuple(int(s) for s in seq_ids))
        self.logits.append(bool(logits))
        return self

    @classmethod
    def run(cls, tokens: Sequence[int], start: int, seq: int = 0, logits: LogitsWanted = "last") -> Batch:
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
    add_eos: bool = False


# Text in pieces, each saying whether special tokens written in it become control tokens (a chat
# template's markup) or stay text (a message's content): runtime/text/special.py.
Segments = Sequence[tuple[str, bool]]


class Backend(Protocol):
    n_vocab: int
    n_ctx: int  # KV cells of the context (shared by all sequences)
    n_seq_max: int
    n_batch: int  # most rows one decode call may carry logits for
    n_positions: int  # committed tokens a run may hold (--ctx-size), at most n_ctx

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """``add_special``: BOS / EOS as the model adds them; ``special``: special tokens written
        in the text become control tokens (else they stay text)."""
        ...

    def tokenize_segments(self, segments: Segments, add_special: bool = True, limit: Optional[int] = None) -> list[int]:
        """Text given as segments, special tokens parsed only in those that say so; ``limit``:
        runtime/text/special.py's TooLong as soon as the text is known to make more tokens."""
        ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def vocab_info(self) -> VocabInfo: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], template: Optional[str] = None, add_assistant: bool = True
    ) -> str:
        """Render messages with the model's template, or ``template`` (a built-in name or text)."""
        ...

    def decode(self, batch: Batch) -> np.ndarray:
        """Evaluate the batch; return logits (rows flagged in ``batch.logits``, V), float32.
        May be a read-only view valid until the next ``decode``: copy it to keep it."""
        ...

    def held(self, seq: int) -> Sequence[int]:
        """The tokens ``seq`` holds, by position (read-only)."""
        ...

    def copy_seq(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` also hold ``src``'s cells in positions [p0, p1) (-1 = open end)."""
        ...

    def rollback(self, seq: int, n_keep: int) -> None:
        """Drop positions >= n_keep of ``seq`` (n_keep=0 clears it). Always succeeds."""
        ...

    def clear(self) -> None:
        """Empty every sequence: the cache is laid out as in a fresh context."""
        ...

    def close(self) -> None: ...


def feed(
    model: Backend, tokens: Sequence[int], extra: TokenIds = (), logits: LogitsWanted = "last", seq: int = 0
) -> np.ndarray:
    """Evaluate in ``seq`` the tokens of ``tokens`` it does not hold yet, then ``extra``. The
    sequence must hold a prefix of ``tokens``."""
    n = len(model.held(seq))
    run = [int(t) for t in tokens[n:]] + [int(t) for t in extra]
    return model.decode(Batch.run(run, n, seq, logits))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_NOT_FILES = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_model_file(path: Path) -> None:
    """A model file must be a regular file with something in it: a FIFO (whose open blocks),
    /dev/zero (endless), /dev/null, a symlink loop or /proc/self/mem (whose reads fail) are each
    named for what they are, not "not found"."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelLoadError(f"model file not found: {path}") from None
    except OSError as e:
        why = "a symbolic link that loops" if e.errno == errno.ELOOP else e.strerror or str(e)
        raise ModelLoadError(f"{path} cannot be read as a model file: {why}") from None
    kind = next((name for test, name in _NOT_FILES if test(st.st_mode)), None)
    if kind is not None:
        raise ModelLoadError(f"{path} is {kind}, not a model file")
    if st.st_size == 0:
        raise ModelLoadError(f"{path} is empty (0 bytes), not a model file")


def check_trained_context(path: Path, positions: int, trained: int) -> None:
    """A run's context may not be longer than the model's trained context (0: unknown, not checked)."""
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        raise ModelLoadError(f"the context size must be a positive integer, got {quoted(positions)}")
    if trained > 0 and positions > trained:
        raise ModelLoadError(
            f"a context of {positions} tokens is longer than {path.name} was trained for ({trained}): "
            f"give --ctx-size {trained} or less (or lower the manifest's context_size)"
        )
