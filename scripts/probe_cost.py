"""What the adaptive controller's probes cost beside plain decoding: ar, auto, auto whose aux
controller never probes, and auto whose prompt-lookup controllers never probe, on the 6 default
bench prompts, interleaved prompt by prompt (the order rotating each repeat), each auto variant on
an engine of its own (what one learns does not steer another; ar runs on plain auto's), speed as
tokens over decoding seconds per repeat, against ar in the same repeat.

    .venv/bin/python scripts/probe_cost.py [--pair smollm2-135m] [--temperature 0.7] [--repeats 5]

A probe is switched off by planning it against a budget it can never earn (the controller's
PROBE_BUDGET below zero, for that controller's plans only). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import mtad_edge.runtime.drafting.controller as C
from mtad_edge.bench.run import load_prompts, render
from mtad_edge.engine import Engine

VARIANTS = ("ar", "auto", "no aux probes", "no lookup probes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None)
    ap.add_argument("--temperature", type=float, default=None, help="default: the model's")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    now = {"variant": "auto"}
    plan = C.Controller.plan

    def planned(self: C.Controller, max_gamma: int, lag: int = 0) -> C.Plan:
        v, budget = now["variant"], C.PROBE_BUDGET
        if (v == "no aux probes" and not self.free) or (v == "no lookup probes" and self.free):
            C.PROBE_BUDGET = -1.0
        try:
            return plan(self, max_gamma, lag)
        finally:
            C.PROBE_BUDGET = budget

    C.Controller.plan = planned  # type: ignore[method-assign]
    engines = {v: Engine.load(args.pair) for v in VARIANTS[1:]}
    engines["ar"] = engines["auto"]
    options: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        options["temperature"] = args.temperature
    items = load_prompts()
    texts = [render(engines["ar"], it) for it in items]
    speeds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        totals = {v: [0, 0.0] for v in VARIANTS}
        for i, text in enumerate(texts):
            for v in VARIANTS[rep % 4 :] + VARIANTS[: rep % 4]:
                now["variant"] = v
                method = "ar" if v == "ar" else "auto"
                r = engines[v].generate(text, learned_costs=True, method=method, seed=1000 * rep + i, **options)
                r.text()
                totals[v][0] += r.stats.generated
                totals[v][1] += r.stats.decode_s
        for v in VARIANTS:
            speeds[v].append(totals[v][0] / totals[v][1])
        print(f"repeat {rep + 1}: " + ", ".join(f"{v} {speeds[v][-1]:.1f} tok/s" for v in VARIANTS), flush=True)
    for v in VARIANTS[1:]:
        ratios = [a / b for a, b in zip(speeds[v], speeds["ar"])]
        shown = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"{v}: x ar per repeat {shown}; median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
