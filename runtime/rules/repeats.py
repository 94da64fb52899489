"""Repetition: the n-grams a text already holds, so that drafts need not degenerate.

MTAD's beam drafts favour the aux's most likely continuations, and the most likely continuation
is often one the text has already made: repetition is where beam search degenerates. Two
remedies, each a request option (runtime/options.py): the beam drafter skips tokens that would
repeat an n-gram of the text (``no_repeat``, as Hugging Face's ``no_repeat_ngram_size``), and
MTAD's joint test asks a drafted block that repeats one to clear a higher bar
(``repeat_penalty``). Neither touches sd's losslessness: a drafter that skips tokens hands over
the q it drew from, and sd's verify rules use that q.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np


class Seen:
    """The n-grams of a growing token list: for each (n-1)-token head, the tokens that followed
    it. Indexed incrementally (the list only grows within a run); a list that does not extend the
    one indexed (a new run) is indexed afresh."""

    def __init__(self, n: int) -> None:
        if n < 2:
            raise ValueError(f"n-grams of at least 2 tokens, got {n}")
        self.n = n
        self._tokens: list[int] = []
        self._next: dict[tuple[int, ...], set[int]] = {}

    def sync(self, tokens: Sequence[int]) -> None:
        old = self._tokens
        if len(tokens) < len(old) or (old and (int(tokens[len(old) - 1]) != old[-1] or int(tokens[0]) != old[0])):
            self._tokens, self._next, old = [], {}, []
        start = max(len(old) - self.n + 1, 0)  # the n-grams that the new tokens complete
        self._tokens.extend(int(t) for t in tokens[len(old) :])
        toks, head = self._tokens, self.n - 1
        for i in range(start, len(toks) - head):
            self._next.setdefault(tuple(toks[i : i + head]), set()).add(toks[i + head])

    def followers(self, context: Sequence[int], draft: Sequence[int]) -> set[int]:
        """The tokens that would repeat an n-gram if they came after ``context`` + ``draft`` (the
        context indexed by ``sync``; the draft's own n-grams counted too)."""
        head = self.n - 1
        tail = [int(t) for t in context[max(len(context) - head, 0) :]] + [int(t) for t in draft]
        key = tuple(tail[len(tail) - head :])
        if len(key) < head:
            return set()
        found = set(self._next.get(key, ()))
        for i in range(len(tail) - head):  # n-grams inside the tail: context end and draft
            if tuple(tail[i : i + head]) == key:
                found.add(tail[i + head])
        return found

    def repeats(self, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        """For each depth d of ``draft``, how many of the n-grams ending at x_1..x_d the text
        (the context, then the draft before them) already held."""
        out = np.zeros(len(draft), dtype=np.int64)
        count = 0
        for d in range(len(draft)):
            count += int(int(draft[d]) in self.followers(context, draft[:d]))
            out[d] = count
        return out


def ban(logq: np.ndarray, banned: set[int], ids: Optional[np.ndarray] = None) -> np.ndarray:
    """A filtered log q row without the ``banned`` tokens, renormalised (all -inf when nothing
    else is left: that beam has no continuation). ``ids``: the row holds these tokens' entries
    alone (sampling.kept_logprobs), not the whole vocabulary."""
    if not banned:
        return logq
    row = logq.copy()
    row[list(banned) if ids is None else np.isin(ids, list(banned))] = -np.inf
    finite = np.isfinite(row)
    if finite.any():
        row[finite] -= np.logaddexp.reduce(row[finite])
    return np.asarray(row)
