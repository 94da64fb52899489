"""The benchmark loop: every method on every prompt, repeated, measured the same way."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from mtad_edge.bench.energy import EnergyMeter
from mtad_edge.engine import Engine
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import MtadEdgeError


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...] = ("ar", "sd", "mtad")
    repeats: int = 1
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # method is set per run

    def for_method(self, method: str, seed: int, **changes) -> DecodeConfig:
        return dataclasses.replace(self.decode, method=method, seed=seed, **changes)


def load_prompts(path: Optional[str | os.PathLike] = None) -> list[dict]:
    """JSONL: one object per line with ``prompt`` (raw text) or ``messages`` (chat); optional ``id``."""
    if path is None:
        text = resources.files("mtad_edge.data").joinpath("prompts.jsonl").read_text()
        where = "built-in prompts"
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise MtadEdgeError(f"cannot read prompts file {path}: {e.strerror}") from None
        where = str(path)
    items: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise MtadEdgeError(f"{where} line {n}: not JSON ({e.msg})") from None
        if not isinstance(item, dict) or not (
            isinstance(item.get("prompt"), str) or isinstance(item.get("messages"), list)
        ):
            raise MtadEdgeError(f"{where} line {n}: needs a 'prompt' string or a 'messages' list")
        item.setdefault("id", f"p{len(items) + 1}")
        items.append(item)
    if not items:
        raise MtadEdgeError(f"{where}: no prompts")
    return items


def render(engine: Engine, item: dict[str, Any]) -> str:
    """The prompt text of a prompt-file item (chat messages rendered with the pair's template)."""
    return engine.render_chat(item["messages"]) if "messages" in item else item["prompt"]


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 / 1024 if sys.platform == "darwin" else kb / 1024  # bytes on macOS, KiB on Linux


def measure(engine: Engine, item: dict[str, Any], cfg: DecodeConfig, meter: EnergyMeter) -> dict[str, Any]:
    """One request with every per-run figure; PPL is scored afterwards, outside the timing."""
    cpu0 = _cpu_s()
    meter.start()
    response = engine.generate(render(engine, item), **cfg.as_options())
    response.text()
    energy = meter.stop()
    cpu = _cpu_s() - cpu0
    st, tokens = response.stats, response.tokens
    logp = engine.score(response.prompt_ids, tokens)
    n = len(tokens)
    return {
        "method": cfg.method,
        "seed": st.seed,
        "prompt_tokens": response.prompt_tokens,
        "generated": n,
        "wall_s": st.wall_s,
        "decode_s": st.decode_s,
        "prefill_s": st.prefill_s,
        "ttft_s": st.ttft_s,
        "tokens_per_s": st.tokens_per_s,
        "target_calls": st.target_calls,
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": st.acceptance_rate,
        "block_efficiency": st.block_efficiency,
        "draft_s": st.draft_s,
        "verify_s": st.verify_s,
        "other_s": st.other_s,
        "logprob_sum": float(logp.sum()),
        "ppl": math.exp(-float(logp.mean())) if n else None,
        "cpu_s": cpu,
        "cpu_s_per_token": cpu / n if n else None,
        "peak_rss_mb": _peak_rss_mb(),
        "energy_j": energy,
        "j_per_token": energy / n if energy is not None and n else None,
        "accept_lengths": st.accept_lengths,
        "finish_reason": st.finish_reason,
        "tokens": tokens,
    }


def run_bench(
    engine: Engine, prompts: list[dict[str, Any]], cfg: BenchConfig, progress: Callable[[int], None] = lambda n: None
) -> list[dict[str, Any]]:
    """Rows for repeats x prompts x methods. Within a repeat every method gets the same seed."""
    meter = EnergyMeter()
    rows = []
    for rep in range(cfg.repeats):
        for i, item in enumerate(prompts):
            seed = (cfg.decode.seed or 0) + 1000 * rep + i
            for method in cfg.methods:
                row = measure(engine, item, cfg.for_method(method, seed), meter)
                rows.append({"prompt_id": item["id"], "repeat": rep, **row})
                progress(1)
    return rows


def _total(rows, key):
    return sum(r[key] for r in rows)


def aggregate(rows: list[dict]) -> dict:
    """Per method: medians and spread over repeats for speed, totals for rates and PPL."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        reps = sorted({r["repeat"] for r in mine})
        speeds = [
            _total(rr, "generated") / max(_total(rr, "decode_s"), 1e-12)
            for rr in ([r for r in mine if r["repeat"] == k] for k in reps)
        ]
        gen, calls, drafted = _total(mine, "generated"), _total(mine, "target_calls"), _total(mine, "drafted")
        energies = [r["energy_j"] for r in mine]
        hist: dict[str, int] = {}
        for r in mine:
            for k in r["accept_lengths"]:
                hist[str(k)] = hist.get(str(k), 0) + 1
        out[method] = {
            "runs": len(mine),
            "generated": gen,
            "target_calls": calls,
            "tokens_per_s": statistics.median(speeds),
            "tokens_per_s_min": min(speeds),
            "tokens_per_s_max": max(speeds),
            "block_efficiency": gen / calls if calls else None,
            "acceptance_rate": _total(mine, "accepted") / drafted if drafted else None,
            "ppl": math.exp(-_total(mine, "logprob_sum") / gen) if gen else None,
            "cpu_s_per_token": _total(mine, "cpu_s") / gen if gen else None,
            "j_per_token": sum(energies) / gen if gen and all(e is not None for e in energies) else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
            "ttft_s": statistics.median(r["ttft_s"] for r in mine if r["ttft_s"] is not None)
            if any(r["ttft_s"] for r in mine)
            else None,
            "draft_s": _total(mine, "draft_s"),
            "verify_s": _total(mine, "verify_s"),
            "other_s": _total(mine, "other_s"),
            "accept_length_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        }
    return out


RATIO_KEYS = ("tokens_per_s", "ppl", "cpu_s_per_token", "j_per_token", "block_efficiency")


def ratios(methods: dict) -> dict:
    """method / baseline for each figure, against ar and against sd when they ran."""

    def div(a, b):
        return a / b if a is not None and b else None

    return {
        f"vs_{base}": {m: {k: div(agg[k], methods[base][k]) for k in RATIO_KEYS} for m, agg in methods.items()}
        for base in ("ar", "sd")
        if base in methods
    }
