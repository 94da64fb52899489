"""Drafting across vocabularies: which aux tokens have a twin in the target's vocabulary.

Tokens meet by the bytes they decode to, so GPT-2 byte-level (``Ġthe``), SentencePiece (``▁the``)
and plain spellings of " the" are the same token; byte-fallback pieces (``<0xE2>``) meet the
byte-level tokens of the same byte. Control tokens (the ones that print nothing) map only to
each other, by their vocabulary text. When several aux tokens decode to the same bytes, the
first keeps the twin, so the map is one-to-one on the tokens it covers.

The drafter restricts q to mapped aux tokens (and renormalises it), so every drafted token is a
target token; the target verifies as with one vocabulary (Timor et al., ICML 2025: token-level
intersection, lossless for speculative sampling).
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..backend import Backend


@dataclass(frozen=True)
class VocabMap:
    """``a2t[a]``: the target twin of aux token a (-1: none); ``t2a[t]``: the reverse."""

    a2t: np.ndarray
    t2a: np.ndarray

    @property
    def aux_mask(self) -> np.ndarray:
        """Aux tokens that have a target twin (the tokens a draft may use)."""
        return self.a2t >= 0

    @property
    def mapped(self) -> int:
        return int((self.a2t >= 0).sum())

    def coverage_of(self, target_tokens: Sequence[int]) -> float:
        """The share of these target tokens that an aux token could have drafted."""
        if not len(target_tokens):
            return 0.0
        return float((self.t2a[np.asarray(target_tokens, dtype=np.int64)] >= 0).mean())

    def save(self, path: str) -> None:
        np.savez(path, a2t=self.a2t, t2a=self.t2a)

    @classmethod
    def load(cls, path: str, n_target: int, n_aux: int) -> VocabMap:
        """A saved map between vocabularies of these sizes; ValueError when the file is damaged or
        holds something else (truncated, not an npz, arrays of another shape, type or range), which
        would fail only while decoding. ``np.load`` never unpickles here: a file runs no code."""
        try:
            with np.load(path) as z:
                a2t, t2a = z["a2t"], z["t2a"]
        except (OSError, EOFError, KeyError, TypeError, ValueError, zipfile.BadZipFile, zlib.error) as e:
            raise ValueError(f"not a vocabulary map: {e}") from None
        for name, a, n, other in (("a2t", a2t, n_aux, n_target), ("t2a", t2a, n_target, n_aux)):
            if a.dtype.kind not in "iu" or a.shape != (n,) or (n and not -1 <= a.min() <= a.max() < other):
                raise ValueError(f"not a vocabulary map: {name} is {a.dtype} {a.shape}, not {n} ids below {other}")
        return cls(a2t.astype(np.int64), t2a.astype(np.int64))


def token_keys(n_tokens: int, token_bytes: Callable[[int], bytes], text: Callable[[int], bytes]) -> list[bytes]:
    """What a token is matched by: its decoded bytes, or b"\\0" + its vocabulary text for control
    tokens (they decode to nothing), so that control tokens meet only control tokens."""
    keys = []
    for i in range(n_tokens):
        b = token_bytes(i)
        keys.append(b if b else b"\0" + text(i))
    return keys


Prefer = Callable[[list[int], bytes], int]  # among tokens with the same bytes, the canonical one


def build_map(
    target_keys: Sequence[bytes],
    aux_keys: Sequence[bytes],
    target_prefer: Optional[Prefer] = None,
    aux_prefer: Optional[Prefer] = None,
) -> VocabMap:
    """Aux -> target one to one between canonical tokens; target -> aux for every target token
    whose bytes have an aux twin (several target spellings may share one)."""
    t_can, a_can = _canonical(target_keys, target_prefer), _canonical(aux_keys, aux_prefer)
    a2t = np.full(len(aux_keys), -1, dtype=np.int64)
    t2a = np.full(len(target_keys), -1, dtype=np.int64)
    for key, a in a_can.items():
        t = t_can.get(key)
        if t is not None and key not in (b"", b"\0"):
            a2t[a] = t
    for t, key in enumerate(target_keys):
        a = a_can.get(key, -1)
        if a >= 0 and a2t[a] >= 0:
            t2a[t] = a
    return VocabMap(a2t, t2a)


def _canonical(keys: Sequence[bytes], prefer: Optional[Prefer]) -> dict[bytes, int]:
    groups: dict[bytes, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return {key: ids[0] if len(ids) == 1 else (prefer(ids, key) if prefer else max(ids)) for key, ids in groups.items()}


def tokenizer_preference(model: Backend) -> Prefer:
    """The token the model's own tokenizer makes of those bytes (SentencePiece vocabularies hold
    both a byte-fallback ``<0x2C>`` and an ordinary ``,``: the model writes the second)."""

    def prefer(ids: list[int], key: bytes) -> int:
        try:
            made = model.tokenize(key.decode("utf-8"), add_special=False)
        except UnicodeDecodeError:
            made = []
        return made[0] if len(made) == 1 and made[0] in ids else max(ids)

    return prefer


def map_models(target: Backend, aux: Backend) -> VocabMap:
    """The map between two loaded models' vocabularies (a second or two for 262k tokens)."""
    ti, ai = target.vocab_info(), aux.vocab_info()
    return build_map(
        token_keys(target.n_vocab, target.token_bytes, ti.text),
        token_keys(aux.n_vocab, aux.token_bytes, ai.text),
        tokenizer_preference(target),
        tokenizer_preference(aux),
    )


MIN_COVERAGE = 0.5  # below this share of the target's tokens draftable, drafting cannot pay (see README)

# A text sample for the coverage of a different vocabulary: prose, dialogue, code, numbers.
COVERAGE_SAMPLE = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who mended his nets every "
    'morning. "Could you explain how photosynthesis works?" she asked. Plants turn sunlight, water and carbon '
    "dioxide into glucose and oxygen; the reaction happens in the chloroplasts.\n\n"
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The meeting is on 12 March 2024 at 15:30, room 4B. Prices rose 3.7% in the first quarter, while "
    "unemployment fell to 4.1 per cent. Summarise the key points in three short bullet points."
)


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte <-> printable-unicode table, inverted (byte-level BPE token text -> bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_GPT2 = _gpt2_bytes()


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The bytes a tokenizer's vocabulary piece stands for: GPT-2 byte-level text decoded, a
    SentencePiece byte fallback ``<0xE2>`` as its byte, ``▁`` as a space."""
    if byte_level:
        try:
            return bytes(_GPT2[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


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
