"""``mtad-edge tune``: the shortest draft that keeps MTAD's quality, measured for one pair.

A short draft makes MTAD's joint test less joint: more of the text is the bonus token, sampled
token by token, and perplexity rises. How fast it rises depends on the pair: gamma 3 against
gamma 4, on the quality prompts with 48 prompt-runs, measured 1.07x and 1.03x (mtad, two sets of
seeds) on SmolLM2-135M and 1.01x and 1.02x on Gemma 3 270M. A class constant (the method's
``min_auto_gamma``, 4, the paper's gamma) is safe for every pair and slow for some, so gamma
'auto' uses it only until the pair at hand was measured.

``tune`` decodes the quality prompts at fixed gamma = the method's floor (the reference), then one
shorter at a time on the same prompts and seeds. Each shorter gamma's pooled perplexity (under
the target's raw distribution, as ``bench`` scores it) is compared with the reference's on
bootstrap resamples of the prompt-runs, and it passes when at least ``confidence`` (0.8) of
them are within ``bound`` (1.05) x the reference's: a point estimate alone is a coin toss near
the bound (48 prompt-runs read a ratio of 1.03 as [0.98, 1.08]). The floor is the shortest that
passed, every longer one passing too; tuning stops at the first that does not. The record (each
gamma's PPL, ratio, 90 % interval, share within, tok/s) is cached under <cache>/floors/ per
(model files, method, beam width, tree, temperature, top-k, top-p, accept threshold): what
changes the text, not the speed. A request with gamma 'auto', sampling, a fixed width and no
gamma_min of its own then starts from it (Stats.gamma_min shows it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from mtad_edge.calibrate import files_identity
from mtad_edge.pairs import Pair, home
from mtad_edge.runtime import methods
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.options import AUTO

BOUND = 1.05  # the bound: PPL <= 1.05x the PPL at the reference gamma
CONFIDENCE = 0.8  # the share of resamples a shorter gamma must be within the bound in
LEVEL = 0.9  # the interval shown
DRAWS = 2000


def reference(cfg: DecodeConfig) -> int:
    """The gamma quality is measured against: the method's own 'auto' floor."""
    return methods.get(cfg.method).min_auto_gamma


def has_floor(method: str) -> bool:
    """Whether a method's 'auto' floor is a quality floor (a joint draft: mtad, mmtad)."""
    m = methods.get(method)
    return m.needs_aux and m.min_auto_gamma > 1


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


def key(pair: Pair, cfg: DecodeConfig) -> str:
    """The cache key of a floor: the model files and every option that changes the text."""
    s = cfg.sampling
    parts: list[Any] = [*files_identity(pair.target, pair.aux), cfg.method, cfg.beam_width, cfg.tree]
    parts += [s.temperature, s.top_k, s.top_p, cfg.accept_threshold]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def path_for(pair: Pair, cfg: DecodeConfig) -> Path:
    return home() / "floors" / f"{key(pair, cfg)}.json"


def floor_for(pair: Pair, cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with gamma_min set from a tuned floor, when it is a request that would use the
    method's constant one (gamma 'auto', sampling, a fixed width, no gamma_min given) and a
    floor was measured for exactly these files and options; else ``cfg`` itself."""
    if cfg.gamma != AUTO or cfg.gamma_min is not None or cfg.sampling.greedy or not isinstance(cfg.beam_width, int):
        return cfg
    if not has_floor(cfg.method):
        return cfg
    try:
        floor = json.loads(path_for(pair, cfg).read_text())["floor"]
    except (OSError, ValueError, KeyError, TypeError):
        return cfg
    if not isinstance(floor, int) or isinstance(floor, bool) or not 1 <= floor <= reference(cfg):
        return cfg  # a damaged record: the constant floor is the safe one
    return dataclasses.replace(cfg, gamma_min=min(floor, cfg.gamma_max))


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
    engine: Any,
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
    from mtad_edge.bench.paired import interval, ppl_ratio, resampled
    from mtad_edge.bench.quality import pooled_ppl
    from mtad_edge.bench.run import BenchConfig, run_bench
    from mtad_edge.bench.variants import make

    check_tunable(cfg)
    ref = reference(cfg)
    base = dataclasses.replace(cfg, gamma=ref, gamma_min=None, seed=cfg.seed or 0)
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


def save(pair: Pair, cfg: DecodeConfig, record: dict[str, Any]) -> Path:
    """Write the record where ``floor_for`` finds it (atomically); returns the path."""
    path = path_for(pair, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**record, "target": str(pair.target), "aux": str(pair.aux)}, indent=1))
    os.replace(tmp, path)
    return path
