"""Verification rules as pure numpy functions (no model, no state), so they can be fuzzed.

Notation (the papers'): ``p`` is the target distribution, ``q`` the draft (auxiliary) one, both
*after* the same temperature / top-k / top-p filtering; ``x_1..x_gamma`` are the drafted tokens
and ``p_d = p(. | prefix, x_<d)``, ``q_d = q(. | prefix, x_<d)``.
"""

from __future__ import annotations

import numpy as np

from .sampling import sample


def speculative_verify(
    p_logp: np.ndarray, q_logp: np.ndarray, draft: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    For d = 1..gamma: accept x_d with probability min(1, p_d(x_d) / q_d(x_d)); at the first
    rejection draw the replacement from the residual norm(max(0, p_d - q_d)) and stop. If all
    gamma are accepted, draw a bonus token from p_{gamma+1}. The output is distributed exactly
    as p. At temperature 0 (one-hot p and q) this is "accept while the draft equals argmax p".

    p_logp: (gamma + 1, V) filtered target log-probs, q_logp: (gamma, V) filtered draft log-probs,
    draft: (gamma,) token ids. Returns (k accepted, next token).
    """
    for d, x in enumerate(draft):
        ratio = np.exp(p_logp[d, x] - q_logp[d, x])
        if rng.random() < min(1.0, ratio):
            continue
        residual = np.maximum(np.exp(p_logp[d]) - np.exp(q_logp[d]), 0.0)
        total = residual.sum()
        if total <= 0:  # p == q numerically: resample from p
            return d, sample(p_logp[d], rng)
        with np.errstate(divide="ignore"):
            return d, sample(np.log(residual / total), rng)
    return len(draft), sample(p_logp[len(draft)], rng)


def mtad_accept_length(logp_x: np.ndarray, logq_x: np.ndarray, threshold: float) -> int:
    """MTAD acceptance (Qin et al., ICLR 2025): the longest prefix x_1..x_k with

        log p(x_1..x_k) - log q(x_1..x_k) > log(threshold),

    where log p(x_1..x_k) = sum_{d<=k} log p_d(x_d) and likewise for q. The joint ratio is
    checked at every depth and the *deepest* passing depth wins, so a later depth may pass
    after an earlier one failed. Returns k in 0..gamma.

    logp_x, logq_x: (gamma,) per-token log-probs of the drafted tokens under p and q.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    with np.errstate(invalid="ignore"):
        joint = np.cumsum(logp_x) - np.cumsum(logq_x)
    passing = np.flatnonzero(joint > np.log(threshold))
    return int(passing[-1]) + 1 if len(passing) else 0


def greedy_accept_length(draft: np.ndarray, target_argmax: np.ndarray) -> int:
    """Temperature 0: p is one-hot, so p(x)/q(x) is 1 on a match with argmax p and 0 otherwise;
    the accepted prefix is the leading run of drafted tokens equal to the target's argmax."""
    mismatch = np.flatnonzero(np.asarray(draft) != np.asarray(target_argmax)[: len(draft)])
    return int(mismatch[0]) if len(mismatch) else len(draft)
