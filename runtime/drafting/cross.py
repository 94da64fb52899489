"""Drafting across vocabularies: the aux keeps a context of its own for the target's text.

The drafter restricts q to aux tokens with a target twin (text/vocab.py's ``VocabMap``) and
renormalises it, so every drafted token is a target token; the target verifies as with one
vocabulary (Timor et al., ICML 2025: token-level intersection, lossless for speculative sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..backend import Backend
from ..text.vocab import VocabMap


class CrossVocab:
    """The aux side of a pair with different vocabularies: the aux's own context for the target's
    committed text, and the two directions of translation.

    Drafted tokens are aux tokens with a target twin, so an accepted draft token maps back one to
    one. A token the target commits on its own (a bonus token, a plain step) is appended as its aux
    twin when it has one; otherwise its bytes are re-tokenised with the aux tokenizer (a
    re-synchronisation). Bytes that do not yet form whole UTF-8 characters wait ("lagging"): the
    next step is then a plain target step, since the aux cannot see the text it would continue.
    """

    def __init__(self, vmap: VocabMap, target: Backend, aux: Backend):
        self.vmap, self.target, self.aux = vmap, target, aux
        self.synced = 0  # committed target tokens the aux context represents
        self.pending = b""  # their bytes not yet represented (an incomplete UTF-8 character)
        self.resyncs = 0
        self._mask = vmap.aux_mask

    def start(self, tokens: Sequence[int]) -> list[int]:
        """The aux context for committed ``tokens`` (a prompt): its text, tokenised by the aux."""
        text = b"".join(self.target.token_bytes(int(t)) for t in tokens).decode("utf-8", errors="replace")
        self.synced, self.pending = len(tokens), b""
        return self.aux.tokenize(text, add_special=True) or self.aux.tokenize(" ", add_special=True)

    def catch_up(self, ctx: list[int], tokens: Sequence[int]) -> None:
        """Append to ``ctx`` the aux tokens for the target tokens committed since the last call."""
        for t in tokens[self.synced :]:
            twin = int(self.vmap.t2a[int(t)])
            if twin >= 0 and not self.pending:
                ctx.append(twin)
                continue
            self.pending += self.target.token_bytes(int(t))
            try:
                text = self.pending.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data":
                    continue  # a character still being spelled out byte by byte
                text = self.pending.decode("utf-8", errors="replace")
            self.pending = b""
            if text:
                ctx.extend(self.aux.tokenize(text, add_special=False))
                self.resyncs += 1
        self.synced = len(tokens)

    def accepted(self, ctx: list[int], draft_aux: Sequence[int], k: int) -> None:
        """The first k tokens of a draft (aux ids) were committed by the target."""
        ctx.extend(int(a) for a in draft_aux[:k])
        self.synced += k

    @property
    def lagging(self) -> bool:
        return bool(self.pending)

    def restrict(self, logq: np.ndarray, logits: np.ndarray, score: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """q restricted to aux tokens with a target twin and renormalised, after filtering; where
        the filtered support has no such token, the restriction comes first."""
        out = np.where(self._mask, logq, -np.inf)
        empty = ~np.isfinite(out).any(axis=-1)
        if empty.any():
            out[empty] = score(np.where(self._mask, logits[empty], -np.inf))
        m = out.max(axis=-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(out - m - np.log(np.exp(out - m).sum(axis=-1, keepdims=True)))

    def to_target(self, aux_ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.vmap.a2t[aux_ids])

    def rows_to_target(self, rows: np.ndarray) -> np.ndarray:
        """(n, V_aux) log q rows -> (n, V_target): each twin carries its aux token's log q."""
        out = np.full((rows.shape[0], len(self.vmap.t2a)), -np.inf)
        idx = np.flatnonzero(self._mask)
        out[:, self.vmap.a2t[idx]] = rows[:, idx]
        return out
