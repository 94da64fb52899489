"""llama-server on the same GGUF files, prompt tokens, sampling and seeds: the peer column of
`mtad-edge bench --llama-server BIN`, beside llama.cpp's own tools (native.py).

Three settings: plain decoding (the target alone) and draft-model speculation with the pair's aux
at llama-server's defaults and at a tuned draft (``TUNED``). One server runs at a time: a setting's
server starts on a free loopback port for its prompt-run and is killed by pid right after it, so no
idle server sits beside our runs (idle llama-servers spin unless ``--poll 0``; beside our engine
they inflated the costs gamma 'auto' learns from wall time) and each runs at its default polling.
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import re
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional

from mtad_edge.bench.drafting import share
from mtad_edge.bench.native import flash_attn_flags
from mtad_edge.bench.run import valid_json
from mtad_edge.runtime.backends.llama_cpp_backend import uses_amx
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import MtadEdgeError

HOST = "127.0.0.1"
# The tuned draft: longer drafts, cut where the aux's own top probability falls below 0.5
# (REFERENCE: its best setting on this kind of machine; consumer-GPU reports use the same shape).
TUNED = ("--spec-draft-n-max", "8", "--spec-draft-p-min", "0.5")
# Our sampling order: temperature, top-k, top-p (top-k commutes with temperature). llama-server's
# default chain adds penalties, DRY, min-p (0.05) and more, and applies temperature last.
SAMPLERS = ["top_k", "temperature", "top_p"]


@dataclass(frozen=True)
class Setting:
    label: str
    draft: Optional[tuple[str, ...]] = None  # None: the target alone; else flags beside -md AUX


def check_binary(exe: Path) -> dict[str, Any]:
    """Runs ``exe --help`` (no model loads): a one-line error where it is not a llama-server that
    takes the flags the column passes; else its draft defaults, for the labels."""
    if not exe.is_file():
        raise MtadEdgeError(f"--llama-server {exe}: no such file")
    try:
        proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise MtadEdgeError(f"--llama-server {exe}: cannot run it ({e.strerror})") from None
    except subprocess.TimeoutExpired:
        raise MtadEdgeError(f"--llama-server {exe}: '--help' did not finish in 60 s") from None
    text = proc.stdout + proc.stderr
    flags = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
    needed = ["-m", "-md", "--spec-type", *TUNED[::2], "-t", "-td", "-c", "-np", "-fa", "--host", "--port"]
    needed += ["--no-repack"] if uses_amx() else []
    missing = [f for f in needed if f not in flags]
    if missing:
        raise MtadEdgeError(f"--llama-server {exe}: not a llama-server that takes {', '.join(missing)} (its --help)")

    def default(flag: str) -> Optional[str]:
        # an option's entry: its names at column 0, then its help, wrapped on indented lines
        for entry in re.split(r"\n(?=\S)", text):
            names = re.split(r"\s{2,}|\n", entry.strip(), maxsplit=1)[0]
            if flag in re.split(r"[ ,]+", names):
                m = re.search(r"\(default: ([^)]+)\)", " ".join(entry.split()))
                return m.group(1).strip() if m else None
        return None

    return {"n_max": default("--spec-draft-n-max"), "p_min": default("--spec-draft-p-min")}


def settings(defaults: dict[str, Any]) -> tuple[Setting, ...]:
    """Plain decoding, its draft at its defaults (labelled with them where --help says) and the
    tuned draft."""
    n, p = defaults.get("n_max"), defaults.get("p_min")
    own = f"n-max {n} p-min {_short(p)}" if n is not None and p is not None else "its defaults"
    return (
        Setting("llama-server ar"),
        Setting(f"llama-server draft {own}", ()),
        Setting(f"llama-server draft n-max {TUNED[1]} p-min {TUNED[3]}", TUNED),
    )


def _short(value: str) -> str:
    try:
        return f"{float(value):g}"
    except ValueError:
        return value


def free_port() -> int:
    """A port nobody listens on now (the server binds it a moment later; ``Server.start`` tries
    another where it was taken in between)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class _PortTaken(Exception):
    pass


