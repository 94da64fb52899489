"""Issue 67, untrusted input round three: the load guard runs only our code wherever it is started,
non-finite logits end a run in one line, browsers cannot drive the server from another site, and
the small ones. (An RPC peer as untrusted input: test_rpc.py, its "issue 67" sections.)"""

from __future__ import annotations

import json
import os
import re
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
    from mtad_edge.runtime.backends import child, guard

    cmd = child.command(guard.CHILD_MODULE, ["gguf", "/m.gguf"], guard.ENGINE_PACKAGES["gguf"])
    assert cmd[:3] == [sys.executable, "-I", "-c"]  # no current folder, user site or PYTHON* variables
    loads = dict(item.split("=", 1) for item in cmd[4 : cmd.index("--")])
    assert loads["mtad_edge.runtime"] == str(Path(runtime.__file__).resolve().parent)
    assert Path(loads["mtad_edge"], "__init__.py").is_file()
    assert cmd[cmd.index("--") + 1 :] == ["mtad_edge.runtime.backends.guard", "gguf", "/m.gguf"]


@pytest.mark.slow  # a real child loads the default pair's aux (92 MB)
def test_the_guard_child_runs_none_of_the_current_folders_code(smol_files, tmp_path, monkeypatch):
    """Row 2: a llama_cpp.py in the current folder ran in the child, and its exit 0 stamped any
    file as loaded. Row 1: the checkout's mtad_edge/ was imported and the child failed cleanly."""
    from mtad_edge.loader import StoredModelFacts
    from mtad_edge.runtime.backends import guard

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


# -- 5. the small ones -----------------------------------------------------------------------------
@pytest.fixture
def odd_paths(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    (tmp_path / "empty.gguf").write_bytes(b"")
    return {
        str(fifo): "is a named pipe (FIFO), not a model file",
        "/dev/zero": "is a character device, not a model file",
        "/dev/null": "is a character device, not a model file",
        str(loop): "cannot be read as a model file: a symbolic link that loops",
        "/proc/self/mem": "is empty (0 bytes), not a model file",
        str(tmp_path / "empty.gguf"): "is empty (0 bytes), not a model file",
        str(tmp_path / "missing.gguf"): None,
    }


def test_a_model_path_that_is_not_a_regular_file_is_named_for_what_it_is(odd_paths):
    """Row 15: they were "model file not found" (they exist), and /proc/self/mem an Errno 5 without
    its path; a FIFO blocked the load."""
    from mtad_edge import Engine
    from mtad_edge.runtime.errors import ModelLoadError

    for path, what in odd_paths.items():
        with pytest.raises(ModelLoadError) as e:
            Engine.load(target=path, method="ar")
        expected = f"model file not found: {path}" if what is None else f"{path} {what}"
        assert str(e.value) == expected


def test_score_and_tokenize_check_what_they_are_handed():
    """Row 16: score([1], [999999]) was an IndexError, score([-5], [1]) llama.cpp's "decode
    failed", score([1.5], [1]) scored token 1 silently, tokenize(None) returned []."""
    from helpers import fake_engine
    from mtad_edge.runtime.errors import OptionError

    engine = fake_engine()  # a vocabulary of 5
    for prompt, tokens, param, needle in [
        ([1], [999999], "tokens", "token id 999999 is not in the vocabulary (0..4)"),
        ([-5], [1], "prompt_ids", "token id -5 is not in the vocabulary"),
        ([1.5], [1], "prompt_ids", "must hold integer token ids, got 1.5"),
        ([True], [1], "prompt_ids", "must hold integer token ids"),
        ([], [1], "prompt_ids", "at least 1 token id"),
        ("ab", [1], "prompt_ids", "must be a list of token ids"),
        ([1], None, "tokens", "must be a list of token ids"),
    ]:
        with pytest.raises(OptionError, match=re.escape(needle)) as e:
            engine.score(prompt, tokens)
        assert e.value.param == param
    assert engine.score([1, 2], [3, np.int64(4)]).shape == (2,)
    with pytest.raises(OptionError, match="text must be a string, got NoneType"):
        engine.tokenize(None)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["bench", "--relay-delay", "nan", "--rpc", "127.0.0.1:9"], "'nan' is not a finite number"),
        (["bench", "--relay-delay", "1e9", "--rpc", "127.0.0.1:9"], "is not in the range 0<=x<=10000"),
        (["serve", "--header-timeout", "nan"], "'nan' is not a finite number"),
        (["serve", "--body-timeout", "inf"], "is not in the range"),
        (["tune", "--bound", "nan"], "'nan' is not a finite number"),
        (["generate", "--temperature", "nan", "hi"], "temperature must be a number in [0, 2], got nan"),
    ],
)
def test_nan_and_infinite_options_are_refused_everywhere(args, needle):
    """Row 17: `bench --relay-delay nan` was taken (results.json got a non-JSON NaN), 1e9 blamed
    the relay's port. click's FloatRange takes 'nan', which compares false with every bound."""
    from click.testing import CliRunner

    from mtad_edge.cli import cli

    res = CliRunner().invoke(cli, args)
    assert res.exit_code != 0 and needle in res.output and "Traceback" not in res.output, res.output


