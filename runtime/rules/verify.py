"""Verification rules as pure numpy functions (no model, no state), so they can be fuzzed.

Notation (the papers'): ``p`` is the target distribution, ``q`` the draft (auxiliary) one, both
*after* the same temperature / top-k / top-p filtering; ``x_1..x_gamma`` are the drafted tokens
and ``p_d = p(. | prefix, x_<d)``, ``q_d = q(. | prefix, x_<d)``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .sampling import Filter, sample, sample_logits


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


def match_verify(logits: np.ndarray, draft: np.ndarray, cfg: Filter, rng: np.random.Generator) -> tuple[int, int]:
    """Speculative sampling for a deterministic draft (q_d one-hot on x_d: a prompt-lookup draft).

    For d = 1..gamma draw y_d ~ p_d and keep x_d while y_d = x_d; the first y_d that differs is
    the next token, and when all gamma are kept a bonus token is drawn from p_{gamma+1}. Every
    emitted token is the target's own draw given the text before it, so the output is
    distributed exactly as p; x_d is kept with probability p_d(x_d), as by the token and block
    rules, which for a one-hot q are this rule in distribution. (llama.cpp verifies its drafts
    the same way: common_sampler_sample_and_accept_n.)

    Each emitted token costs one draw of ``sample_logits``, the plain step's sampler: with the
    same generator, lookup drafts leave a seeded run's text as plain decoding makes it.

    logits: (gamma + 1, V) raw target logits (p_d is ``cfg``'s filtered softmax of row d), draft:
    (gamma,) token ids. Returns (k accepted, next token).
    """
    for d, x in enumerate(draft):
        y = sample_logits(logits[d], cfg, rng)
        if y != int(x):
            return d, y
    return len(draft), sample_logits(logits[len(draft)], cfg, rng)


def block_verify(
    p_logp: np.ndarray, q_logp: np.ndarray, draft: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """Lossless block verification (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025, Algorithm 2): the drafted block is judged jointly, not token by token.

    With p_d, q_d the rows of depth d (0-based: the distributions of x_{d+1}), the paper's
    residual weights (its p_i; w_i here, since p names the target) are w_0 = 1 and

        w_i = min(1, w_{i-1} * p_{i-1}(x_i) / q_{i-1}(x_i)),   i = 1..gamma,

    and its stopping probabilities are h_gamma = w_gamma and, for 1 <= i < gamma,

        h_i = S_i / (S_i + 1 - w_i),   S_i = sum_x max(0, w_i * p_i(x) - q_i(x)).

    The accepted length tau is drawn from the end backwards: for i = gamma..1, stop at tau = i
    with probability h_i; if no depth stops, tau = 0 (the paper's forward loop "tau = i when
    eta_i <= h_i" keeps the last such i, the same law). The next token is drawn from the plain
    target row p_gamma when tau = gamma, else from the residual at the stopping depth,
    norm(max(0, w_tau * p_tau(.) - q_tau(.))) -- weighted by w_tau, unlike the token rule's
    norm(max(0, p_d - q_d)). The output is distributed exactly as p, and the paper proves the
    expected tau optimal among valid verifiers of one drafted block, so never below
    ``speculative_verify``'s. With gamma = 1, or with a deterministic draft (q one-hot on the
    drafted token, as an n-gram draft has: then w_i = prod_{j<=i} p_{j-1}(x_j)), it is the
    token rule in distribution.

    Same arguments and result as ``speculative_verify``. An h_i of 0/0 (w_i = 1 and p_i == q_i)
    is taken as 0: a later depth then stops surely, since x_{i+1} ~ q_i keeps w_{i+1} = 1.
    """
    gamma = len(draft)
    w = block_weights(p_logp, q_logp, draft)
    tau = 0
    for i in range(gamma, 0, -1):  # one uniform per depth, only as deep as needed
        if rng.random() < block_stop_prob(p_logp, q_logp, w, i):
            tau = i
            break
    return tau, sample(block_residual(p_logp, q_logp, w, tau), rng)


def block_weights(p_logp: np.ndarray, q_logp: np.ndarray, draft: np.ndarray) -> np.ndarray:
    """The residual weights w_0..w_gamma of ``block_verify``: w_0 = 1, w_i = min(1, w_{i-1} *
    p_{i-1}(x_i) / q_{i-1}(x_i)). A drafted token outside p's support makes w_i (and every later
    one) 0; one outside q's support (no draft sampled from q can hold it) counts as p/q = inf."""
    w = np.ones(len(draft) + 1)
    for i, x in enumerate(draft, start=1):
        lp, lq = p_logp[i - 1, x], q_logp[i - 1, x]
        if w[i - 1] == 0 or lp == -np.inf:
            w[i] = 0.0
        elif lq == -np.inf:
            w[i] = 1.0
        else:  # in logs: no overflow for a tiny q(x)
            w[i] = np.exp(min(0.0, np.log(w[i - 1]) + lp - lq))
    return w


