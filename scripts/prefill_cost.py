"""What a seed costs: a seeded request is prefilled as in a fresh context (the whole prompt),
an unseeded one only prefills what the cache does not hold yet. For chat conversations of growing
length, the prefill time of the next turn, seeded vs not (median of --repeats runs).

    .venv/bin/python scripts/prefill_cost.py [--pair smollm2-135m] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

from mtad_edge.engine import Engine

TURN = "Tell me one more thing about rivers, in a sentence."
ANSWER = "Rivers carry water from high ground to the sea, shaping valleys as they go. " * 2


def conversation(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": TURN}, {"role": "assistant", "content": ANSWER}]
    return msgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| conversation tokens | new tokens | unseeded prefill ms | seeded prefill ms | seeded extra ms |")
    print("|---|---|---|---|---|")
    with Engine.load(pair=args.pair, threads=args.threads, n_ctx=2048) as eng:
        for turns in (1, 4, 8, 14):
            history = conversation(turns)
            msgs = [*history, {"role": "user", "content": TURN}]
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeats):
                for seeded in (False, True):
                    eng.chat(history, max_tokens=1, method="ar").text()  # the cache holds the conversation so far
                    r = eng.chat(msgs, max_tokens=1, seed=1 if seeded else None, method="ar")
                    r.text()
                    times[seeded].append(r.stats.prefill_s * 1000)
                    if not seeded:
                        new = r.stats.prompt_tokens - r.stats.cached_tokens
            un, se = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {r.stats.prompt_tokens} | {new} | {un:.1f} | {se:.1f} | {se - un:.1f} |", flush=True)


if __name__ == "__main__":
    main()
