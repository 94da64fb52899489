"""Adaptive against fixed settings, paired over the prompt-runs both made, with intervals.

The machine's speed swings between prompts more than between variants (the same prompt can run
30 % faster in one repeat than in the other on a small VM), so a ratio of two variants means little
without its interval. Every variant labelled 'METHOD g=auto' is compared with each fixed gamma of
its method that ran ('METHOD g=N'; sd also with ar): the ratio of pooled tok/s (generated tokens
over decoding seconds) and of perplexity, on the same prompts and seeds, with a bootstrap
interval from resampling those prompt-runs. Beside the pooled speed ratio, the median of the
per-prompt-run ratios: one stalled prompt-run (a variant at half its speed on a prompt it ran at
full speed in the other repeat) moves the pooled ratio by several per cent and the median hardly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Optional

import numpy as np

from .quality import pooled_ppl

Key = tuple[str, int]  # (prompt id, repeat)
Runs = dict[Key, dict[str, Any]]


def paired(
    runs: Sequence[dict[str, Any]], draws: int = 2000, level: float = 0.9, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per (auto variant, fixed setting): ``speed`` and ``ppl`` as {ratio, low, high}, and
    ``speed_median``, the median over prompt-runs of their own speed ratios."""
    by_label: dict[str, Runs] = {}
    for r in runs:
        by_label.setdefault(r["label"], {})[(r["prompt_id"], r["repeat"])] = r
    rng = np.random.default_rng(seed)
    rows = []
    for label, auto in by_label.items():
        method, _, gamma = label.partition(" g=")
        if gamma != "auto":
            continue
        fixed = [x for x in by_label if x.startswith(f"{method} g=") and x.partition(" g=")[2].isdigit()]
        for other in (["ar"] if method == "sd" and "ar" in by_label else []) + fixed:
            b = by_label[other]
            keys = sorted(set(auto) & set(b))
            if not keys:
                continue
            scored = all(r.get("logprob_sum") is not None for r in [*(auto[k] for k in keys), *(b[k] for k in keys)])
            rows.append(
                {
                    "variant": label,
                    "against": other,
                    "runs": len(keys),
                    "speed": interval(keys, partial(_speed_ratio, auto, b), draws, level, rng),
                    "speed_median": float(np.median([_speed_ratio(auto, b, [k]) for k in keys])),
                    "ppl": interval(keys, partial(ppl_ratio, auto, b), draws, level, rng) if scored else None,
                }
            )
    return rows


def _speed_ratio(a: Runs, b: Runs, keys: Sequence[Key]) -> float:
    rb = _rate(b, keys)
    return _rate(a, keys) / rb if rb > 0 else float("nan")


def ppl_ratio(a: Runs, b: Runs, keys: Sequence[Key]) -> float:
    pa, pb = pooled_ppl([a[k] for k in keys]), pooled_ppl([b[k] for k in keys])
    return pa / pb if pa is not None and pb else float("nan")


def _rate(runs: Runs, keys: Sequence[Key]) -> float:
    seconds = sum(runs[k]["decode_s"] for k in keys)
    return sum(runs[k]["generated"] for k in keys) / seconds if seconds > 0 else float("nan")


def resampled(
    keys: Sequence[Key], stat: Callable[[Sequence[Key]], float], draws: int, rng: np.random.Generator
) -> list[float]:
    """``stat`` on ``draws`` bootstrap resamples of the prompt-runs (the finite values; none
    from fewer than two)."""
    if len(keys) < 2:
        return []
    boots = [stat([keys[i] for i in rng.integers(0, len(keys), len(keys))]) for _ in range(draws)]
    return [x for x in boots if math.isfinite(x)]


def interval(
    keys: Sequence[Key],
    stat: Callable[[Sequence[Key]], float],
    draws: int,
    level: float,
    rng: np.random.Generator,
    finite: Optional[list[float]] = None,
) -> dict[str, Optional[float]]:
    """The point value and its ``level`` percentile interval (from ``finite``, resamples already
    drawn, or fresh ones)."""
    point = stat(keys)
    finite = resampled(keys, stat, draws, rng) if finite is None else finite
    if not finite:
        return {"ratio": point, "low": None, "high": None}
    low, high = np.percentile(finite, [50 * (1 - level), 50 * (1 + level)])
    return {"ratio": point, "low": float(low), "high": float(high)}
