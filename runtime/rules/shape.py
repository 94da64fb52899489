"""What turns a model's raw logits into the logits sampling reads, row by row: llama.cpp's penalties
on recent tokens, then a grammar's mask. Both depend on the text each row follows, so a target
call's rows along a draft (and each of the aux's beams, and each node of MMTAD's tree) get their
own: p stays the distribution plain sampling would draw each token from, and sd stays lossless
with respect to it.

    repeat_penalty    a logit of a token among the last ``last_n`` is divided by it (multiplied
                      where negative), as llama.cpp's sampler does;
    presence_penalty  subtracted once from the logit of each such token (OpenAI's);
    frequency_penalty subtracted once for each time it occurs there (OpenAI's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np


class Mask(Protocol):
    """A grammar's masks (text/constraint.py's ``Matcher``): ``path`` is the text a row follows past
    the committed answer, ``apply`` masks each row by its path."""

    def path(self, context: Sequence[int], beam: Sequence[int] = ()) -> tuple[int, ...]: ...

    def apply(self, logits: np.ndarray, paths: Sequence[Sequence[int]]) -> np.ndarray: ...


@dataclass(frozen=True)
class Penalties:
    repeat: float = 1.0
    last_n: int = 64
    presence: float = 0.0
    frequency: float = 0.0

    @classmethod
    def of(cls, cfg: object) -> Optional[Penalties]:
        """The penalties a sampling config asks for (None: none, nothing to do)."""
        found = cls(
            getattr(cfg, "repeat_penalty", 1.0),
            getattr(cfg, "repeat_last_n", 64),
            getattr(cfg, "presence_penalty", 0.0),
            getattr(cfg, "frequency_penalty", 0.0),
        )
        return found if found.last_n > 0 and (found.repeat != 1.0 or found.presence or found.frequency) else None

    def apply(self, logits: np.ndarray, tails: Sequence[Sequence[int]]) -> np.ndarray:
        """Row i penalised for the tokens of ``tails[i]`` (its last ``last_n`` tokens); a new array."""
        out = np.array(logits, dtype=np.float32, copy=True)
        for row, tail in zip(out, tails):
            ids, counts = np.unique(np.asarray(tail, dtype=np.int64), return_counts=True)
            ids, counts = ids[ids < len(row)], counts[ids < len(row)]
            x = row[ids]
            if self.repeat != 1.0:
                x = np.where(x > 0, x / self.repeat, x * self.repeat)
            row[ids] = x - counts * self.frequency - self.presence
        return out


@dataclass(frozen=True)
class Shape:
    """Penalties, then a mask, applied to the rows a call or a search reads; nothing at all where
    the request asks for neither (the default)."""

    penalties: Optional[Penalties] = None
    mask: Optional[Mask] = None

    @property
    def active(self) -> bool:
        return self.penalties is not None or self.mask is not None

    def rows(self, logits: np.ndarray, context: Sequence[int], beams: Sequence[Sequence[int]]) -> np.ndarray:
        """``logits`` with row i as it reads after ``context`` followed by ``beams[i]``."""
        if self.penalties is not None:
            n = self.penalties.last_n
            tails = [[*context[max(0, len(context) - n) :], *beam][-n:] for beam in beams]
            logits = self.penalties.apply(logits, tails)
        if self.mask is not None:
            logits = self.mask.apply(logits, [self.mask.path(context, beam) for beam in beams])
        return logits

    def along(self, logits: np.ndarray, context: Sequence[int], draft: Sequence[int] | np.ndarray) -> np.ndarray:
        """A target call's rows: its last len(draft) + 1 follow ``context`` and each prefix of
        ``draft``; rows before them (a prefill's) are left as they are."""
        draft = [int(t) for t in draft]
        n = len(draft) + 1
        rows = np.asarray(logits)
        shaped = self.rows(rows[-n:], context, [draft[:i] for i in range(n)])
        return shaped if len(rows) == n else np.concatenate([rows[:-n], shaped])
