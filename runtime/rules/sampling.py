"""Shared sampling: temperature, top-k, top-p on numpy arrays, seeded by the caller.

Everything works on log-probabilities. A filtered distribution is a float64 array of
shape (V,) or (rows, V) where tokens outside the kept set are ``-inf``. The order is the one
Hugging Face's logits processors use (and the paper's code inherits): temperature, then top-k,
then top-p. Temperature 0 means greedy: the distribution is one-hot on the argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

NEG_INF = -np.inf


class Filter(Protocol):
    """The sampling settings a filtered distribution depends on (config.SamplingConfig is one)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def greedy(self) -> bool: ...


@dataclass(frozen=True)
class RankAt1:
    """A filter's top-k and top-p at temperature 1: what greedy beam search ranks beams by (the
    greedy distribution is one-hot and cannot rank them)."""

    top_k: int
    top_p: float
    temperature: float = 1.0
    greedy: bool = False


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax that tolerates ``-inf`` entries (at least one finite per row)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        z = np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
    return np.asarray(x - m - z)


def top_k_mask(x: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest entries of each row, set the rest to -inf (ties broken by index)."""
    v = x.shape[-1]
    if k <= 0 or k >= v:
        return x
    idx = np.argpartition(-x, k - 1, axis=-1)[..., :k]
    out = np.full_like(x, NEG_INF)
    np.put_along_axis(out, idx, np.take_along_axis(x, idx, axis=-1), axis=-1)
    return out


def top_p_mask(logp: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filter on normalised log-probs: keep the smallest most-probable set whose mass
    reaches ``p`` (always at least one token), set the rest to -inf. Not renormalised."""
    if p >= 1.0:
        return logp
    order = np.argsort(-logp, axis=-1, kind="stable")
    sorted_p = np.exp(np.take_along_axis(logp, order, axis=-1))
    before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
    drop_sorted = before >= p
    drop = np.empty_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, NEG_INF, logp)


def filtered_logprobs(logits: np.ndarray, cfg: Filter) -> np.ndarray:
    """log of the distribution we sample from: temperature -> top-k -> top-p, renormalised.

    ``logits`` has shape (V,) or (rows, V). At temperature 0 each row is one-hot on its argmax.
    """
    logits = np.asarray(logits)
    if cfg.greedy:
        out = np.full(logits.shape, NEG_INF)
        np.put_along_axis(out, np.argmax(logits, axis=-1)[..., None], 0.0, axis=-1)
        return out
    if not 0 < cfg.top_k < logits.shape[-1]:
        return _nucleus(log_softmax(logits.astype(np.float64) / cfg.temperature), cfg.top_p)
    return KeptRows(*_top_k(logits, cfg), logits.shape[-1]).dense()


