"""Answers of a pair at several sampling settings, for choosing its manifest's `defaults`
(docs/quality.md#the-bundled-pairs-sampling-defaults-2026-11-29).

    .venv/bin/python scripts/sampling_defaults.py [--pair smollm2-135m] [--seeds 1,2,3,4] > answers.jsonl

Each answer is one JSON line (settings, prompt, seed, tokens, finish reason, text), then a summary
per setting on stderr: answers that ended by themselves, mean length, loops (over 30 % of the
word 4-grams repeated) and how many answers to "The capital of France is" name Paris. Minutes on
a 2-core CPU; a person reads the answers too (the summary does not judge coherence).
"""

from __future__ import annotations

import argparse
import json
import sys

from mtad_edge import Engine

PROMPTS = ("Hi", "Explain beam search in one paragraph.", "The capital of France is", "Name a planet.",
           "Write a haiku about the sea.")  # fmt: skip
SETTINGS = ((1.0, 10, 0.9), (0.7, 10, 0.9), (0.7, 40, 0.95), (0.5, 40, 0.9), (0.4, 40, 0.9), (0.2, 40, 0.9))
LOOP = 0.3  # the share of repeated word 4-grams above which an answer counts as a loop


def repeated_share(text: str) -> float:
    words = text.split()
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    load = {"threads": args.threads} if args.threads else {}
    with Engine.load(pair=args.pair, **load) as engine:
        for t, k, p in SETTINGS:
            rows = []
            for prompt in PROMPTS:
                for seed in seeds:
                    options = dict(temperature=t, top_k=k, top_p=p, seed=seed, max_tokens=args.max_tokens)
                    r = engine.chat([{"role": "user", "content": prompt}], **options)
                    text = r.text()
                    row = {"T": t, "k": k, "p": p, "prompt": prompt, "seed": seed, "n": len(r.tokens)}
                    rows.append({**row, "finish": r.finish_reason, "text": text})
                    print(json.dumps(rows[-1]), flush=True)
            capital = [r for r in rows if r["prompt"].startswith("The capital")]
            print(
                f"T={t:g} top-k {k} top-p {p:g}: {len(rows)} answers, "
                f"{sum(r['finish'] == 'stop' for r in rows)} ended by themselves, "
                f"{sum(r['n'] for r in rows) / len(rows):.0f} tokens on average, "
                f"{sum(repeated_share(r['text']) > LOOP for r in rows)} loops, "
                f"Paris {sum('Paris' in r['text'] for r in capital)} of {len(capital)}",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