class Server:
    """One llama-server on a loopback port, killed by pid when left (also on errors and Ctrl-C).
    HTTP goes through http.client: urllib would send loopback requests to an http_proxy."""

    def __init__(self, proc: subprocess.Popen, log: IO[bytes], port: int, command: list[str]):
        self.proc, self.log, self.port, self.command = proc, log, port, command

    @classmethod
    def start(cls, cmd: list[str], ready_s: float = 600.0) -> Server:
        for _ in range(3):
            port = free_port()
            command = [*cmd, "--host", HOST, "--port", str(port)]
            log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's log while it lives: stop() closes it)
            try:
                # its own session: a Ctrl-C at the terminal reaches the bench alone, which stops the
                # server by pid (a llama-server interrupted in the middle of a request hangs in its exit)
                proc = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                log.close()
                raise MtadEdgeError(f"cannot run llama-server ({e.strerror})") from None
            server = cls(proc, log, port, command)
            try:
                server._wait_ready(ready_s)
                return server
            except _PortTaken:
                server.stop()
            except BaseException:
                server.stop()
                raise
        raise MtadEdgeError("llama-server found no free loopback port in 3 tries")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _wait_ready(self, ready_s: float) -> None:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                if "couldn't bind" in self._log_tail():
                    raise _PortTaken()
                raise MtadEdgeError(f"llama-server exited while starting ({_status(rc)}): {self.last_line()}")
            try:
                status, _ = self._call("GET", "/health", None, 5)
            except (OSError, http.client.HTTPException):
                status = 0
            if status == 200:
                return
            time.sleep(0.05)  # 503 while the models load; no answer before it listens
        raise MtadEdgeError(f"llama-server was not ready after {ready_s:.0f} s: {self.last_line()}")

    def _call(self, method: str, path: str, body: Optional[dict[str, Any]], timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def get(self, path: str, body: Optional[dict[str, Any]] = None, timeout: float = 1800.0) -> Any:
        """GET (``body`` None) or POST ``path``: its JSON, or a one-line error that says whether the
        server died, refused the request or answered something else."""
        try:
            status, data = self._call("GET" if body is None else "POST", path, body, timeout)
        except (OSError, http.client.HTTPException) as e:
            try:  # a connection dropped as the server died comes before its exit status
                rc: Optional[int] = self.proc.wait(2)
            except subprocess.TimeoutExpired:
                rc = None
            if rc is None:
                raise MtadEdgeError(f"llama-server did not answer {path} ({type(e).__name__}: {e})") from None
            last = self.last_line()
            raise MtadEdgeError(f"llama-server exited ({_status(rc)}) while answering {path}: {last}") from None
        try:
            found = json.loads(data)
        except ValueError:
            found = None
        if status != 200:
            error = found.get("error") if isinstance(found, dict) else None
            said = error.get("message") if isinstance(error, dict) else data[:200].decode("utf-8", "replace")
            raise MtadEdgeError(f"llama-server refused {path} (HTTP {status}): {said}")
        if found is None:
            raise MtadEdgeError(f"llama-server answered {path} with something other than JSON")
        return found

    def _log_tail(self, size: int = 65536) -> str:
        if self.log.closed:
            return ""
        self.log.flush()
        end = self.log.seek(0, 2)
        self.log.seek(max(0, end - size))
        return self.log.read().decode("utf-8", "replace")

    def last_line(self) -> str:
        """What the server's log says went wrong, on one line: the last burst of error lines, by its
        first (the cause: "invalid magic characters", "couldn't bind") and its last (what it did
        then); else its last line. llama.cpp's timestamps and levels are left out."""
        lines = [_LOG_PREFIX.sub("", ln.strip()) for ln in self._log_tail().splitlines() if ln.strip()]
        bad = [k for k, ln in enumerate(lines) if _PROBLEM.search(ln) and "common_fit_params" not in ln]
        if not bad:
            return _cut(lines[-1] if lines else "(no output)")
        first = len(bad) - 1
        while first > 0 and bad[first] - bad[first - 1] <= 2:  # one burst: at most a line between
            first -= 1
        cause, last = lines[bad[first]], lines[bad[-1]]
        return _cut(cause if cause == last else f"{cause} ... {last}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s (or at once on Ctrl-C while waiting)."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


# llama.cpp's log lines: "0.00.008.086 E gguf_init_from_reader: invalid magic characters: ..."
_LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] +")
_PROBLEM = re.compile(r"error|fail|invalid|unknown|cannot|couldn't|not found|GGML_ASSERT", re.I)


def _status(rc: int) -> str:
    return f"exit {rc}" if rc >= 0 else f"killed by signal {-rc}"


def _cut(line: str, most: int = 300) -> str:
    return line if len(line) <= most else line[: most - 3] + "..."


# A run hook for bench.run.run_bench: (prompt index, repeat, seed, position in the run order).
Hook = Callable[[int, int, int, int], None]


def placement_flags(flag: str, layers: Optional[int]) -> list[str]:
    """Our --n-gpu-layers / --aux-gpu-layers as llama-server's -ngl / -ngld (ours -1 is its "all";
    unset: its own default, "auto", which offloads what fits)."""
    if layers is None:
        return []
    return [flag, "all" if layers < 0 else str(layers)]


class Column:
    """The llama-server settings on the bench's prompts (as token ids: ours, so it sees the very
    prompt tokens ours does) with the bench's sampling, each run recorded as a row. A server that
    fails during the bench stops the column, never the bench: ``error`` says why."""

    def __init__(
        self,
        exe: Path,
        target: Path,
        aux: Optional[Path],
        defaults: dict[str, Any],
        base: DecodeConfig,
        prompts: Sequence[dict[str, Any]],
        prompt_ids: Sequence[list[int]],
        threads: int,
        n_ctx: int,
        flash_attn: Optional[bool],
        amx: bool = False,
        gpu_layers: tuple[Optional[int], Optional[int]] = (None, None),
        score: Optional[Callable[[list[int], list[int]], Any]] = None,
        say: Callable[[str], None] = lambda line: None,
        ready_s: float = 600.0,
        aux_threads: Optional[int] = None,
    ):
        self.exe, self.target, self.aux, self.base = exe, target, aux, base
        self.prompts, self.prompt_ids, self.score, self.say, self.ready_s = prompts, prompt_ids, score, say, ready_s
        self.settings = settings(defaults) if aux is not None else settings(defaults)[:1]
        # our threads for both models, one slot holding our context, flash attention as asked of both
        # (unset: each its own default, as a user runs it), weights placed as ours (native.llama_bench's
        # rule for AMX machines)
        self.common = ["-t", str(threads), "-c", str(n_ctx), "-np", "1", *flash_attn_flags(flash_attn)]
        self.common += ["--no-repack"] if uses_amx() and not amx else []
        self.common += placement_flags("-ngl", gpu_layers[0])
        self.aux_flags = placement_flags("-ngld", gpu_layers[1])
        self.threads = aux_threads or threads  # the draft model's (-td), as ours
        self.rows: list[dict[str, Any]] = []
        self.error: Optional[str] = None
        self.no_draft: Optional[str] = None if aux is not None else "the pair has no aux"
        self.start_s: Optional[float] = None

    def command(self, setting: Setting) -> list[str]:
        cmd = [str(self.exe), "-m", str(self.target), *self.common]
        if setting.draft is not None:
            cmd += ["-md", str(self.aux), "--spec-type", "draft-simple", "-td", str(self.threads), *self.aux_flags]
            cmd += setting.draft
        return cmd

    def probe(self) -> None:
        """Starts the fullest setting once before any run: a server that cannot start is a one-line
        error while nothing is measured yet; one that loads the aux and cannot draft with it (it
        refuses another vocabulary) leaves plain decoding alone in the column, said on a line."""
        setting = self.settings[-1]
        t0 = time.perf_counter()
        with Server.start(self.command(setting), self.ready_s) as server:
            self.start_s = time.perf_counter() - t0
            if setting.draft is None:
                return
            slots = server.get("/slots", timeout=60)
            if not (isinstance(slots, list) and slots and isinstance(slots[0], dict)):
                raise MtadEdgeError("llama-server's /slots answered no slot")
            if not slots[0].get("speculative"):
                self.no_draft = f"llama-server does not draft with this aux ({server.last_line()})"
                self.settings = self.settings[:1]
                self.say(f"bench: {self.no_draft}; its column runs plain decoding only")

    def hooks(self) -> list[Hook]:
        return [functools.partial(self.run, s) for s in self.settings]

    def request(self, i: int, seed: int) -> dict[str, Any]:
        """The bench's sampling as llama-server's /completion takes it: our prompt tokens (no BOS
        added to ids), min-p off (its default is 0.05), our sampler order, n_predict = max tokens,
        EOS honoured, no prompt cache (every run prefills as ours does), the tokens back; a prompt's
        schema as its ``json_schema`` (it constrains the target; the draft model drafts without it)."""
        s = self.base.sampling
        schema = self.prompts[i].get("schema")
        return {
            **({"json_schema": schema} if schema is not None else {}),
            "prompt": list(self.prompt_ids[i]),
            "n_predict": self.base.max_tokens,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": 0.0,
            "samplers": SAMPLERS,
            "seed": seed,
            "ignore_eos": False,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }

    def run(self, setting: Setting, i: int, rep: int, seed: int, ran: int) -> None:
        """One prompt-run of one setting: start its server, ask, stop it, record the row; after a
        failure, nothing (the column has stopped)."""
        if self.error is not None:
            return
        item = self.prompts[i]
        try:
            t0 = time.perf_counter()
            with Server.start(self.command(setting), self.ready_s) as server:
                started = time.perf_counter() - t0
                answer = server.get("/completion", self.request(i, seed))
            row = _row(answer)
        except MtadEdgeError as e:
            self.error = f"{setting.label}, prompt {item['id']!r}: {e}"
            self.say(f"bench: the llama-server column stops: {self.error}")
            return
        tokens, content = row.pop("tokens"), row.pop("content")
        logp = self.score(list(self.prompt_ids[i]), tokens) if self.score is not None and tokens else None
        if "schema" in item:  # the validity column, as ours (bench/run.py)
            row["valid"] = valid_json(content, item["schema"])
        self.rows.append(
            {
                "label": setting.label,
                "prompt_id": item["id"],
                "repeat": rep,
                "seed": seed,
                "ran": ran,
                "prompt_sent": len(self.prompt_ids[i]),
                **row,
                "start_s": started,
                "logprob_sum": None if logp is None else float(sum(logp)),
                "tokens": tokens,
            }
        )

    def results(self, rows: Sequence[dict[str, Any]], methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The column for results.json: each setting's aggregate, every variant's and setting's
        tok/s as a share of llama-server's plain decoding, the commands, the runs."""
        found: dict[str, dict[str, Any]] = {}
        for s in self.settings:
            if (agg := aggregate([r for r in self.rows if r["label"] == s.label])) is not None:
                found[s.label] = agg
        base = found.get(self.settings[0].label)
        if base is not None and self.base.sampling.temperature == 0:  # greedy: the same text as ours
            ours = {(r["prompt_id"], r["repeat"]): r["tokens"] for r in rows if r.get("label") == "ar"}
            for label, agg in found.items():
                mine = [r for r in self.rows if r["label"] == label and (r["prompt_id"], r["repeat"]) in ours]
                agg["same_tokens_as_ar"] = sum(r["tokens"] == ours[r["prompt_id"], r["repeat"]] for r in mine)
                agg["compared_with_ar"] = len(mine)
        speed = base["tokens_per_s"] if base else None
        every = {label: a["tokens_per_s"] for label, a in {**methods, **found}.items()}
        return {
            "binary": str(self.exe),
            "settings": found,
            "x_llama_server_ar": {label: v / speed if speed and v else None for label, v in every.items()},
            "temperature": self.base.sampling.temperature,
            "request": {k: v for k, v in self.request(0, 0).items() if k not in ("prompt", "seed", "json_schema")},
            "commands": {s.label: " ".join(self.command(s)) for s in self.settings},
            "start_s": self.start_s,
            "no_draft": self.no_draft,
            "error": self.error,
            "runs": self.rows,
        }


def _row(answer: Any) -> dict[str, Any]:
    """What a /completion answer says about one run: its timings (decode only, the prompt's
    prefill apart, as our tok/s), the draft's count and the tokens."""
    try:
        t = answer["timings"]
        row = {
            "prompt_tokens": int(t["prompt_n"]),
            "generated": int(t["predicted_n"]),
            # its predicted_ms starts at the first token, which came from the prompt's prefill: the
            # time covers predicted_n - 1 decodes (its own n_gen_tps counts so). Ours counts the
            # first token's decode, so predicted_n / predicted_ms ran 64/63 fast at 64 tokens.
            "decoded": max(0, int(t["predicted_n"]) - 1),
            "decode_s": float(t["predicted_ms"]) / 1000,
            "drafted": int(t.get("draft_n", 0)),
            "accepted": int(t.get("draft_n_accepted", 0)),
            "stop_type": answer.get("stop_type"),
            "tokens": [int(x) for x in answer.get("tokens") or []],
            "content": str(answer.get("content") or ""),
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MtadEdgeError(f"llama-server answered without the timings we read ({type(e).__name__}: {e})") from None
    return row


def aggregate(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """One setting's figures, pooled as ours are (bench.run.aggregate): tok/s per repeat as its
    generated tokens over its decode seconds, the median over repeats; rates over all runs."""
    if not rows:
        return None
    repeats = sorted({r["repeat"] for r in rows})
    speeds = []
    for k in repeats:
        mine = [r for r in rows if r["repeat"] == k]
        seconds = sum(r["decode_s"] for r in mine)
        speeds.append(sum(r["decoded"] for r in mine) / seconds if seconds > 0 else 0.0)
    gen, drafted, accepted = (sum(r[k] for r in rows) for k in ("generated", "drafted", "accepted"))
    scored = [r for r in rows if r["logprob_sum"] is not None]
    scored_n = sum(len(r["tokens"]) for r in scored)
    return {
        "runs": len(rows),
        "generated": gen,
        "tokens_per_s": statistics.median(speeds),
        "tokens_per_s_repeats": speeds,
        "tokens_per_s_min": min(speeds),
        "tokens_per_s_max": max(speeds),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        **share(rows),  # how much it drafted, repeat by repeat
        "ppl": math.exp(-sum(r["logprob_sum"] for r in scored) / scored_n) if scored_n else None,
        "start_s": statistics.median(r["start_s"] for r in rows),
        # runs where the server's prompt count is not the tokens we sent (it would not compare)
        "prompt_tokens_differ": sum(r["prompt_tokens"] != r["prompt_sent"] for r in rows),
        **_validity(rows),
    }


def _validity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """With schemas: the answers that parse and validate (ours say so in bench/run.py's structured)."""
    judged = [r for r in rows if r.get("valid") is not None]
    if not judged:
        return {}
    valid = sum(bool(r["valid"]) for r in judged)
    return {"structured": {"runs": len(judged), "valid": valid, "validity": valid / len(judged)}}
