"""llama.cpp's own tools on the same GGUF files, for the native peer column.

Build them from the llama.cpp vendored in the llama-cpp-python sdist (see the README); this
module only runs them and parses their output.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any, Optional

from mtad_edge.runtime.backends.llama_cpp_backend import uses_amx
from mtad_edge.runtime.errors import MtadEdgeError


def _tool(bin_dir: Path, name: str) -> Path:
    exe = Path(bin_dir) / name
    if not exe.is_file():
        raise MtadEdgeError(f"--llama-cpp-bin {bin_dir}: no {name} there (build it as the README shows)")
    return exe


def flash_attn_flags(on: Optional[bool]) -> list[str]:
    """The tools' -fa for the setting our target's context runs with (None: llama.cpp's auto)."""
    return [] if on is None else ["-fa", "on" if on else "off"]


def llama_bench(
    bin_dir: Path,
    model: Path,
    n_tokens: int,
    threads: int,
    depth: int = 0,
    flash_attn: Optional[bool] = None,
    amx: bool = False,
) -> dict:
    """Token generation speed (tg) of ``model`` alone: llama-bench -p 0 -n N, after ``depth``
    cached tokens (-d; our tok/s is measured after the prompt, and each cached token makes a
    step dearer) and after none, for the record; flash attention and AMX (``amx``: our target's
    weights multiplied there) as ours runs."""
    exe = _tool(bin_dir, "llama-bench")
    depths = sorted({0, max(0, int(depth))})
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(n_tokens), "-r", "3", "-o", "json"]
    cmd += ["-d", ",".join(map(str, depths)), *flash_attn_flags(flash_attn)]
    # as mtad-edge loads models there (llama_cpp_backend.AMX_FLAG); llama-bench's one-row calls take
    # AMX's VNNI path, which runs even in builds whose multi-row AMX calls crash (runtime/amx.py)
    cmd += ["--repack", "0"] if uses_amx() and not amx else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise MtadEdgeError(f"llama-bench failed: {proc.stderr.strip().splitlines()[-1:]}")
    try:
        entries = {int(e.get("n_depth", 0)): e for e in json.loads(proc.stdout)}
        at, bare = entries.get(depths[-1]) or entries[min(entries)], entries.get(0) or entries[min(entries)]
        speed, spread, speed_0 = float(at["avg_ts"]), at.get("stddev_ts"), float(bare["avg_ts"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MtadEdgeError(f"llama-bench printed no result we can read ({type(e).__name__})") from None
    return {
        "tool": "llama-bench",
        "tokens_per_s": speed,
        "tokens_per_s_stdev": spread,
        "depth": depths[-1],
        "tokens_per_s_depth_0": speed_0,
        "n_gen": n_tokens,
        "flash_attn": flash_attn,
        "amx": amx,
        "command": " ".join(cmd),
    }


def pooled(runs: list[dict]) -> dict:
    """One llama-bench figure from its runs before our first repeat and after each: the mean, the
    runs kept (the machine's speed drifts over minutes, so each repeat of ours has its own peers)."""
    mean = {k: statistics.fmean(r[k] for r in runs) for k in ("tokens_per_s", "tokens_per_s_depth_0")}
    return {**runs[-1], **mean, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def against_tg(speeds: list[float], tg_runs: list[float]) -> Optional[float]:
    """Our tok/s as a share of llama-bench's tg: the median over our repeats of each repeat's speed
    against the mean of the llama-bench runs on either side of it (``tg_runs``: one before the
    first repeat, one after each). None where the runs do not bracket every repeat."""
    if not speeds or len(tg_runs) != len(speeds) + 1:
        return None
    return statistics.median(s / ((a + b) / 2) for s, a, b in zip(speeds, tg_runs, tg_runs[1:]))


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")


def speculative_simple(
    bin_dir: Path,
    target: Path,
    aux: Path,
    prompt: str,
    n_tokens: int,
    threads: int,
    gamma: int,
    n_ctx: int = 4096,
    flash_attn: Optional[bool] = None,
) -> dict[str, Any]:
    """Greedy draft-model speculative decoding with llama.cpp's example, same draft length and
    flash attention."""
    exe = _tool(bin_dir, "llama-speculative-simple")
    cmd = [str(exe), "-m", str(target), "-md", str(aux), "--spec-type", "draft-simple", "-p", prompt]
    cmd += ["-n", str(n_tokens), "-t", str(threads), "--temp", "0", "--spec-draft-n-max", str(gamma), "-c", str(n_ctx)]
    cmd += flash_attn_flags(flash_attn)
    # as mtad-edge loads models there, less the repacked Q4_0 / Q4_K kernels it names tensor by
    # tensor (runtime/repack.py): llama.cpp's tools cannot ask for those without AMX's
    cmd += ["--no-repack"] if uses_amx() else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log = proc.stderr
    m = _DECODED.search(log)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    if proc.returncode != 0 or not m:
        raise MtadEdgeError(f"llama-speculative-simple failed (exit {proc.returncode})")
    n_drafted, n_acc = int(drafted.group(1)) if drafted else 0, int(accepted.group(1)) if accepted else 0
    return {
        "tool": "llama-speculative-simple",
        "generated": int(m.group(1)),
        "decode_s": float(m.group(2)),
        "tokens_per_s": float(m.group(3)),
        "drafted": n_drafted,
        "accepted": n_acc,
        "acceptance_rate": n_acc / n_drafted if n_drafted else None,
    }
