"""Perplexity of generated text under the target's raw distribution (no temperature/top-k/top-p)."""

from __future__ import annotations

import math

import numpy as np

from mtad_edge.runtime.backend import Backend, Batch
from mtad_edge.runtime.sampling import log_softmax


def token_logprobs(target: Backend, prompt: list[int], generated: list[int], chunk: int = 512) -> np.ndarray:
    """log p_target(g_i | prompt, g_<i) for every generated token, scored in batched passes
    (one pass when prompt + generated fit in ``chunk``; sequence 0 of ``target`` is reset)."""
    if not generated:
        return np.zeros(0)
    chunk = min(chunk, getattr(target, "n_batch", chunk))
    seq = list(prompt) + list(generated)
    first = len(prompt) - 1  # the row whose logits predict generated[0]
    target.rollback(0, 0)
    out = []
    pos = 0
    while pos < len(seq) - 1:
        run = seq[pos : min(pos + chunk, len(seq) - 1)]
        batch = Batch()
        for i, t in enumerate(run):
            batch.add(t, pos + i, (0,), pos + i >= first)
        rows = target.decode(batch)
        if len(rows):
            logp = log_softmax(np.asarray(rows))
            ids = np.array(seq[max(pos, first) + 1 : pos + len(run) + 1])
            out.append(logp[np.arange(len(ids)), ids])
        pos += len(run)
    target.rollback(0, 0)
    return np.concatenate(out)


def perplexity(logprobs: np.ndarray) -> float | None:
    return math.exp(-float(np.mean(logprobs))) if len(logprobs) else None
