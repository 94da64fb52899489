"""Log-probabilities of generated tokens under the target's raw distribution (what OpenAI's
``logprobs`` report: no temperature, top-k or top-p), with the most likely alternatives.

The decoders score every committed token, but with the request's filtered distribution and in
batch shapes that differ by method. Rather than thread raw rows through every method, the answer
is scored once more after the run, in one pass per ``n_batch`` tokens on top of the cached
prompt: the prompt is not evaluated again, and the target's sequence 0 then holds the prompt and
the answer, which the next request's prefix reuse sees through ``held``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from mtad_edge.runtime.backend import Backend, Batch, common_prefix
from mtad_edge.runtime.rules.sampling import log_softmax


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: bytes  # the token's bytes (a multi-byte character may span tokens)
    logprob: float
    top: list[tuple[int, bytes, float]]  # the ``top`` most likely tokens at this position, best first


def token_logprobs(target: Backend, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """log p_target(tokens[i] | prompt, tokens[:i]) for each generated token (what PPL is made of)."""
    return np.array([row[tok] for row, tok in _rows(target, prompt, tokens)], dtype=np.float64)


def score(target: Backend, prompt: Sequence[int], tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """log p_target(tokens[i] | prompt, tokens[:i]) for each generated token, and its ``top``
    most likely alternatives."""
    out: list[TokenLogprob] = []
    for row, tok in _rows(target, prompt, tokens):
        best = np.argpartition(-row, top)[:top] if 0 < top < len(row) else np.arange(len(row) if top else 0)
        best = best[np.argsort(-row[best], kind="stable")]
        alts = [(int(t), target.token_bytes(int(t)), float(row[t])) for t in best]
        out.append(TokenLogprob(tok, target.token_bytes(tok), float(row[tok]), alts))
    return out


def _rows(target: Backend, prompt: Sequence[int], tokens: Sequence[int]) -> Iterator[tuple[np.ndarray, int]]:
    """Each generated token's raw log-prob row and the token, from passes of ``n_batch`` rows on
    top of the cached prompt (the prompt is evaluated only where the cache lacks it)."""
    if not tokens:
        return
    seq = [*prompt, *tokens]
    first = len(prompt) - 1  # the position whose logits predict tokens[0]
    keep = min(common_prefix(target.held(0), seq), first)
    target.rollback(0, keep)
    if keep < first:
        target.decode(Batch.run(seq[keep:first], keep, logits="none"))
    for lo in range(first, len(seq) - 1, target.n_batch):
        run = seq[lo : min(lo + target.n_batch, len(seq) - 1)]
        logp = log_softmax(np.array(target.decode(Batch.run(run, lo, logits="all"))))
        for row, pos in zip(logp, range(lo, lo + len(run))):
            yield row, int(seq[pos + 1])
