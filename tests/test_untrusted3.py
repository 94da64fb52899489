"""Issue 67, untrusted input round three: the load guard runs only our code wherever it is started,
non-finite logits end a run in one line, browsers cannot drive the server from another site, and
the small ones. (An RPC peer as untrusted input: test_rpc_peer.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest

from helpers import EXE

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
def test_an_aborting_gguf_is_one_line_when_run_from_a_folder_with_a_checkout_and_planted_modules(
    smol_files, tmp_path
):
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
