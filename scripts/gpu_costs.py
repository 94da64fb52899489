"""What one call costs on the device a llama.cpp build offloads to, at real model shapes.

``measure``: for a target GGUF, the wall time of one call adding 1..9 rows after a prompt, of
MMTAD's tree batches (width 4, gamma 4) and, for an aux GGUF, of 1..4 beams; then our plain
decoding's tok/s (T=0 and T=1) against llama.cpp's own llama-bench on the same file, with NVML
joules per token. ``project``: from such costs and a `mtad-edge bench` results.json (its
acceptance, draft lengths and widths per step, measured elsewhere), the tok/s each method would
reach with those costs: a projection, labelled as one; ``table``: that for every target and aux
shape measured (the ratio table of docs/gpu.md). Run by scripts/gpu-check.sh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mtad_edge.bench.energy import EnergyMeter
from mtad_edge.bench.native import llama_bench
from mtad_edge.calibrate import timed_rows
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppConfig
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.rules.tree import TokenTree, TreeVerifier

TARGET_ROWS = range(1, 10)
AUX_BEAMS = range(1, 5)
WIDTH, GAMMA = 4, 4
PREFIX = 128  # tokens in the cache when a call is timed (llama-bench -d the same)
GENERATE = 128  # tokens of plain decoding timed
TEXT = "The quick brown fox jumps over the lazy dog while the river runs quietly past the old mill. " * 20


def _prefix(model: LlamaCppBackend) -> list[int]:
    ids = model.tokenize(TEXT)[:PREFIX]
    model.clear()
    model.decode(Batch.run(ids, 0, logits="none"))
    return ids


def _median_s(call: Callable[[], float], reps: int) -> float:
    """The median of ``reps`` seconds ``call`` returns, after one warm-up (graphs and kernels for the shape)."""
    call()
    return statistics.median(call() for _ in range(reps))


def _timed(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def row_costs(model: LlamaCppBackend, rows: range, beams: bool, reps: int) -> dict[str, dict[int, float]]:
    """Median ms of one call adding ``rows`` rows (one sequence, or that many beams of one token),
    the call alone and with the logits filtered as decoding does (numpy, on the host)."""
    ids = _prefix(model)
    out: dict[str, dict[int, float]] = {"call_ms": {}, "call_and_filter_ms": {}}
    for r in rows:
        for key, filtered in (("call_ms", False), ("call_and_filter_ms", True)):
            out[key][r] = 1000 * _median_s(lambda r=r, f=filtered: timed_rows(model, ids, r, beams, f), reps)
    return out


def drafting_costs(model: LlamaCppBackend, reps: int) -> dict[str, float]:
    """Median ms of the aux's calls in the order MTAD drafts: one row, then WIDTH beams for each
    further depth, so the shape changes twice a step (CUDA graphs warm up on two calls of one
    shape), unlike ``row_costs``' repeated shapes; and "uniform": the first depth as WIDTH rows
    too (one shape throughout)."""
    ids = _prefix(model)
    n = len(ids)
    out: dict[str, float] = {}
    for name, first_rows in (("", 1), ("uniform_", WIDTH)):
        first: list[float] = []
        beams: list[float] = []
        for _ in range(reps + 1):
            for s in range(1, first_rows):
                model.copy_seq(0, s)
            batch = Batch()
            for s in range(first_rows):
                batch.add(ids[-1], n, (s,), True)
            first.append(_timed(lambda b=batch: model.decode(b)))
            for s in range(first_rows, WIDTH + 1):
                model.copy_seq(0, s)
            for depth in range(1, GAMMA):
                batch = Batch()
                for s in range(1, WIDTH + 1):
                    batch.add(ids[(s + depth) % n], n + depth, (s,), True)
                beams.append(_timed(lambda b=batch: model.decode(b)))
            for s in range(1, WIDTH + 1):
                model.rollback(s, 0)
            model.rollback(0, n)
        out[f"{name}first_ms"] = 1000 * statistics.median(first[1:])
        out[f"{name}beams_ms"] = 1000 * statistics.median(beams[GAMMA - 1 :])
    return out


def tree_costs(model: LlamaCppBackend, reps: int) -> dict[str, dict[str, float]]:
    """Median ms of MMTAD's verify pass for trees of WIDTH beams of GAMMA tokens: beams that share
    nothing, share their first token, and share their first two (a pending token first)."""
    ids = _prefix(model)
    rng = np.random.default_rng(0)
    out = {}
    for shared in (0, 1, 2):
        beams = rng.integers(100, 1000, size=(WIDTH, GAMMA))
        beams[:, :shared] = beams[0, :shared]
        tree = TokenTree.from_beams(beams)
        verifier = TreeVerifier(model)
        tokens = ids + [int(ids[-1])]

        def call(verifier: TreeVerifier = verifier, tokens: list[int] = tokens, tree: TokenTree = tree) -> float:
            seconds = _timed(lambda: verifier.logits(tokens, tree))
            for s in range(1, WIDTH + 1):
                model.rollback(s, 0)
            model.rollback(0, len(ids))
            return seconds

        out[f"shared_{shared}"] = {"nodes": len(tree), "rows": len(tree) + 1, "ms": 1000 * _median_s(call, reps)}
    return out


def plain_decoding(model: LlamaCppBackend, temperature: float) -> dict[str, Any]:
    """Our ar after a PREFIX-token prompt: tok/s and NVML joules per token."""
    ids = model.tokenize(TEXT)[:PREFIX]
    cfg = DecodeConfig("ar", GENERATE, sampling=SamplingConfig(temperature=temperature), seed=0)
    list(Generation(model, None, ids, cfg))  # warm-up
    meter = EnergyMeter()
    gen = Generation(model, None, ids, cfg)
    meter.start()
    n = sum(len(block) for block in gen)
    joules = meter.stop()
    return {
        "temperature": temperature,
        "generated": n,
        "tokens_per_s": n / gen.stats.decode_s,  # after the prompt, as llama-bench's tg
        "j_per_token": joules / n if joules is not None and n else None,
    }


def measure(a: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"target": str(a.target), "n_gpu_layers": a.ngl, "threads": a.threads}
    cfg = LlamaCppConfig(n_ctx=1024, n_seq_max=WIDTH + 1, n_threads=a.threads, n_gpu_layers=a.ngl)
    with LlamaCppBackend(a.target, cfg) as t:
        result["flash_attn"] = t.flash_attn
        result["target_rows"] = row_costs(t, TARGET_ROWS, False, a.reps)
        result["trees"] = tree_costs(t, a.reps)
        result["ar"] = [plain_decoding(t, 0.0), plain_decoding(t, 1.0)]
        flash = t.flash_attn
    if a.llama_bench:
        result["llama_bench"] = llama_bench(a.llama_bench, a.target, GENERATE, a.threads, PREFIX, flash)
        ours = result["ar"][0]["tokens_per_s"]
        result["ar_over_llama_bench"] = ours / result["llama_bench"]["tokens_per_s"]
    for i, aux in enumerate(a.aux or ()):  # "aux" holds the first (what project reads), "auxes" every one by name
        for layers in sorted(set(a.aux_ngl)) if i == 0 else [-1]:
            acfg = LlamaCppConfig(n_ctx=1024, n_seq_max=WIDTH + 1, n_threads=a.threads, n_gpu_layers=layers)
            with LlamaCppBackend(aux, acfg) as m:
                found = {"path": str(aux), "beams": row_costs(m, AUX_BEAMS, True, a.reps)}
                found["drafting"] = drafting_costs(m, a.reps)
            if i == 0:
                result.setdefault("aux", {})[str(layers)] = found
            result.setdefault("auxes", {}).setdefault(aux.stem, {})[str(layers)] = found
    return result


def _hist(d: Any) -> dict[int, int]:
    return {int(k): int(v) for k, v in (d or {}).items()}


def project(costs: dict[str, Any], bench: dict[str, Any], aux_layers: str) -> dict[str, Any]:
    """Seconds per generated token for each method of ``bench``: its steps (draft lengths, widths
    and accepted lengths as measured there) priced at ``costs``' target rows / tree rows and aux
    beams, plus the host's own time per token measured there (sampling, rules, the loop)."""
    rows = {int(k): v for k, v in costs["target_rows"]["call_and_filter_ms"].items()}
    beams = {int(k): v for k, v in costs["aux"][aux_layers]["beams"]["call_and_filter_ms"].items()}
    tree_ms = {t["rows"]: t["ms"] for t in costs["trees"].values()}

    def target_ms(n: int) -> float:
        if n in rows:
            return rows[n]
        if n in tree_ms:
            return tree_ms[n]
        known = sorted({**rows, **tree_ms}.items())
        return float(np.interp(n, [k for k, _ in known], [v for _, v in known]))

    out = {}
    for label, m in bench["methods"].items():
        gen, steps = m["generated"], sum(_hist(m.get("gamma_hist")).values()) or m["target_calls"]
        gammas, widths = _hist(m.get("gamma_hist")), _hist(m.get("width_hist"))
        mean_width = sum(w * c for w, c in widths.items()) / sum(widths.values()) if widths else 1
        if m["method"] == "ar" or not gammas:
            target = m["target_calls"] * target_ms(1)
            aux = 0.0
        else:
            target = aux = 0.0
            for g, count in gammas.items():
                if m["method"] == "mmtad":
                    rows_ = 1 + min(g * round(mean_width), max(tree_ms) - 1) if g else 1
                else:
                    rows_ = g + 1
                target += count * target_ms(rows_)
                w = max(1, round(mean_width)) if m["method"] in ("mtad", "mmtad") else 1
                aux += count * g * beams.get(min(w, max(beams)), beams[max(beams)])
        rest_ms = (m["time_ms_per_token"] or {}).get("rest_ms") or 0.0
        ms = (target + aux) / gen + rest_ms
        out[label] = {"ms_per_token": ms, "tokens_per_s": 1000 / ms, "steps": steps}
    base = out.get("ar", {}).get("tokens_per_s")
    for row in out.values():
        row["x_ar"] = row["tokens_per_s"] / base if base else None
    return out


