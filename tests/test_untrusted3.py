"""Issue 67, untrusted input round three: the load guard runs only our code wherever it is started,
non-finite logits end a run in one line, browsers cannot drive the server from another site, and
the small ones. (An RPC peer as untrusted input: test_rpc_peer.py.)"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from helpers import EXE, FakeLM

# What a folder a user runs mtad-edge from may hold: the source checkout's own mtad_edge/ (without
# runtime/, which installs from the top-level folder), and a llama_cpp.py that must never run.
PLANTED = {
    "mtad_edge/__init__.py": "open('MARKER-mtad_edge', 'w').write('x')\n",
    "llama_cpp.py": "open('MARKER-llama_cpp', 'w').write('x')\nraise SystemExit(0)\n",
    "numpy.py": "open('MARKER-numpy', 'w').write('x')\nraise SystemExit(0)\n",
}


def _plant(folder):
    for name, text in PLANTED.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


# -- 1, 2. the guard's child runs only this package's code ------------------------------------------
def test_the_guard_child_is_isolated_and_loads_this_package_from_where_it_runs():
    import sys
    from pathlib import Path

    import mtad_edge.runtime as runtime
    from mtad_edge.runtime import child, guard

    cmd = child.command(guard.CHILD_MODULE, ["gguf", "/m.gguf"], guard.ENGINE_PACKAGES["gguf"])
    assert cmd[:3] == [sys.executable, "-I", "-c"]  # no current folder, user site or PYTHON* variables
    loads = dict(item.split("=", 1) for item in cmd[4 : cmd.index("--")])
    assert loads["mtad_edge.runtime"] == str(Path(runtime.__file__).resolve().parent)
    assert Path(loads["mtad_edge"], "__init__.py").is_file()
    assert cmd[cmd.index("--") + 1 :] == ["mtad_edge.runtime.guard", "gguf", "/m.gguf"]


@pytest.mark.slow  # a real child loads the default pair's aux (92 MB)
def test_the_guard_child_runs_none_of_the_current_folders_code(smol_files, tmp_path, monkeypatch):
    """Row 2: a llama_cpp.py in the current folder ran in the child, and its exit 0 stamped any
    file as loaded. Row 1: the checkout's mtad_edge/ was imported and the child failed cleanly."""
    from mtad_edge.loader import StoredModelFacts
    from mtad_edge.runtime import guard

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "cwd"
    folder.mkdir()
    _plant(folder)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PYTHONPATH", str(folder))  # isolated: not read either
    outcome = guard._run_child("gguf", smol_files.aux)
    assert outcome.rc == 0 and outcome.said == ("loaded",), outcome
    assert not list(folder.glob("MARKER-*"))
    guard.check_loads("gguf", smol_files.aux, StoredModelFacts())
    assert StoredModelFacts().get("gguf", smol_files.aux, "loaded") is True


@pytest.mark.slow  # writes a SmolLM2 GGUF (92 MB)
def test_an_aborting_gguf_is_one_line_when_run_from_a_folder_with_a_checkout_and_planted_modules(smol_files, tmp_path):
    """Row 1: `mtad-edge generate` run from the source checkout's root aborted (exit 134): the
    child imported the checkout's mtad_edge/, failed cleanly, and the file loaded unguarded."""
    from helpers import rewrite_gguf

    model = rewrite_gguf(
        smol_files.aux, tmp_path / "ABORTS.gguf", {"llama.expert_used_count": 5, "llama.expert_count": 0}
    )
    folder = tmp_path / "checkout"
    folder.mkdir()
    _plant(folder)
    args = ["generate", "--target", str(model), "--method", "ar", "--max-tokens", "2", "--ctx-size", "64", "Hi"]
    env = {**os.environ, "MTAD_EDGE_HOME": str(tmp_path / "home")}
    r = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=300, cwd=folder, env=env)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: llama.cpp aborted while loading {model}: llama-model.cpp:"), line
    assert not list(folder.glob("MARKER-*"))


