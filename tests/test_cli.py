"""The `mtad-edge` CLI through click's CliRunner, and once as a real console-script subprocess."""

import contextlib
import functools
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers import EXE
from mtad_edge.cli import cli

STATS_KEYS = {
    "target_calls",
    "drafted",
    "accepted",
    "acceptance_rate",
    "block_efficiency",
    "wall_s",
    "draft_s",
    "verify_s",
    "other_s",
    "tokens_per_s",
    "generated",
    "finish_reason",
    "seed",
}


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--gamma", "0"], "--gamma"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--accept-threshold", "0"], "--accept-threshold"),
        (["--accept-threshold", "1.5"], "--accept-threshold"),
        (["--beam-width", "0"], "--beam-width"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--method", "beams"], "--method"),
        (["--top-k", "-2"], "--top-k"),
        (["--gamma-min", "-1"], "--gamma-min"),
        (["--aux-gpu-layers", "cpu"], "--aux-gpu-layers"),
        (["--aux-gpu-layers", "-2"], "--aux-gpu-layers"),
        (["--aux-gpu-layers", str(2**31)], "--aux-gpu-layers"),
        (["--n-gpu-layers", str(2**31)], "--n-gpu-layers"),
    ],
)
def test_invalid_parameters_are_usage_errors(args, needle):
    r = invoke("generate", "hi", *args)
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output


def test_gamma_min_above_gamma_max_is_one_line():
    r = invoke("generate", "hi", "--gamma-min", "5", "--gamma-max", "4")
    assert r.exit_code == 1 and "gamma_min must be <= gamma_max (4), got 5" in r.output and "Traceback" not in r.output


def test_target_without_aux_needs_ar():
    r = invoke("generate", "hi", "--target", "x.gguf", "--method", "mtad")
    assert r.exit_code == 1 and r.output.startswith(
        "Error: method mtad drafts with an auxiliary model and there is none"
    )


def test_unknown_pair_is_a_one_line_error():
    r = invoke("generate", "hi", "--pair", "no-such-pair")
    assert r.exit_code == 1 and r.output.startswith("Error: unknown pair")


def test_onnx_model_without_onnxruntime_installed_is_a_one_line_error(tmp_path, monkeypatch):
    (tmp_path / "model.onnx").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if the [onnx] extra were missing
    r = invoke("generate", "hi", "--target", str(tmp_path), "--method", "ar")
    assert r.exit_code == 1 and r.output.count("\n") == 1
    assert r.output.startswith("Error: the ONNX Runtime backend needs onnxruntime: pip install 'mtad-edge[onnx]'")


def test_a_bad_constraint_is_a_one_line_error_before_any_load(tmp_path):
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "bin.gbnf").write_bytes(b"\xff\xfe")
    for args, words in [
        (["--json-schema", str(tmp_path / "none.json")], "Error: --json-schema: cannot read"),
        (["--json-schema", str(tmp_path / "bad.json")], "is not JSON (Expecting property name"),
        (["--json-schema", '{"type": "object", "x": '], "Error: --json-schema: the schema is not JSON"),
        (["--json-schema", "[1]"], "cannot read"),
        (["--grammar", str(tmp_path / "bin.gbnf")], "is not UTF-8 text"),
        (["--regex", "a" * 200_000], "more than the 131072 allowed"),
    ]:
        r = invoke("generate", "hi", "--pair", "no-such-pair", *args)  # no such pair: the constraint is read first
        assert r.exit_code == 1 and r.output.startswith("Error: ") and words in r.output, (args, r.output)
        assert r.output.count("\n") == 1
    r = invoke("generate", "hi", "--regex", "a", "--grammar", "g.gbnf")
    assert r.exit_code == 2 and "give one of --grammar and --regex" in r.output


