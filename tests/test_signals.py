"""Issue 13 through real processes: SIGINT and SIGTERM never crash `mtad-edge` or lose its output,
the server stops promptly, and bad command-line input is an `Error:` line (the console script)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import EXE

pytestmark = pytest.mark.slow
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"  # greedy: no early end


def start(*args: str, **kw) -> subprocess.Popen:
    """The console script, with SIGINT at its default even where this test runs as a background
    job (which inherits SIGINT ignored, and the script keeps an ignored signal ignored)."""
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if os.name == "posix" else None
    return subprocess.Popen(
        [EXE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec, **kw
    )


def no_crash(proc: subprocess.Popen, err: str) -> None:
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {err}"
    assert "Traceback" not in err and "Fatal Python error" not in err and "Aborted!" not in err, err


def maps_file(pid: int, path: Path) -> bool:
    try:
        return str(path) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_just_after_the_answer_exits_130_and_keeps_it(smol_files):
    """The answer is printed, then the models are freed: a Ctrl-C anywhere in that window (the
    probe's 0-80 ms) must not crash the process (it segfaulted 7 times in 10) or cut the JSON."""
    codes = []
    for delay_ms in (0, 5, 10, 20, 40, 60, 80, 15):
        p = start("generate", "--json", "--max-tokens", "8", "--seed", "1", "--threads", "2", "hi")
        line = p.stdout.readline()
        time.sleep(delay_ms / 1000)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        no_crash(p, err)
        answer = json.loads(line + out)  # the whole JSON object, nothing else
        assert answer["stats"]["finish_reason"] in ("length", "stop") and answer["tokens"]
        # 0: the process had finished on its own before the signal arrived (how soon that is
        # depends on the machine's load, so which delays land in the window varies).
        assert p.returncode in (130, 0), (delay_ms, p.returncode)
        codes.append(p.returncode)
    assert codes.count(130) >= 2, codes  # at least the shortest delays land while it frees the models


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_answer_keeps_the_partial_json(smol_files, sig, code):
    """SIGTERM used to leave stdout empty; now both signals end the run at the next step and print
    what was generated with finish_reason "cancelled"."""
    for wait in (1, 2, 4, 8, 16, 30):  # until the signal lands after the load, mid-answer
        p = start("generate", "--json", "--max-tokens", "2000", "--temperature", "0", "--threads", "2", STORY)
        time.sleep(wait)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
        no_crash(p, err)
        assert p.returncode == code, err
        if out.strip():
            answer = json.loads(out)
            assert answer["stats"]["finish_reason"] == "cancelled"
            if answer["tokens"]:
                assert answer["text"] and len(answer["tokens"]) == answer["stats"]["generated"] < 2000
                return
    pytest.fail("the signal never arrived mid-answer")


def test_ctrl_c_while_streaming_text_keeps_it_and_exits_130(smol_files):
    p = start("generate", "--max-tokens", "2000", "--temperature", "0", "--threads", "2", STORY)
    first = p.stdout.read(40)  # the answer is streaming
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    no_crash(p, err)
    assert p.returncode == 130 and first.strip() and "finish cancelled" in err


def test_ctrl_c_during_the_model_load_exits_130(smol_files):
    p = start("generate", "--json", "--max-tokens", "64", "--threads", "2", "hi")
    deadline = time.time() + 120
    while not maps_file(p.pid, smol_files.target) and p.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    p.send_signal(signal.SIGINT)  # the target is being mapped: the load is under way
    out, err = p.communicate(timeout=120)
    no_crash(p, err)
    assert p.returncode == 130
    if out.strip():  # the load had finished: the run stopped at once
        assert json.loads(out)["stats"]["finish_reason"] == "cancelled"


# -- the server -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int) -> subprocess.Popen:
    import http.client

    p = start("serve", "--port", str(port), "--ctx-size", "4096", "--threads", "2", "--queue-size", "2")
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return p
        except OSError:
            time.sleep(0.2)
        assert p.poll() is None, p.stderr.read()
    pytest.fail("the server did not start")


def post_forever(port: int, results: list) -> None:
    import http.client

    body = json.dumps({"prompt": STORY, "max_tokens": 1_000_000_000, "temperature": 0})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        results.append(conn.getresponse().status)
    except OSError as e:
        results.append(type(e).__name__)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_server_stops_promptly_on_a_signal_cancelling_what_runs(smol_files, sig, code):
    """It stayed alive 150 s after SIGTERM with an orphaned generation: now the running and the
    waiting requests are cancelled (503) and the process ends."""
    port = free_port()
    p = serve(port)
    results: list = []
    clients = [threading.Thread(target=post_forever, args=(port, results)) for _ in range(2)]
    for c in clients:
        c.start()
    time.sleep(2)  # one generating, one waiting
    p.send_signal(sig)
    try:
        p.wait(timeout=15)  # liveness, not speed: it used to take 34-150 s
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the server was still alive 15 s after the signal")
    for c in clients:
        c.join(30)
    err = p.stderr.read()
    no_crash(p, err)
    assert p.returncode == code and results and all(r in (503, "RemoteDisconnected") for r in results), results


# -- bad input through the console script -----------------------------------------------------------
def run(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=300, env=env)


def one_line_error(r: subprocess.CompletedProcess, needle: str, code: int = 1) -> None:
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr and f"Error: {needle}" in r.stderr, r.stderr
    if code == 1:
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    "args",
    [["--temperature", "nan"], ["--temperature", "inf"], ["--top-p", "nan"], ["--accept-threshold", "nan"]],
)
def test_nan_and_inf_options_are_errors(args):
    r = run("generate", "hi", *args)
    one_line_error(r, f"Invalid value for '{args[0]}'", code=2)