def kept_logprobs(logits: np.ndarray, cfg: Filter) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``filtered_logprobs`` of (rows, V) ``logits`` as the top-k entries alone: token ids and
    their log-probs, each (rows, k), ids ascending within a row (the order a full row lists them;
    top-p's drops are -inf). None where top-k keeps every token or sampling is greedy."""
    logits = np.asarray(logits)
    if cfg.greedy or not 0 < cfg.top_k < logits.shape[-1]:
        return None
    return _in_token_order(*_top_k(logits, cfg))


@dataclass(frozen=True)
class KeptRows:
    """Filtered log-probs of a few rows as the entries each keeps: ``ids`` (rows, k), with
    ``logp`` beside them (top-p's drops -inf; ``of`` lists them ascending, as ``kept_logprobs``);
    or, with ``ids`` None, ``logp`` is the whole (rows, V) of ``filtered_logprobs`` (top-k off,
    greedy)."""

    ids: Optional[np.ndarray]
    logp: np.ndarray
    n_vocab: int

    @classmethod
    def of(cls, logits: np.ndarray, cfg: Filter) -> KeptRows:
        logits = np.asarray(logits)
        kept = kept_logprobs(logits, cfg)
        if kept is None:
            return cls(None, filtered_logprobs(logits, cfg), logits.shape[-1])
        return cls(kept[0], kept[1], logits.shape[-1])

    def dense(self) -> np.ndarray:
        """The rows over the whole vocabulary, as ``filtered_logprobs`` gives them."""
        if self.ids is None:
            return self.logp
        out = np.full((*self.logp.shape[:-1], self.n_vocab), NEG_INF)
        np.put_along_axis(out, self.ids, self.logp, axis=-1)
        return out


@dataclass(frozen=True)
class Columns:
    """Rows of log-probs over ``vocab`` alone (ascending token ids): every token some row keeps,
    and the drafted ones. Every other token is -inf in every row, so a verification rule or a
    draw gives on these rows what it gives on full rows (the same tokens in the same order), for a
    fraction of the work: a row of a 128k vocabulary is a few dozen columns here."""

    vocab: np.ndarray
    rows: tuple[np.ndarray, ...]

    @classmethod
    def shared(cls, tokens: np.ndarray, *kept: KeptRows) -> Columns:
        """``kept``'s rows on the columns they share; ``tokens`` (drafted ids, -1 = none) get a
        column each whether kept or not."""
        n_vocab = kept[0].n_vocab
        if any(k.ids is None for k in kept):  # a whole row: every column
            return cls(np.arange(n_vocab), tuple(k.dense() for k in kept))
        tokens = np.asarray(tokens).ravel()
        ids = [np.asarray(k.ids) for k in kept]
        vocab = np.unique(np.concatenate([*(i.ravel() for i in ids), tokens[tokens >= 0]]))
        rows = []
        for i, k in zip(ids, kept):
            out = np.full((len(k.logp), len(vocab)), NEG_INF)
            np.put_along_axis(out, np.searchsorted(vocab, i), k.logp, axis=-1)
            rows.append(out)
        return cls(vocab, tuple(rows))

    def column(self, tokens: np.ndarray) -> np.ndarray:
        """The column of each token id (every id in ``vocab``)."""
        return np.searchsorted(self.vocab, tokens)


# Top-k bounds a row's k-th largest logit from below by the k-th largest maximum of this many
# interleaved groups of its logits (k distinct logits reach it), so argpartition runs only on the
# few logits at or above that bound: 25 against 400 us for a 49k-token row, paid by every plain
# step, verify row and aux row.
TOP_K_GROUPS = 384


def _top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids along the last axis, in no set order (the same ids for the
    same row). Temperature does not change the order."""
    v = logits.shape[-1]
    per_group = v // TOP_K_GROUPS
    if per_group < 2 or 2 * k > TOP_K_GROUPS:  # short rows, or a top-k the bound would hardly cut
        return _argpartition_top(logits, k)
    groups = logits[..., : per_group * TOP_K_GROUPS].reshape((*logits.shape[:-1], per_group, TOP_K_GROUPS))
    bounds = np.partition(groups.max(axis=-2), TOP_K_GROUPS - k, axis=-1)[..., TOP_K_GROUPS - k]
    if logits.ndim == 1:  # a plain step's row
        return _top_at_or_above(logits, bounds, k)
    rows = zip(logits.reshape(-1, v), bounds.reshape(-1))
    return np.stack([_top_at_or_above(row, bound, k) for row, bound in rows]).reshape((*logits.shape[:-1], k))


def _top_at_or_above(row: np.ndarray, bound: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids of ``row``, all at or above ``bound`` (the tail past the last
    whole group included: it is scanned here)."""
    cand = np.flatnonzero(row >= bound)
    if len(cand) < k:  # NaNs compare false: leave them to argpartition
        return _argpartition_top(row, k)
    return np.asarray(cand[_argpartition_top(row[cand], k)])


def _argpartition_top(x: np.ndarray, k: int) -> np.ndarray:
    v = x.shape[-1]
    return np.argpartition(x, v - k, axis=-1)[..., v - k :]


def _top_k(logits: np.ndarray, cfg: Filter) -> tuple[np.ndarray, np.ndarray]:
    """The top-k token ids of each row and their filtered log-probs (temperature, top-p),
    computed on the k kept entries only (cheap even for 262k-token vocabularies)."""
    idx = _top_ids(logits, cfg.top_k)
    vals = np.take_along_axis(logits, idx, axis=-1).astype(np.float64) / cfg.temperature
    return idx, _nucleus(log_softmax(vals), cfg.top_p)


def _in_token_order(idx: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ids ascending (the order a full row lists them), their log-probs with them."""
    order = np.argsort(idx, axis=-1)
    return np.take_along_axis(idx, order, axis=-1), np.take_along_axis(kept, order, axis=-1)


def _nucleus(logp: np.ndarray, top_p: float) -> np.ndarray:
    return log_softmax(top_p_mask(logp, top_p)) if top_p < 1.0 else logp


def sample_logits(logits: np.ndarray, cfg: Filter, rng: np.random.Generator) -> int:
    """``sample(filtered_logprobs(logits, cfg), rng)`` for one row, the same token for the same
    generator state (up to float rounding), without building the filtered row: a plain step works
    on the k kept entries only, in Python floats where they are few (``FEW_KEPT``)."""
    logits = np.asarray(logits)
    v = logits.shape[-1]
    if cfg.greedy:
        return int(np.argmax(logits))
    if not 0 < cfg.top_k < v:
        return sample(filtered_logprobs(logits, cfg), rng)
    if cfg.top_k <= FEW_KEPT:
        idx = _top_ids(logits, cfg.top_k)  # filtered_logprobs' pick among ties
        return _sample_few(idx.tolist(), logits[idx].tolist(), cfg, rng)
    idx, kept = _in_token_order(*_top_k(logits, cfg))  # as sample() finds them in a full row
    finite = np.isfinite(kept)
    if finite.sum() == 1:
        return int(idx[finite][0])
    probs = np.exp(kept[finite])
    return int(idx[finite][rng.choice(int(finite.sum()), p=probs / probs.sum())])


# Up to this many kept tokens (top-k), a plain step samples them in Python floats: right after a
# decode has streamed the weights through the caches, each numpy call costs tens of microseconds,
# and the two dozen a numpy version makes took 0.4 ms a token (2.5 % of the tiny pair's step).
FEW_KEPT = 64


def _sample_few(ids: list[int], logits: list[float], cfg: Filter, rng: np.random.Generator) -> int:
    """``sample()`` over the top-k entries ``ids`` (with their logits, in the order
    ``filtered_logprobs`` keeps them): temperature, top-p by probability (ties in that order, as
    its stable sort breaks them), then one uniform draw against the kept tokens' cumulative mass
    in token order, as ``Generator.choice`` draws in a full row."""
    x = [lg / cfg.temperature for lg in logits]
    top = max(x)
    w = [math.exp(v - top) for v in x]
    keep: Sequence[int] = range(len(w))
    if cfg.top_p < 1.0:
        total, before, nucleus = sum(w), 0.0, []
        for i in sorted(keep, key=lambda i: -w[i]):  # stable
            if before >= cfg.top_p:
                break
            nucleus.append(i)
            before += w[i] / total
        keep = nucleus
    chosen = sorted((ids[i], w[i]) for i in keep)  # token order
    if len(chosen) == 1:
        return int(chosen[0][0])
    u, cum = rng.random() * sum(p for _, p in chosen), 0.0
    for token, p in chosen:
        cum += p
        if cum > u:
            return int(token)
    return int(chosen[-1][0])


def sample(logp: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from a single filtered log-prob row."""
    idx = np.flatnonzero(np.isfinite(logp))
    if len(idx) == 1:
        return int(idx[0])
    probs = np.exp(logp[idx])
    return int(idx[rng.choice(len(idx), p=probs / probs.sum())])


def sample_without_replacement(scores: np.ndarray, n: int, rng: np.random.Generator | None) -> np.ndarray:
    """Pick up to ``n`` distinct flat indices of ``scores`` (log-weights, -inf = excluded).

    With ``rng`` the draw is proportional to exp(score) without replacement (Gumbel-top-n);
    with ``rng=None`` it is the deterministic top-n. Returned best first.
    """
    flat = scores.ravel()
    idx = np.flatnonzero(np.isfinite(flat))
    keys = flat[idx]
    if rng is not None:
        keys = keys + rng.gumbel(size=len(keys))
    n = min(n, len(idx))
    best = np.argsort(-keys, kind="stable")[:n]
    return idx[best]
