"""What the chat page's stream field costs a request: the same seeded, streamed requests to one
`mtad-edge serve`, with and without ``"mtad_blocks": true``, interleaved (ABAB...) so that drift
in the machine's speed falls on both alike.

    .venv/bin/python scripts/page_cost.py [--requests 40] [--methods ar,mtad] [--max-tokens 64] [--modes off,on]
        [--exe .venv/bin/mtad-edge]

A person runs this on an idle machine (it takes minutes; it is not a CI test). It prints, per
method and mode, the median and quartiles of each request's wall time as the client sees it and
of the server's decode tok/s (``mtad_stats``), then each method's on/off ratio of the medians.
``--modes off`` with ``--exe`` of another checkout's console script measures a build that has no
such field (the cost of the stream's last chunk carrying ``mtad_stats``, say).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Explain in a few sentences how a river shapes its valley."


def start(exe: str, threads: int) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [exe, "serve", "--port", "0", "--threads", str(threads), "--ctx-size", "1024"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    while line := proc.stderr.readline():
        if found := re.search(r"on http://127\.0\.0\.1:(\d+)/v1 ", line):
            port = int(found.group(1))
            break
    else:
        sys.exit(f"the server did not start: {proc.stderr.read()}")
    deadline = time.time() + 60
    while True:  # the line comes as it starts listening
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            conn.getresponse().read()
            return proc, port
        except OSError:
            if time.time() > deadline:
                sys.exit("the server did not answer")
            time.sleep(0.2)


def one(port: int, method: str, blocks: bool, seed: int, max_tokens: int) -> tuple[float, float]:
    """One streamed chat request read to its end: (seconds as the client saw it, server tok/s)."""
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "method": method,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    if blocks:
        body["mtad_blocks"] = True
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    seconds = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        sys.exit(f"HTTP {resp.status}: {raw[:300]}")
    events = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    stats = next((e["mtad_stats"] for e in reversed(events) if "mtad_stats" in e), {})
    return seconds, stats.get("tokens_per_s") or float("nan")


def spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[1]:.4g} [{q[0]:.4g}, {q[2]:.4g}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="per method and mode")
    ap.add_argument("--methods", default="ar,mtad")
    ap.add_argument("--modes", default="off,on", help="off: a plain client; on: with mtad_blocks")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    default_exe = shutil.which("mtad-edge", path=str(Path(sys.executable).parent)) or "mtad-edge"
    ap.add_argument("--exe", default=default_exe, help="the mtad-edge console script to serve with")
    args = ap.parse_args()
    modes = args.modes.split(",")
    proc, port = start(args.exe, args.threads)
    try:
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for method in args.methods.split(","):
            one(port, method, False, 0, args.max_tokens)  # warm-up: caches, the controller's first costs
            for i in range(args.requests):
                for mode in modes if i % 2 == 0 else modes[::-1]:
                    results.setdefault((method, mode), []).append(one(port, method, mode == "on", i, args.max_tokens))
        print("method mode  request s (median [quartiles])   tok/s (median [quartiles])")
        for (method, mode), rows in results.items():
            print(f"{method:6} {mode:4}  {spread([r[0] for r in rows]):32} {spread([r[1] for r in rows])}")
        for method in args.methods.split(","):
            if {"on", "off"} <= set(modes):
                on, off = (statistics.median(r[0] for r in results[(method, m)]) for m in ("on", "off"))
                print(f"{method}: on/off median request time {on / off:.3f}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
