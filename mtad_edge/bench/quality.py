"""Quality beyond perplexity: diversity (distinct-n), repetition (rep-4) and where a setting
stands against plain decoding's temperature curve.

Why: MTAD is mode-seeking, so its lower perplexity alone says little; lowering plain decoding's
temperature lowers perplexity too. The fair comparison is at *equal* perplexity: does the method
say more varied things (distinct-2) and repeat itself less (rep-4) than plain decoding at the
temperature that gives the same perplexity? All figures are over token ids, per output.

- distinct-n = unique n-grams / n-grams of one output;
- rep-n = share of an output's n-grams that already occurred earlier in the same output;
- over many outputs both are pooled (sums of counts over sums of n-grams), so a long output
  weighs as many n-grams as it has, and an output shorter than n adds nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

DISTINCT_N = (1, 2, 3)
REP_N = 4
BOOTSTRAP = 400  # resamples for the standard errors; fixed seed, so a report is reproducible


def ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_counts(tokens: Sequence[int], n: int) -> tuple[int, int]:
    """(unique n-grams, n-grams) of one output."""
    grams = ngrams(tokens, n)
    return len(set(grams)), len(grams)


def repeat_counts(tokens: Sequence[int], n: int = REP_N) -> tuple[int, int]:
    """(n-grams that already occurred earlier in the output, n-grams)."""
    grams = ngrams(tokens, n)
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated, len(grams)


def _ratio(num: float, den: float) -> Optional[float]:
    return num / den if den else None


def distinct(tokens: Sequence[int], n: int) -> Optional[float]:
    """distinct-n of one output (None when it has no n-gram)."""
    return _ratio(*distinct_counts(tokens, n))


def rep(tokens: Sequence[int], n: int = REP_N) -> Optional[float]:
    """rep-n of one output (None when it has no n-gram)."""
    return _ratio(*repeat_counts(tokens, n))


def run_counts(tokens: Sequence[int]) -> dict[str, int]:
    """The counts one run contributes to the pooled figures (kept in each results.json run)."""
    out: dict[str, int] = {}
    for n in DISTINCT_N:
        out[f"unique_{n}"], out[f"ngrams_{n}"] = distinct_counts(tokens, n)
    out[f"repeated_{REP_N}"], out[f"ngrams_{REP_N}"] = repeat_counts(tokens, REP_N)
    return out


def _pooled(rows: Sequence[dict[str, Any]]) -> dict[str, Optional[float]]:
    tot = lambda k: sum(r[k] for r in rows)  # noqa: E731
    out: dict[str, Optional[float]] = {
        f"distinct_{n}": _ratio(tot(f"unique_{n}"), tot(f"ngrams_{n}")) for n in DISTINCT_N
    }
    out[f"rep_{REP_N}"] = _ratio(tot(f"repeated_{REP_N}"), tot(f"ngrams_{REP_N}"))
    out["ppl"] = pooled_ppl(rows)
    if all("judge_tokens" in r for r in rows):
        out["judge_ppl"] = pooled_ppl(rows, "judge_logprob_sum", "judge_tokens")
    return out


def pooled_ppl(
    rows: Sequence[dict[str, Any]], logprob: str = "logprob_sum", count: str = "generated"
) -> Optional[float]:
    """Perplexity of several outputs together: exp of minus their summed log p per token (the
    target's: ``logprob_sum`` per generated token; the judge's: ``judge_logprob_sum`` per
    ``judge_tokens``)."""
    n = sum(r[count] for r in rows)
    return math.exp(-sum(r[logprob] for r in rows) / n) if n else None


QUALITY_KEYS = ("ppl", *(f"distinct_{n}" for n in DISTINCT_N), f"rep_{REP_N}")


def quality(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pooled distinct-1/2/3, rep-4 and PPL of one variant's runs (and the judge's PPL where a
    judge scored them), the mean output length, and bootstrap standard errors over runs (``se``),
    so a gap can be told from noise."""
    rows = [r for r in rows if "unique_1" in r]
    if not rows:
        return {}
    out: dict[str, Any] = dict(_pooled(rows))
    out["mean_length"] = sum(r["generated"] for r in rows) / len(rows)
    keys = QUALITY_KEYS + (("judge_ppl",) if "judge_ppl" in out else ())
    rng = np.random.default_rng(0)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    if len(rows) > 1:
        for _ in range(BOOTSTRAP):
            pooled = _pooled([rows[i] for i in rng.integers(0, len(rows), len(rows))])
            for k in keys:
                v = pooled[k]
                if v is not None:
                    samples[k].append(v)
    out["se"] = {k: float(np.std(v, ddof=1)) if len(v) > 1 else None for k, v in samples.items()}
    return out


# -- the plain-decoding curve -------------------------------------------------------------------
PPL_KEYS = ("ppl", "judge_ppl")  # the target's PPL, and an independent judge's (bench --judge)


def ar_curve(variants: dict[str, dict[str, Any]], by: str = "ppl") -> list[dict[str, Any]]:
    """Plain decoding's points (label, temperature, PPL, distinct-2, rep-4, their se), by PPL:
    the target's (``by="ppl"``) or the judge's (``by="judge_ppl"``, kept under that key)."""
    pts = []
    for label, agg in variants.items():
        if agg.get("method") != "ar" or agg.get(by) is None or agg.get("distinct_2") is None:
            continue
        se = agg.get("se") or {}
        pts.append(
            {
                "label": label,
                "temperature": agg["temperature"],
                by: agg[by],
                "distinct_2": agg["distinct_2"],
                "rep_4": agg["rep_4"],
                "se_distinct_2": se.get("distinct_2"),
                "se_rep_4": se.get("rep_4"),
            }
        )
    return sorted(pts, key=lambda p: p[by])