def block_stop_prob(p_logp: np.ndarray, q_logp: np.ndarray, w: np.ndarray, i: int) -> float:
    """h_i of ``block_verify``: the probability of stopping at depth i (1..gamma) given that no
    deeper depth stopped (h_0 = 1: depth 0 always can)."""
    gamma = len(w) - 1
    if i == 0:
        return 1.0
    if i == gamma:
        return float(w[gamma])
    x = _support(p_logp[i])  # max(0, w p - q) vanishes where p does: sum over p's support only
    mass = float(np.maximum(w[i] * np.exp(p_logp[i, x]) - np.exp(q_logp[i, x]), 0.0).sum())
    denom = mass + (1.0 - float(w[i]))  # not (mass + 1) - w_i: that rounds h above 1 at w_i = 1
    return min(1.0, mass / denom) if denom > 0 else 0.0


def block_residual(p_logp: np.ndarray, q_logp: np.ndarray, w: np.ndarray, tau: int) -> np.ndarray:
    """Log of the distribution ``block_verify`` draws the next token from when it stops at depth
    ``tau``: the target row itself at tau = gamma, else norm(max(0, w_tau * p_tau(.) - q_tau(.))).
    A residual of no mass (w_tau = 1 and p == q numerically: a stop that has probability 0) falls
    back to the target row, as ``speculative_verify`` does."""
    if tau == len(w) - 1:
        return np.asarray(p_logp[tau])
    x = _support(p_logp[tau])
    residual = np.maximum(w[tau] * np.exp(p_logp[tau, x]) - np.exp(q_logp[tau, x]), 0.0)
    total = residual.sum()
    if total <= 0:
        return np.asarray(p_logp[tau])
    out = np.full(p_logp.shape[-1], -np.inf)
    with np.errstate(divide="ignore"):
        out[x] = np.log(residual / total)
    return out


def _support(logp_row: np.ndarray) -> np.ndarray:
    """The tokens a filtered row keeps (top-k / top-p leave a few of a whole vocabulary): the
    block rule's sums and residual over the rest are zero, so they are computed over these."""
    return np.flatnonzero(logp_row > -np.inf)


def mtad_accept_length(
    logp_x: np.ndarray, logq_x: np.ndarray, threshold: float, bars: Optional[np.ndarray] = None
) -> int:
    """MTAD acceptance (Qin et al., ICLR 2025): the longest prefix x_1..x_k with

        log p(x_1..x_k) - log q(x_1..x_k) > log(threshold),

    where log p(x_1..x_k) = sum_{d<=k} log p_d(x_d) and likewise for q. The joint ratio is
    checked at every depth and the *deepest* passing depth wins, so a later depth may pass
    after an earlier one failed. Returns k in 0..gamma.

    logp_x, logq_x: (gamma,) per-token log-probs of the drafted tokens under p and q; ``bars``:
    (gamma,) added to log(threshold) at each depth (a higher bar where the block repeats itself).
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    with np.errstate(invalid="ignore"):
        joint = np.cumsum(logp_x) - np.cumsum(logq_x)
    bar = np.log(threshold) + (0.0 if bars is None else bars)
    passing = np.flatnonzero(joint > bar)
    return int(passing[-1]) + 1 if len(passing) else 0


def greedy_accept_length(draft: np.ndarray, target_argmax: np.ndarray) -> int:
    """Temperature 0: p is one-hot, so p(x)/q(x) is 1 on a match with argmax p and 0 otherwise;
    the accepted prefix is the leading run of drafted tokens equal to the target's argmax."""
    mismatch = np.flatnonzero(np.asarray(draft) != np.asarray(target_argmax)[: len(draft)])
    return int(mismatch[0]) if len(mismatch) else len(draft)