# -- 3. non-finite logits anywhere end the run in one line naming where they came from ---------------
class BrokenLM(FakeLM):
    """A FakeLM whose logits hold ``bad`` (NaN, inf) at token ``at`` (None: every token) once its
    context is longer than ``after``; it says where its logits come from, as LlamaCppBackend does."""

    def __init__(self, *args, bad=float("nan"), at=None, after=6, path="broken.gguf", **kwargs):
        super().__init__(*args, **kwargs)
        self.bad, self.at, self.after, self.path, self.last = bad, at, after, path, None

    def logits_for(self, context):
        row = super().logits_for(context)
        if len(context) > self.after:
            row[slice(None) if self.at is None else self.at] = self.bad
        return row

    def decode(self, batch):
        self.last = super().decode(batch)
        return self.last

    def last_logits_finite(self):
        return self.last is None or bool(np.isfinite(self.last).all())

    def logits_origin(self):
        return "the test's arithmetic"


NAMED = "the {} model {} gave non-finite logits (NaN or inf), computed by the test's arithmetic; the run stopped"


@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mmtad", "beam"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("vocab,at,bad", [(1000, 617, float("nan")), (1000, 3, float("inf")), (5, None, float("nan"))])
def test_non_finite_target_logits_end_every_method_in_one_line_naming_the_model(method, temperature, vocab, at, bad):
    """Row 7: NaN logits were numpy's `ValueError: a must be a positive integer` (a traceback), or at
    temperature 0 a silent token (argmax picks a NaN). One NaN among 1000 tokens (top-k reads the
    row by groups) is found as surely as a row of them."""
    from helpers import fake_engine
    from mtad_edge.runtime.errors import NonFiniteLogits

    target = BrokenLM(vocab=vocab, salt=1, n_seq_max=9, at=at, bad=bad)
    engine = fake_engine(target, FakeLM(vocab=vocab, salt=2, n_seq_max=9))
    with pytest.raises(NonFiniteLogits) as e:
        engine.generate("abcd", method=method, temperature=temperature, gamma=3, max_tokens=12, seed=1).text()
    assert str(e.value) == NAMED.format("target", "broken.gguf")
    assert engine.generate("ab", method="ar", max_tokens=2, seed=1).text()  # the engine is still usable


def test_non_finite_aux_logits_name_the_aux():
    from helpers import fake_engine
    from mtad_edge.runtime.errors import NonFiniteLogits

    aux = BrokenLM(vocab=1000, salt=2, n_seq_max=9, at=5, path="aux.gguf")
    engine = fake_engine(FakeLM(vocab=1000, salt=1, n_seq_max=5), aux)
    with pytest.raises(NonFiniteLogits, match=NAMED.format("aux", "aux.gguf").replace("(", "\\(").replace(")", "\\)")):
        engine.generate("abcd", method="mtad", gamma=3, max_tokens=12, seed=1).text()


def test_non_finite_logits_in_logprobs_and_score_are_named_too():
    from helpers import fake_engine
    from mtad_edge.runtime.errors import NonFiniteLogits

    engine = fake_engine(BrokenLM(vocab=1000, salt=1, n_seq_max=5, at=9, after=3))
    with pytest.raises(NonFiniteLogits, match="the target model broken.gguf"):
        engine.score([1, 2], [3, 4, 5])
    with pytest.raises(NonFiniteLogits, match="the target model broken.gguf"):
        engine.generate("abcd", method="ar", temperature=0, max_tokens=1, logprobs=2, seed=1).text()


def test_the_server_answers_non_finite_logits_with_a_5xx_naming_them():
    """Row 7 in the server: its handler caught only our own errors, so numpy's ValueError was a 500
    with no message (or a broken stream)."""
    from helpers import Served, fake_engine

    engine = fake_engine(BrokenLM(vocab=1000, salt=1, n_seq_max=5, at=1, after=2), aux=None, method="ar")
    served = Served(engine)
    try:
        status, body = served.post({"prompt": "abcd", "max_tokens": 8, "temperature": 0})
        assert status == 500 and body["error"]["message"] == NAMED.format("target", "broken.gguf"), body
        events = served.stream({"prompt": "abcd", "max_tokens": 8, "stream": True})
        assert events[-2]["error"]["message"] == NAMED.format("target", "broken.gguf") and events[-1] == "[DONE]"
    finally:
        served.close()