def test_a_lone_surrogate_in_stop_is_refused_as_in_content():
    """Row 18: a stop string of a lone surrogate was a 200 where content's is a 400."""
    from helpers import Served, fake_engine
    from mtad_edge.runtime.errors import OptionError

    engine = fake_engine(method="ar")
    with pytest.raises(OptionError, match="stop: '\\\\ud800' is not valid UTF-8 text") as e:
        engine.generate("ab", stop=["\ud800"])
    assert e.value.param == "stop"
    served = Served(engine)
    try:
        status, body = served.post(b'{"prompt": "ab", "max_tokens": 2, "stop": ["\\ud800"]}')
        assert status == 400 and body["error"]["param"] == "stop", body
        status, body = served.post({"prompt": "ab", "max_tokens": 2, "max_completion_tokens": 3})
        assert status == 400 and body["error"]["param"] == "max_completion_tokens", body
        assert "not both" in body["error"]["message"]
        assert served.post({"prompt": "ab", "max_completion_tokens": 2})[0] == 200
    finally:
        served.close()


def test_the_apis_chat_takes_the_roles_the_server_takes():
    """Row 18: Engine.chat took role 'bogus', which the server refuses (both take a tool turn now)."""
    from helpers import fake_engine
    from mtad_edge.runtime.errors import OptionError

    engine = fake_engine(method="ar")
    for role in ("bogus", "User"):
        with pytest.raises(OptionError, match=f"role must be system, user, assistant or tool, got '{role}'"):
            engine.chat([{"role": role, "content": "hi"}], max_tokens=2)
    for role in ("user", "tool"):
        assert engine.chat([{"role": role, "content": "hi"}], max_tokens=2, seed=0).text() is not None


@pytest.mark.parametrize(
    "method,why",
    [("ar", "ar does not draft"), ("beam", "beam does not draft"), ("mmtad", "mmtad verifies a tree of beams")],
)
def test_draft_ahead_with_a_method_that_cannot_is_refused_in_one_line(method, why):
    """Row 18: `--draft-ahead on` with ar, beam or mmtad was taken and did nothing."""
    from click.testing import CliRunner

    from mtad_edge.cli import cli

    res = CliRunner().invoke(cli, ["generate", "--method", method, "--draft-ahead", "on", "hi"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert (
        res.exit_code != 0
        and lines[-1] == f"Error: draft_ahead 'on' applies to sd and mtad drafting with the aux; {why}"
    )
    assert len([ln for ln in lines if ln.startswith("Error")]) == 1


def test_a_chat_command_with_words_after_it_does_nothing_and_says_so(capsys):
    """Row 18: `/reset extra` ran as /reset (and `/quit now` quit)."""
    from helpers import fake_engine
    from mtad_edge.cli.chat import ChatSession

    session = ChatSession(fake_engine(method="ar"), "ar", None, False)
    session.turns = [{"role": "user", "content": "hi"}]
    assert session.command("/reset extra") is True and session.turns
    assert session.command("/quit now") is True
    assert "(/reset takes nothing after it; nothing done)" in capsys.readouterr().err
    assert session.command("/reset") is True and session.turns == []
    assert session.command("/quit") is False


def test_a_file_put_in_place_of_a_loaded_one_is_loaded_in_a_child_again(tmp_path, monkeypatch):
    """Row 14: a model file replaced after a clean load, with the same size and mtime, skipped the
    guard (and aborted the process): the guard's record now holds the inode and ctime too."""
    from mtad_edge.loader import StoredModelFacts
    from mtad_edge.runtime.backends import guard
    from mtad_edge.runtime.backends.child import Outcome

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("mtad_edge.loader._llama_build", lambda: ["a build"])
    children = []
    monkeypatch.setattr(guard, "_run_child", lambda kind, path: children.append(path) or Outcome(0, ("loaded",)))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    os.utime(model, ns=(10**18, 10**18))
    guard.check_loads("gguf", model, StoredModelFacts())
    guard.check_loads("gguf", model, StoredModelFacts())
    assert len(children) == 1
    swapped = tmp_path / "other.gguf"
    swapped.write_bytes(b"GGUF" + b"\x01" * 60)  # the same size, and (below) the same mtime
    os.utime(swapped, ns=(10**18, 10**18))
    os.replace(swapped, model)
    guard.check_loads("gguf", model, StoredModelFacts())
    assert len(children) == 2
    with model.open("r+b") as f:  # rewritten in place: the same inode, a new ctime
        f.write(b"GGUF" + b"\x02" * 60)
    os.utime(model, ns=(10**18, 10**18))
    guard.check_loads("gguf", model, StoredModelFacts())
    assert len(children) == 3