def table(paths: list[Path], bench: dict[str, Any], methods: tuple[str, ...] = ("sd", "mtad", "mmtad")) -> str:
    """For every target (a costs file) and every aux measured beside it on the GPU: each method's
    projected tok/s over ar's, ``bench``'s steps priced at that pair's costs (a projection: the
    acceptance is the bench's, not that pair's own)."""
    lines = [
        "| target | aux | aux step / target step | ar tok/s | " + " | ".join(f"{m} x ar" for m in methods) + " |",
        "|---|---|---|---|" + "---|" * len(methods),
    ]
    for path in paths:
        c = json.loads(path.read_text())
        one = float(c["target_rows"]["call_ms"]["1"])
        for name, placed in (c.get("auxes") or {}).items():
            aux = placed.get("-1") or next(iter(placed.values()))  # on the GPU where it was measured there
            proj = project({**c, "aux": {"-1": aux}}, bench, "-1")
            ratio = float(aux["beams"]["call_ms"]["1"]) / one
            cells = " | ".join(f"{proj[m]['x_ar']:.2f}" if m in proj else "–" for m in methods)
            ar = proj["ar"]["tokens_per_s"]
            lines.append(f"| {Path(c['target']).stem} | {name} | {ratio:.2f} | {ar:.1f} | {cells} |")
    return "\n".join(lines)


