"""Writing a benchmark out: results.json, report.md, bench.png (and sweep.png for --sweep)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional


def _fmt(v, spec=".2f", none="–"):
    return none if v is None else format(v, spec)


def write_json(out: Path, results: dict) -> Path:
    path = out / "results.json"
    tmp = path.with_name(".results.json.partial")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def report_markdown(results: dict) -> str:
    methods, rat = results["methods"], results.get("ratios", {})
    cfg = results["config"]
    lines = [
        f"# mtad-edge bench: {results['pair']['name']}",
        "",
        f"{cfg['prompts']} prompts x {cfg['repeats']} repeats, max {cfg['max_tokens']} tokens, "
        f"temperature {cfg['temperature']}, "
        f"top-k {cfg['top_k']}, top-p {cfg['top_p']}, gamma {cfg['gamma']}, beam width {cfg['beam_width']}, "
        f"threshold {cfg['accept_threshold']}, {cfg['threads']} threads.",
        "",
        "| method | tok/s (min-max) | x ar | x sd | TTFT s | block eff. | acceptance | PPL | PPL x ar "
        "| CPU s/tok | J/tok | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, a in methods.items():
        va, vs = rat.get("vs_ar", {}).get(m, {}), rat.get("vs_sd", {}).get(m, {})
        lines.append(
            f"| {m} | {_fmt(a['tokens_per_s'], '.1f')} "
            f"({_fmt(a['tokens_per_s_min'], '.1f')}-{_fmt(a['tokens_per_s_max'], '.1f')}) "
            f"| {_fmt(va.get('tokens_per_s'))} | {_fmt(vs.get('tokens_per_s'))} | {_fmt(a['ttft_s'], '.3f')} "
            f"| {_fmt(a['block_efficiency'])} | {_fmt(a['acceptance_rate'], '.1%')} | {_fmt(a['ppl'], '.2f')} "
            f"| {_fmt(va.get('ppl'))} | {_fmt(a['cpu_s_per_token'], '.4f')} "
            f"| {_fmt(a['j_per_token'], '.3f', 'n/a (no GPU)')} "
            f"| {_fmt(a['peak_rss_mb'], '.0f')} |"
        )
    native = results.get("native")
    if native:
        lines += [
            "",
            "Native llama.cpp on the same files and threads:",
            "",
            "| tool | setting | tok/s | acceptance |",
            "|---|---|---|---|",
        ]
        for key, n in native.items():
            lines.append(
                f"| {n['tool']} | {key} | {_fmt(n['tokens_per_s'], '.1f')} | {_fmt(n.get('acceptance_rate'), '.1%')} |"
            )
    if results.get("sweep"):
        lines += [
            "",
            "MTAD sweep (one parameter at a time around the defaults):",
            "",
            "| threshold | gamma | beam width | tok/s | block eff. | acceptance | PPL |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in results["sweep"]:
            lines.append(
                f"| {s['accept_threshold']} | {s['gamma']} | {s['beam_width']} | {_fmt(s['tokens_per_s'], '.1f')} "
                f"| {_fmt(s['block_efficiency'])} | {_fmt(s['acceptance_rate'], '.1%')} | {_fmt(s['ppl'])} |"
            )
    lines += [
        "",
        "tok/s: generated tokens per second of decoding (prompt prefill excluded), median over repeats. "
        "Block efficiency: generated tokens / target calls. PPL: exp(-mean log p_target(token | prefix)) "
        "under the target's raw logits, scored the same way for every method.",
        "",
    ]
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def plot_bench(out: Path, results: dict) -> Optional[Path]:
    """tokens/s and block efficiency per method, acceptance-length histogram, PPL per method."""
    plt = _pyplot()
    if plt is None:
        return None
    methods = results["methods"]
    names = list(methods)
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    speed = [methods[m]["tokens_per_s"] for m in names]
    err = [
        [s - methods[m]["tokens_per_s_min"] for m, s in zip(names, speed)],
        [methods[m]["tokens_per_s_max"] - s for m, s in zip(names, speed)],
    ]
    ax[0, 0].bar(names, speed, yerr=err, color="tab:blue", capsize=4)
    for key, n in (results.get("native") or {}).items():
        ax[0, 0].axhline(n["tokens_per_s"], ls="--", lw=1, color="gray")
        ax[0, 0].annotate(f"native {key}", (len(names) - 0.5, n["tokens_per_s"]), fontsize=7, ha="right", va="bottom")
    ax[0, 0].set(title="tokens / s (decode)", ylabel="tok/s")
    ax[0, 1].bar(names, [methods[m]["block_efficiency"] or 0 for m in names], color="tab:green")
    ax[0, 1].set(title="block efficiency (tokens / target call)")
    width = 0.8 / max(1, len(names))
    for i, m in enumerate(names):
        hist = methods[m]["accept_length_hist"]
        if hist:
            ks = [int(k) for k in hist]
            total = sum(hist.values())
            shift = (i - (len(names) - 1) / 2) * width
            ax[1, 0].bar([k + shift for k in ks], [v / total for v in hist.values()], width=width, label=m)
    ax[1, 0].set(title="accepted draft tokens per target call", xlabel="k", ylabel="share of calls")
    if any(methods[m]["accept_length_hist"] for m in names):
        ax[1, 0].legend()
    else:
        ax[1, 0].text(0.5, 0.5, "no drafting method ran", ha="center", transform=ax[1, 0].transAxes)
    ax[1, 1].bar(names, [methods[m]["ppl"] or 0 for m in names], color="tab:orange")
    ax[1, 1].set(title="PPL of the output under the target", ylabel="perplexity")
    fig.suptitle(f"mtad-edge bench: {results['pair']['name']}")
    fig.tight_layout()
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(out: Path, sweep: list[dict]) -> Optional[Path]:
    """Speed vs PPL for each MTAD setting, with the Pareto frontier (faster and lower PPL)."""
    plt = _pyplot()
    if plt is None or not sweep:
        return None
    fig, ax = plt.subplots(figsize=(8, 6))
    pts = [(s["tokens_per_s"], s["ppl"], s) for s in sweep if s["ppl"] is not None]
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    for x, y, s in pts:
        ax.annotate(f"t{s['accept_threshold']} g{s['gamma']} w{s['beam_width']}", (x, y), fontsize=7)
    frontier, best = [], float("inf")
    for x, y, _ in sorted(pts, key=lambda p: -p[0]):
        if y < best:
            frontier.append((x, y))
            best = y
    ax.plot([p[0] for p in frontier], [p[1] for p in frontier], "r--", label="frontier")
    ax.set(xlabel="tokens / s", ylabel="PPL (lower is better)", title="MTAD: speed vs PPL")
    ax.legend()
    path = out / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
