"""Soak `mtad-edge serve`: many requests, streaming and not alternating, some abandoned by their
client mid-way; the server's RSS and open file descriptors are sampled as it goes.

    .venv/bin/python scripts/soak.py [--requests 1000] [--abandon 20] [--every 100] [--threads 2]

A person runs this (it takes minutes; it is not a CI test). It starts its own server on a free
loopback port, prints one line per sample and a summary, and exits non-zero when memory or fds
grew by 2 % or more after warm-up, or when any request failed other than the abandoned ones.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["Name three fruits.", "Say a word about the sea.", "Count to five.", "What is a river?", "Name a color."]
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    """Open descriptors once the last client connection has closed: the least of a few looks,
    so a socket the server has not reaped yet is not counted as growth."""
    counts = []
    for _ in range(10):
        counts.append(len(os.listdir(f"/proc/{pid}/fd")))
        time.sleep(0.05)
    return min(counts)


def request(port: int, path: str, body: dict, timeout: float = 300) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def one(port: int, i: int) -> str | None:
    """Request i, complete: None if it went as it should, else what went wrong."""
    stream = i % 2 == 0
    if i % 4 < 2:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
    else:
        path, body = "/v1/completions", {"prompt": PROMPTS[i % len(PROMPTS)]}
    body.update(max_tokens=16, stream=stream, seed=i if i % 3 else None)
    status, raw = request(port, path, body)
    if status != 200:
        return f"request {i}: HTTP {status} {raw[:200]!r}"
    if stream:
        text = raw.decode()
        if not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
            return f"request {i}: stream did not end well: {text[-200:]!r}"
    elif "choices" not in json.loads(raw):
        return f"request {i}: no choices: {raw[:200]!r}"
    return None


def abandon(port: int, stream: bool) -> None:
    """A request given up mid-way: a stream closed after its first events, or a non-streaming
    request whose client times out while the answer is being generated."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300 if stream else 0.5)
    body = {"prompt": STORY, "max_tokens": 1_000_000_000, "temperature": 0, "stream": stream}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    try:
        resp = conn.getresponse()
        if stream:
            for _ in range(3):
                resp.fp.readline()
    except TimeoutError:
        pass
    conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--abandon", type=int, default=20, help="how many of the requests are abandoned mid-way")
    ap.add_argument("--every", type=int, default=100, help="sample RSS and fds every N requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair", default="smollm2-135m")
    args = ap.parse_args()

    exe = shutil.which("mtad-edge", path=str(Path(sys.executable).parent)) or shutil.which("mtad-edge")
    port = free_port()
    cmd = [exe, "serve", "--pair", args.pair, "--port", str(port), "--threads", str(args.threads), "--queue-size", "2"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                print("the server did not start:", server.stderr.read(), file=sys.stderr)
                return 2
            time.sleep(0.2)

    step = max(1, args.requests // max(1, args.abandon))
    abandoned = {i: k % 2 == 0 for k, i in enumerate(range(step // 2, args.requests, step))}  # i -> stream
    errors: list[str] = []
    samples: list[tuple[int, int, int, float]] = []
    t0 = time.time()
    slowest = 0.0

    def sample(n: int) -> None:
        nonlocal slowest
        samples.append((n, rss_kb(server.pid), fds(server.pid), time.time() - t0))
        n, rss, fd, t = samples[-1]
        print(
            f"{n:6d} requests  RSS {rss / 1024:8.1f} MiB  fds {fd:4d}  errors {len(errors)}  {t:7.1f} s"
            f"  (slowest request {slowest:.1f} s)",
            flush=True,
        )
        slowest = 0.0

    sample(0)
    for i in range(args.requests):
        started = time.time()
        if i in abandoned:
            abandon(port, abandoned[i])
        else:
            problem = one(port, i)
            if problem:
                errors.append(problem)
                print(problem, file=sys.stderr)
        slowest = max(slowest, time.time() - started)
        if (i + 1) % args.every == 0:
            sample(i + 1)

    t_stop = time.time()
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        code = "still running 60 s after SIGTERM (killed)"
    stop_s = time.time() - t_stop

    base = samples[1] if len(samples) > 2 else samples[0]  # after warm-up: the allocator has settled
    last = samples[-1]
    rss_growth = (last[1] - base[1]) / base[1] * 100
    fd_growth = (last[2] - base[2]) / base[2] * 100
    summary = {
        "requests": args.requests,
        "abandoned": len(abandoned),
        "errors": len(errors),
        "rss_mib": {"start": samples[0][1] / 1024, "after_warmup": base[1] / 1024, "end": last[1] / 1024},
        "rss_growth_pct_after_warmup": round(rss_growth, 2),
        "fds": {"start": samples[0][2], "after_warmup": base[2], "end": last[2]},
        "fd_growth_pct_after_warmup": round(fd_growth, 2),
        "wall_s": round(t_stop - t0, 1),
        "server_exit": code,
        "server_stop_s": round(stop_s, 2),
    }
    print(json.dumps(summary, indent=2))
    return 0 if not errors and rss_growth < 2 and fd_growth < 2 else 1


if __name__ == "__main__":
    sys.exit(main())