def test_empty_prompt_is_an_error_but_an_empty_chat_turn_is_answered(smol_files):
    one_line_error(run("generate", "--raw", "", "--max-tokens", "4"), "the prompt must contain at least one token")
    r = run("generate", "", "--max-tokens", "4", "--json")  # a chat by default
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"], r.stderr


def test_invalid_utf8_in_the_prompt_is_an_error(smol_files):
    r = subprocess.run([os.fsencode(EXE), b"generate", b"abc\xff\xfedef", b"--max-tokens", b"4"], capture_output=True)
    r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode("utf-8", "replace"))
    one_line_error(r, "prompt is not valid UTF-8 text: b'\\xff\\xfe' at character 3")


def test_a_read_only_model_cache_is_an_error_naming_it(tmp_path):
    """A fresh cache on a read-only file system (a tmpfs mounted read-only in a private mount
    namespace): deriving the pair must fail with what is wrong, not an OSError traceback."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare")
    ro = tmp_path / "ro"
    ro.mkdir()
    script = f'mount -t tmpfs -o ro none "{ro}" && exec "{EXE}" generate hi --max-tokens 2'
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MTAD_EDGE_HOME": str(ro / "cache")},
    )
    if "Error:" not in r.stderr and ("unshare:" in r.stderr or "mount:" in r.stderr):
        pytest.skip(f"cannot mount a read-only file system here: {r.stderr.strip()}")
    one_line_error(r, f"cannot write the model cache {ro / 'cache' / 'smollm2-135m'}: Read-only file system")


# A console-script process that loaded llama.cpp: a native object left for finalization (as CUDA's
# were: exit 139 after a bench's report on an H200) and Python's own exit work registered.
LOADED_THEN_EXITS = (
    "import atexit, sys, llama_cpp\n"
    "class Native:\n"
    "    def __del__(self): print('finalized', flush=True)\n"
    "kept = Native()\n"
    "atexit.register(lambda: print('atexit ran', flush=True))\n"
    "sys.argv = ['mtad-edge', *sys.argv[1:]]\n"
    "from mtad_edge.console import main\n"
    "main()\n"
)


@pytest.mark.parametrize("args, code", [(["--version"], 0), (["generate", "--max-tokens", "0", "x"], 2)])
def test_a_process_that_loaded_llama_cpp_ends_without_native_finalization(args, code):
    """The exit status is the command's, atexit work runs, and nothing is finalized after it."""
    proc = subprocess.run([sys.executable, "-c", LOADED_THEN_EXITS, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert "atexit ran" in proc.stdout and "finalized" not in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr
