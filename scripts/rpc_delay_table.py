"""The RPC delay table from the runs of scripts/rpc-delay-table.sh: per pair and setting (local,
rpc direct, rpc + relay delay), each method's tok/s and its ratio to ar, and what a generated
token costs on the wire: target calls, round trips (RPC calls waited on) and KB each way.

    python scripts/rpc_delay_table.py OUT [PLOT.png]    # PLOT: each method's tok/s x ar against the delay
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METHODS = ("ar", "sd", "mtad", "mmtad")


def order(name: str) -> tuple[str, float]:
    tag, _, setting = name.partition("-")
    first = {"local": -2.0, "rpc-direct": -1.0}  # then the relays by delay
    return tag, first[setting] if setting in first else float(setting.removeprefix("rpc-"))


def main(out: Path, plot: Path | None = None) -> None:
    runs = sorted((d for d in out.iterdir() if (d / "results.json").is_file()), key=lambda d: order(d.name))
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (pair, method) -> (one-way ms, x ar)
    head = "| pair | setting | achieved one-way ms | " + " | ".join(f"{m} tok/s (x ar)" for m in METHODS)
    head += " | " + " | ".join(f"{m} calls / rt / KB out / KB in per token" for m in METHODS) + " |"
    print(head)
    print("|" + "---|" * (3 + 2 * len(METHODS)))
    for d in runs:
        res = json.loads((d / "results.json").read_text())
        methods, rpc = res["methods"], res.get("rpc") or {}
        tag, _, setting = d.name.partition("-")
        ar = (methods.get("ar") or {}).get("tokens_per_s")
        speeds, wire = [], []
        for m in METHODS:
            a = methods.get(m)
            if a is None:
                speeds.append("–")
                wire.append("–")
                continue
            x = f" ({a['tokens_per_s'] / ar:.2f})" if ar else ""
            if ar:  # at the relay's achieved delay (direct: 0; local: -1, drawn as a line)
                where = -1.0 if setting == "local" else rpc.get("relay_achieved_ms") or 0.0
                points.setdefault((tag, m), []).append((where, a["tokens_per_s"] / ar))
            speeds.append(f"{a['tokens_per_s']:.1f}{x}")
            t, n = a.get("rpc"), max(a["generated"], 1)
            calls = a["target_calls"] / n
            if t:
                kb = f"{t['sent'] / n / 1000:.0f} / {t['received'] / n / 1000:.0f}"
                wire.append(f"{calls:.2f} / {t['round_trips'] / n:.1f} / {kb}")
            else:
                wire.append(f"{calls:.2f}")
        achieved = rpc.get("relay_achieved_ms")
        shown = f"{achieved:.3f}" if achieved is not None else "–"
        print(f"| {tag} | {setting} | {shown} | " + " | ".join(speeds) + " | " + " | ".join(wire) + " |")
    if plot is not None:
        _plot(points, plot)


def _plot(points: dict[tuple[str, str], list[tuple[float, float]]], plot: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = sorted({tag for tag, _ in points})
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 3.4), squeeze=False)
    for ax, tag in zip(axes[0], pairs):
        for i, m in enumerate(METHODS[1:]):
            xy = sorted(points.get((tag, m), []))
            here = [y for x, y in xy if x < 0]
            xy = [(x, y) for x, y in xy if x >= 0]
            if xy:
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", color=f"C{i}", label=f"{m} over RPC")
            if here:
                ax.axhline(here[0], color=f"C{i}", lw=1, ls=":", label=f"{m} on this machine")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set(title=f"{tag}: target over RPC", xlabel="one-way delay, ms (0: direct)", ylabel="tok/s x ar")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot, dpi=90)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "rpc-delay"), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