@pytest.mark.slow
def test_generate_follows_a_json_schema_a_grammar_file_or_a_regex(smol_files, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"planet": {"enum": ["Mars", "Venus"]}}, "required": ["planet"]}
    schema["additionalProperties"] = False  # else a model may add keys past max_tokens
    (tmp_path / "yes.gbnf").write_text('root ::= "yes" | "no"')
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for args, check in [
        (["--json-schema", str(tmp_path / "s.json")], lambda t: jsonschema.validate(json.loads(t), schema)),
        (["--grammar", str(tmp_path / "yes.gbnf")], lambda t: t in ("yes", "no")),
        (["--regex", "[0-9]{4}"], lambda t: len(t) == 4 and t.isdigit()),
    ]:
        r = CliRunner().invoke(cli, ["generate", "--json", "--chat", "--max-tokens", "24", "--seed", "1", "Hi", *args])
        out = json.loads(r.stdout)
        assert r.exit_code == 0 and out["finish_reason"] == "stop", r.output
        assert check(out["text"]) is not False, out["text"]


@pytest.mark.slow
def test_generate_json_is_one_object_with_text_tokens_stats(smol_files):
    r = CliRunner().invoke(
        cli,
        [
            "generate",
            "--json",
            "--method",
            "mtad",
            "--max-tokens",
            "12",
            "--seed",
            "1",
            "--chat",
            "Say something about rivers.",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)  # stdout holds the JSON object and nothing else
    assert set(out) == {"text", "tokens", "finish_reason", "stats"}
    assert set(out["stats"]) >= STATS_KEYS and out["stats"]["method"] == "mtad"
    assert len(out["tokens"]) == out["stats"]["generated"] <= 12 and out["text"]
    assert out["stats"]["seed"] == 1


@pytest.mark.slow
def test_default_command_streams_text_and_prints_stats_to_stderr(smol_files):
    r = CliRunner().invoke(cli, ["Name a planet.", "--chat", "--method", "sd", "--max-tokens", "8", "--seed", "0"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and "sd: " in r.stderr and "block efficiency" in r.stderr


@pytest.mark.slow
def test_aux_gpu_layers_0_loads_the_aux_with_its_own_placement(smol_files, monkeypatch):
    """--aux-gpu-layers 0 (llama.cpp's -ngld 0) reaches the aux's load alone; the target keeps the default."""
    from mtad_edge import loader

    asked = []
    real = loader.load_backend

    def recording(path, *args, **kwargs):
        asked.append((Path(path).name, args[2].n_gpu_layers))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader, "load_backend", recording)
    r = invoke(
        "generate",
        "--json",
        "--method",
        "sd",
        "--gamma",
        "4",
        "--max-tokens",
        "8",
        "--seed",
        "0",
        "--aux-gpu-layers",
        "0",
        "Name a planet.",
    )
    assert r.exit_code == 0, r.output
    assert asked == [(smol_files.target.name, None), (smol_files.aux.name, 0)]
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == out["stats"]["generated"] > 0 and out["stats"]["drafted"] > 0


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors(tmp_path, smol_files, gemma_files):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    cases = [
        (["--target", str(junk), "--aux", str(smol_files.aux)], "not a GGUF file"),
        (
            ["--target", str(smol_files.target), "--aux", str(gemma_files.aux), "--vocab-mismatch", "refuse"],
            "cannot be paired",
        ),
        (["--ctx-size", "64", "--max-tokens", "4"], "prompt has"),
    ]
    for extra, needle in cases:
        prompt = "word " * 600 if "--ctx-size" in extra else "hi"  # llama.cpp pads n_ctx to 256
        r = CliRunner().invoke(cli, ["generate", prompt, *extra])
        assert r.exit_code == 1, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error:") and needle in lines[0], r.stderr


@pytest.mark.slow
def test_models_list_and_path(smol_files):
    r = invoke("models", "list")
    assert r.exit_code == 0 and "smollm2-135m (default)" in r.output and "gemma3-270m" in r.output
    r = invoke("models", "path", "smollm2-135m")
    assert r.exit_code == 0
    assert r.stdout.splitlines() == [f"target: {smol_files.target}", f"aux: {smol_files.aux}"]


@pytest.mark.slow
def test_console_script_subprocess(smol_files):
    assert EXE, "the mtad-edge console script is not installed"
    proc = subprocess.run(
        [
            EXE,
            "generate",
            "--json",
            "--method",
            "mtad",
            "--max-tokens",
            "10",
            "--seed",
            "2",
            "--temperature",
            "0",
            "--chat",
            "What is 2+2?",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["method"] == "mtad" and out["tokens"] and "Traceback" not in proc.stderr


# The extras the README's first command does not install: it installs ".[models]" only.
EXTRAS_NOT_INSTALLED = ("bench", "serve", "export", "onnx")
# Runs the console script with the modules named in its first argument made unimportable.
WITHOUT_MODULES = (
    "import sys; [sys.modules.__setitem__(m, None) for m in sys.argv.pop(1).split(',')]; "
    "sys.argv[0] = 'mtad-edge'; from mtad_edge.console import main; main()"
)


def _requires(dist, extra=""):
    """The distributions `dist` requires, directly, with `extra` selected ("" for none)."""
    out = set()
    for line in importlib.metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            out.add(canonicalize_name(req.name))
    return out


@functools.cache
def extra_only_modules():
    """Top-level modules that only the extras above bring: what a `.[models]` install lacks."""
    base, todo = set(), list(_requires("mtad-edge") | _requires("mtad-edge", "models"))
    while todo:  # everything the core and the models extra pull in, transitively
        name = todo.pop()
        if name not in base and name != "mtad-edge":
            base.add(name)
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # another platform's
                todo.extend(_requires(name))
    extra = set().union(*(_requires("mtad-edge", e) for e in EXTRAS_NOT_INSTALLED)) - base
    return tuple(
        sorted(
            module
            for module, dists in importlib.metadata.packages_distributions().items()
            if module.isidentifier() and dists and all(canonicalize_name(d) in extra for d in dists)
        )
    )


def run_without_extras(*args, timeout=60):
    modules = extra_only_modules()
    assert {"uvicorn", "fastapi", "matplotlib", "onnxruntime", "torch"} <= set(modules)
    cmd = [sys.executable, "-c", WITHOUT_MODULES, ",".join(modules), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], *([c] for c in sorted(cli.commands))])
def test_every_command_starts_without_the_optional_extras(command):
    proc = run_without_extras(*command, "--help")
    assert proc.returncode == 0 and "Usage: mtad-edge" in proc.stdout, proc.stderr


def test_serve_without_its_extra_is_a_one_line_error():
    proc = run_without_extras("serve", "--port", "0")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("Error: the server needs its extra: pip install 'mtad-edge[serve]'")


@pytest.mark.slow
def test_readme_first_command_runs_without_the_optional_extras(smol_files):
    proc = run_without_extras(
        "generate", "--json", "--method", "mtad", "--max-tokens", "8", "--chat", "Explain beam search.", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["method"] == "mtad" and out["tokens"] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("taken", [True, False])
def test_serve_binds_its_port_before_loading_anything(monkeypatch, taken):
    pytest.importorskip("uvicorn")
    from mtad_edge.cli.options import ModelChoice

    def no_load(*args, **kwargs):
        raise AssertionError("loaded the models before binding the port")

    monkeypatch.setattr(ModelChoice, "engine", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        host = "127.0.0.1" if taken else "no-such-host.invalid"
        r = CliRunner().invoke(cli, ["serve", "--host", host, "--port", str(port)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: cannot listen on {host} port {port}: "), r.stderr


def test_every_stats_field_is_documented_in_one_table():
    """cli.md's stats table names every field of the JSON (`--json`, the server's mtad_stats)."""
    import re

    from mtad_edge.runtime.stats import Stats

    page = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    table = page.split("### Stats", 1)[1].split("\n## ", 1)[0]
    named = {
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`(\w+)`", row.split(" | ")[0])
    }
    assert set(Stats().to_dict()) <= named, set(Stats().to_dict()) - named
