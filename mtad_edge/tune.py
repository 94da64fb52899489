"""``mtad-edge tune``: the shortest draft that keeps MTAD's quality, measured for one pair.

A short draft makes MTAD's joint test less joint: more of the text is the bonus token, sampled
token by token, and perplexity rises. How fast it rises depends on the pair (docs/tuning.md has
the measurements), so the method's constant floor (``min_auto_gamma``, the paper's gamma 4) is
safe for every pair and slow for some, and gamma 'auto' uses it only until the pair at hand was
measured.

``tune`` decodes the quality prompts at fixed gamma = the method's floor (the reference), then one
shorter at a time on the same prompts and seeds. Each shorter gamma's pooled perplexity (under
the target's raw distribution, as ``bench`` scores it) is compared with the reference's on
bootstrap resamples of the prompt-runs, and it passes when at least ``confidence`` (0.8) of
them are within ``bound`` (1.05) x the reference's: a point estimate alone is a coin toss near
the bound (48 prompt-runs read a ratio of 1.03 as [0.98, 1.08]). The floor is the shortest that
passed, every longer one passing too; tuning stops at the first that does not. The record (each
gamma's PPL, ratio, 90 % interval, share within, tok/s) is saved by mtad_edge/floors.py, where
the engine reads it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from mtad_edge.bench.paired import interval, ppl_ratio, resampled
from mtad_edge.bench.quality import pooled_ppl
from mtad_edge.bench.run import BenchConfig, rendered_prompts, run_bench
from mtad_edge.bench.variants import make
from mtad_edge.engine import Engine
from mtad_edge.floors import has_floor, reference
from mtad_edge.runtime import methods
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import OptionError

BOUND = 1.05  # a shorter draft may raise PPL to at most this times the reference gamma's
CONFIDENCE = 0.8  # the share of resamples a shorter gamma must be within the bound in
LEVEL = 0.9  # the interval shown
DRAWS = 2000  # bootstrap resamples of the prompt-runs


def tunable() -> list[str]:
    return [name for name in methods.names() if has_floor(name)]


def check_tunable(cfg: DecodeConfig) -> None:
    """OptionError unless ``cfg`` is a request whose 'auto' floor is a quality floor."""
    if not has_floor(cfg.method):
        raise OptionError(
            f"{cfg.method} has no quality floor to tune (only mtad and mmtad trade quality for draft length)",
            "method",
        )
    if cfg.sampling.greedy:
        raise OptionError("temperature 0 is greedy: every draft length gives ar's text, nothing to tune", "temperature")
    if not isinstance(cfg.beam_width, int):
        raise OptionError("tune measures one beam width: give --beam-width N, not auto", "beam_width")


def choose(within: dict[int, float], ref: int, confidence: float = CONFIDENCE) -> int:
    """The shortest gamma below ``ref`` that (with every longer one) was within the bound with
    at least ``confidence``; ``ref`` when none was. ``within``: gamma -> the share of bootstrap
    resamples of the prompt-runs whose PPL ratio to ``ref`` is within the bound."""
    floor = ref
    for g in range(ref - 1, 0, -1):
        share = within.get(g)
        if share is None or not share >= confidence:
            break
        floor = g
    return floor


def tune(
    engine: Engine,
    cfg: DecodeConfig,
    prompts: list[dict[str, Any]],
    repeats: int,
    bound: float = BOUND,
    confidence: float = CONFIDENCE,
    progress: Callable[[int], None] = lambda n: None,
) -> dict[str, Any]:
    """Measure the floor (see the module doc). ``cfg``: the request options (its gamma is
    ignored). The record's ``gammas``: per gamma measured, pooled PPL, tok/s, generated tokens
    and (below the reference) the PPL ratio with its interval."""
    check_tunable(cfg)
    ref = reference(cfg)
    base = dataclasses.replace(cfg, gamma=ref, gamma_min=None, seed=cfg.seed or 0)
    # a prompt that cannot run fails now, not after minutes of tuning (the longest gamma needs the most room)
    rendered_prompts(engine, prompts, [base])
    rng = np.random.default_rng(0)
    runs: dict[int, dict[tuple[str, int], dict[str, Any]]] = {}
    rows: dict[int, dict[str, Any]] = {}
    for g in range(ref, 0, -1):
        bench = BenchConfig(variants=(make(cfg.method, {"gamma": g}),), repeats=repeats, decode=base)
        runs[g] = {(r["prompt_id"], r["repeat"]): r for r in run_bench(engine, prompts, bench, progress)}
        mine, keys = list(runs[g].values()), sorted(runs[g])
        seconds = sum(r["decode_s"] for r in mine)
        row: dict[str, Any] = {
            "ppl": pooled_ppl(mine),
            "tokens_per_s": sum(r["generated"] for r in mine) / seconds if seconds > 0 else None,
            "generated": sum(r["generated"] for r in mine),
        }
        if g < ref:
            stat = partial(ppl_ratio, runs[g], runs[ref])
            boots = resampled(keys, stat, DRAWS, rng)
            row["ppl_ratio"] = interval(keys, stat, DRAWS, LEVEL, rng, boots)
            row["within"] = float(np.mean([b <= bound for b in boots])) if boots else 0.0
        rows[g] = row
        if g < ref and not row["within"] >= confidence:
            break  # not shown to be within: the shorter ones are not tried
    within = {g: r["within"] for g, r in rows.items() if g < ref}
    s = cfg.sampling
    return {
        "floor": choose(within, ref, confidence),
        "reference": ref,
        "bound": bound,
        "confidence": confidence,
        "method": cfg.method,
        "beam_width": cfg.beam_width,
        "tree": cfg.tree,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "accept_threshold": cfg.accept_threshold,
        "prompt_runs": len(runs[ref]),
        "max_tokens": cfg.max_tokens,
        "seed": base.seed,
        "gammas": {str(g): r for g, r in rows.items()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