def _at(curve: list[dict[str, Any]], ppl: float, key: str, by: str = "ppl") -> Optional[float]:
    """``key`` of the curve at ``ppl`` (its ``by`` field), linear between the two points around it."""
    for a, b in zip(curve, curve[1:]):
        if a[by] <= ppl <= b[by]:
            if a[key] is None or b[key] is None:
                return None
            f = (ppl - a[by]) / (b[by] - a[by]) if b[by] > a[by] else 0.0
            return float(a[key] + f * (b[key] - a[key]))
    return None


def _clear(gap: float, se_point: Optional[float], se_curve: Optional[float]) -> Optional[bool]:
    """Whether a gap exceeds twice its combined standard error (None: no error known)."""
    if se_point is None or se_curve is None:
        return None
    return abs(gap) > 2 * math.hypot(se_point, se_curve)


def place(agg: dict[str, Any], curve: list[dict[str, Any]], by: str = "ppl") -> Optional[dict[str, Any]]:
    """Where one variant stands against the curve at its own PPL (the target's, or the judge's
    with ``by="judge_ppl"`` and a curve made by it).

    ``matched_temperature``: plain decoding's temperature with the same PPL (interpolated);
    ``curve_distinct_2`` / ``curve_rep_4``: the curve's figures there; ``distinct_2_gap`` (> 0:
    more diverse) and ``rep_4_gap`` (< 0: repeats less); ``verdict``: "beyond" when both are
    better (the variant lies beyond the curve), "behind" when both are worse, "mixed" otherwise,
    or "outside" when the curve does not reach the variant's PPL and no end point settles it.
    ``clear``: each gap exceeds two combined standard errors."""
    ppl, d2, r4 = agg.get(by), agg.get("distinct_2"), agg.get("rep_4")
    if len(curve) < 1 or ppl is None or d2 is None or r4 is None:
        return None
    se = agg.get("se") or {}
    lo, hi = curve[0], curve[-1]
    if lo[by] <= ppl <= hi[by] and len(curve) > 1:
        t = _at(curve, ppl, "temperature", by)
        cd2, cr4 = _at(curve, ppl, "distinct_2", by), _at(curve, ppl, "rep_4", by)
        sd2, sr4 = _at(curve, ppl, "se_distinct_2", by), _at(curve, ppl, "se_rep_4", by)
        where = "at"
    else:
        end = lo if ppl < lo[by] else hi
        t, cd2, cr4, sd2, sr4 = (end[k] for k in ("temperature", "distinct_2", "rep_4", "se_distinct_2", "se_rep_4"))
        where = "below" if ppl < lo[by] else "above"
    assert cd2 is not None and cr4 is not None
    g2, g4 = d2 - cd2, r4 - cr4
    better, worse = g2 >= 0 and g4 <= 0, g2 <= 0 and g4 >= 0
    if where == "at":
        verdict = "beyond" if better else "behind" if worse else "mixed"
    elif where == "below":  # lower PPL than any plain point: beyond if it also beats that point
        verdict = "beyond" if better else "outside"
    else:  # higher PPL than any plain point: behind if that point also beats it
        verdict = "behind" if worse else "outside"
    return {
        "matched_temperature": t,
        "ppl_range": where,  # "at": within the curve's PPL; "below"/"above": compared with its end point
        "curve_distinct_2": cd2,
        "curve_rep_4": cr4,
        "distinct_2_gap": g2,
        "rep_4_gap": g4,
        "clear": {"distinct_2": _clear(g2, se.get("distinct_2"), sd2), "rep_4": _clear(g4, se.get("rep_4"), sr4)},
        "verdict": verdict,
    }


def _placed(variants: dict[str, dict[str, Any]], by: str) -> dict[str, Any]:
    curve = ar_curve(variants, by)
    if not curve:
        return {}
    others = {label: agg for label, agg in variants.items() if agg.get("method") != "ar" and agg.get(by)}
    placed = {label: place(agg, curve, by) for label, agg in others.items()}
    return {"curve": curve, "variants": {k: v for k, v in placed.items() if v is not None}}


def frontier(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The plain-decoding curve and each other variant's place against it at equal target PPL
    (results.json ``frontier``), and where a judge scored the runs the same at equal judge PPL
    (``frontier.judge``: its curve by ``judge_ppl``); empty when no plain-decoding point has
    quality figures."""
    out = _placed(variants, "ppl")
    judged = _placed(variants, "judge_ppl")
    if out and judged:
        out["judge"] = judged
    return out


# -- how small a gap this run can tell from noise ------------------------------------------------
RESOLUTION_KEYS = ("distinct_2", f"rep_{REP_N}", *PPL_KEYS)


def resolution(variants: dict[str, dict[str, Any]], runs: Optional[int] = None) -> dict[str, Any]:
    """The smallest gap between two variants that exceeds two combined standard errors, per
    figure, for two variants with the median variant's error: 2 x sqrt(2) x median se (results.json
    ``resolution``; report.md: "gaps below ... are within noise here").

    ``runs``: project to variants of that many runs each instead (a bootstrap error over runs
    shrinks as one over the square root of their number): what a larger design would resolve,
    from a run made before it (a dry estimate; the lengths and the spread of runs assumed alike)."""
    out: dict[str, Any] = {}
    counts = []
    for key in RESOLUTION_KEYS:
        ses = []
        for agg in variants.values():
            se = (agg.get("se") or {}).get(key)
            if se is not None and agg.get("runs"):
                ses.append(se * math.sqrt(agg["runs"] / runs) if runs else se)
                counts.append(runs or agg["runs"])
        if ses:
            out[key] = 2 * math.sqrt(2) * float(np.median(ses))
    if out:
        out["runs"] = int(np.median(counts))
    return out