# -- 4. browsers cannot drive the server from another site (DNS rebinding, CSRF) --------------------
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def served():
    from helpers import Served, fake_engine

    s = Served(fake_engine(), allow_hosts=["my-box.lan"], cors_origins=["http://app.example:3000"])
    yield s
    s.close()


def test_a_host_that_is_not_the_servers_own_is_refused(served):
    """Row 13: `Host: attacker.example` was served: a page whose name was made to resolve to
    127.0.0.1 (DNS rebinding) could read every reply."""
    p = served.port
    for host in ("attacker.example", f"attacker.example:{p}", "localhost.attacker.example", "127.0.0.1.nip.io"):
        status, _, body = served.request("GET", "/v1/models", headers={"Host": host})
        assert status == 403 and "DNS rebinding" in body["error"]["message"], (host, body)
        assert f"--allow-host {host.split(':')[0]}" in body["error"]["message"]
    status, _, _ = served.request("POST", "/v1/chat/completions", CHAT, {"Host": "attacker.example", **JSON})
    assert status == 403
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", f"[::1]:{p}", "LOCALHOST", f"app.localhost:{p}", "my-box.lan:80"):
        assert served.request("GET", "/v1/models", headers={"Host": host})[0] == 200, host
        assert served.request("POST", "/v1/chat/completions", CHAT, {"Host": host, **JSON})[0] == 200, host
    assert served.request("GET", "/v1/models", headers={"Host": "10.1.2.3:9000"})[0] == 200  # an address: no rebinding


def test_a_cross_origin_request_is_refused_unless_its_origin_is_allowed(served):
    """Row 13: a page of evil.example made the browser POST a generation (200)."""
    p = served.port
    evil = {"Origin": "http://evil.example", **JSON}
    status, headers, body = served.request("POST", "/v1/chat/completions", CHAT, evil)
    assert status == 403 and "cross-origin request from 'http://evil.example'" in body["error"]["message"]
    assert "access-control-allow-origin" not in headers
    assert served.request("GET", "/v1/models", headers={"Origin": "null"})[0] == 403
    own = {"Origin": f"http://127.0.0.1:{p}", **JSON}  # the server's own pages (its chat page at /)
    assert served.request("POST", "/v1/chat/completions", CHAT, own)[0] == 200
    proxied = {"Host": "my-box.lan", "Origin": "https://my-box.lan", **JSON}  # behind a TLS proxy
    assert served.request("POST", "/v1/chat/completions", CHAT, proxied)[0] == 200
    app = {"Origin": "http://app.example:3000", **JSON}
    status, headers, _ = served.request("POST", "/v1/chat/completions", CHAT, app)
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example:3000"
    preflight = {
        "Origin": "http://app.example:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = served.request("OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example:3000"
    assert "POST" in headers["access-control-allow-methods"]
    assert (
        served.request("OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})[0]
        == 403
    )


@pytest.mark.parametrize("kind", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None])
def test_a_json_endpoint_refuses_the_content_types_a_page_sends_without_a_preflight(served, kind):
    """Row 13: `Content-Type: text/plain` needs no CORS preflight, so any page could send it."""
    headers = {} if kind is None else {"Content-Type": kind}
    status, _, body = served.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), headers)
    assert status == 415 and "Content-Type must be application/json" in body["error"]["message"]
    charset = {"Content-Type": "application/json; charset=utf-8"}
    assert served.request("POST", "/v1/chat/completions", CHAT, charset)[0] == 200


def test_bad_allow_host_and_cors_origin_values_are_one_line_at_start():
    from click.testing import CliRunner

    from mtad_edge.cli import cli

    for args, needle in [
        (["--allow-host", "http://x"], "--allow-host 'http://x' is not a host name"),
        (["--cors-origin", "app.example"], "--cors-origin 'app.example' is not an origin"),
        (["--cors-origin", "http://app.example/path"], "is not an origin"),
    ]:
        res = CliRunner().invoke(cli, ["serve", "--target", "/nonexistent.gguf", *args])
        assert res.exit_code == 1 and needle in res.output and "Traceback" not in res.output, res.output