def summary(paths: list[Path]) -> None:
    """One short table per costs file (the device run's last lines)."""
    for path in paths:
        if not path.is_file():
            print(f"{path.name}: missing")
            continue
        c = json.loads(path.read_text())
        rows = c["target_rows"]["call_ms"]
        print(f"{path.name}: target ms by rows " + " ".join(f"{k}:{float(v):.2f}" for k, v in rows.items()))
        print("  trees " + " ".join(f"{t['rows']} rows:{t['ms']:.2f}" for t in c["trees"].values()))
        for layers, aux in (c.get("aux") or {}).items():
            beams = aux["beams"]["call_ms"]
            print(f"  aux ngl {layers} ms by beams " + " ".join(f"{k}:{float(v):.2f}" for k, v in beams.items()))
            if "drafting" in aux:  # the same calls in drafting's order (shapes changing call to call)
                d = aux["drafting"]
                print(
                    f"    as drafted: one row {d['first_ms']:.2f}, {WIDTH} beams {d['beams_ms']:.2f}; uniform: "
                    f"{d['uniform_first_ms']:.2f}, {d['uniform_beams_ms']:.2f}"
                )
        for ar in c["ar"]:
            j = ar["j_per_token"]
            energy = f"{j:.3f} J/token" if j else "no NVML"
            print(f"  ar T={ar['temperature']}: {ar['tokens_per_s']:.1f} tok/s, {energy}")
        if "llama_bench" in c:
            native, ratio = c["llama_bench"]["tokens_per_s"], c["ar_over_llama_bench"]
            print(f"  llama-bench {native:.1f} tok/s; ar T=0 / llama-bench {ratio:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("target", type=Path)
    m.add_argument("--aux", type=Path, nargs="*", help="aux GGUFs: the first on every --aux-ngl, the others on the GPU")
    m.add_argument("--ngl", type=int, default=-1)
    m.add_argument("--aux-ngl", type=int, nargs="+", default=[-1])
    m.add_argument("--threads", type=int, default=8)
    m.add_argument("--reps", type=int, default=9)
    m.add_argument("--llama-bench", type=Path, help="folder holding llama-bench")
    m.add_argument("--out", type=Path, required=True)
    j = sub.add_parser("project")
    j.add_argument("costs", type=Path)
    j.add_argument("bench", type=Path, help="a `mtad-edge bench` results.json")
    j.add_argument("--aux-layers", default="-1")
    sub.add_parser("summary").add_argument("costs", type=Path, nargs="+")
    t = sub.add_parser("table", help="projected speed-up of each target/aux shape pair")
    t.add_argument("costs", type=Path, nargs="+")
    t.add_argument("--bench", type=Path, required=True, help="a `mtad-edge bench` results.json: its steps")
    a = p.parse_args()
    if a.command == "summary":
        summary(a.costs)
    elif a.command == "table":
        print(table(a.costs, json.loads(a.bench.read_text())))
    elif a.command == "measure":
        result = measure(a)
        a.out.write_text(json.dumps(result, indent=1))
        summary([a.out])
    else:
        proj = project(json.loads(a.costs.read_text()), json.loads(a.bench.read_text()), a.aux_layers)
        print(json.dumps(proj, indent=1))


if __name__ == "__main__":
    main()
