"""The llama-server peer column of `mtad-edge bench` (bench/peer.py): a stand-in server
(fake_llama_server.py) for the requests, flags, parsing and failures; the real llama-server where
one is found."""

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import fake_llama_server
import pytest
from click.testing import CliRunner
from fake_llama_server import HELP

from mtad_edge.bench import peer
from mtad_edge.bench.report import report_markdown
from mtad_edge.cli import cli
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.errors import MtadEdgeError

FAKE = Path(fake_llama_server.__file__)


def fake_server(folder: Path, **config) -> tuple[Path, Path]:
    """An executable named llama-server that runs the stand-in with ``config``; returns it and the
    log of its starts and requests."""
    log = folder / "server-log.jsonl"
    (folder / "fake.json").write_text(json.dumps({"log": str(log), **config}))
    exe = folder / "llama-server"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "{folder / "fake.json"}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, log


def entries(log: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["kind"] == kind]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


PROMPTS = [{"id": "chat", "messages": [{"role": "user", "content": "Hi"}]}, {"id": "raw", "prompt": "Once"}]
IDS = [[1, 50, 51, 52], [1, 60]]


def column(exe: Path, aux: bool = True, **kw) -> peer.Column:
    base = DecodeConfig(max_tokens=6, sampling=SamplingConfig(temperature=0.7, top_k=10, top_p=0.9))
    return peer.Column(
        exe,
        Path("t.gguf"),
        Path("d.gguf") if aux else None,
        peer.check_binary(exe),
        base,
        PROMPTS,
        IDS,
        threads=2,
        n_ctx=512,
        flash_attn=False,
        **kw,
    )


def run_all(col: peer.Column, repeats: int = 2) -> None:
    for rep in range(repeats):
        for i in range(len(PROMPTS)):
            for position, slot in enumerate(col.hooks()):
                slot(i, rep, 1000 * rep + i, position)


def test_llama_servers_help_gives_its_draft_defaults_and_checks_our_flags(tmp_path):
    exe, _ = fake_server(tmp_path)
    defaults = peer.check_binary(exe)
    assert defaults == {"n_max": "3", "p_min": "0.00"}
    labels = [s.label for s in peer.settings(defaults)]
    assert labels == ["llama-server ar", "llama-server draft n-max 3 p-min 0", "llama-server draft n-max 8 p-min 0.5"]
    assert peer.settings({})[1].label == "llama-server draft its defaults"


def test_a_bad_llama_server_binary_is_a_one_line_error(tmp_path):
    with pytest.raises(MtadEdgeError, match="no such file"):
        peer.check_binary(tmp_path / "nope")
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(MtadEdgeError, match="cannot run it"):  # not executable
        peer.check_binary(plain)
    plain.chmod(plain.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(MtadEdgeError, match=r"not a llama-server that takes -m, -md, --spec-type"):
        peer.check_binary(plain)
    old, _ = fake_server(tmp_path, help="\n".join(ln for ln in HELP.splitlines() if "--spec-draft-" not in ln))
    with pytest.raises(MtadEdgeError, match="--spec-draft-n-max, --spec-draft-p-min"):
        peer.check_binary(old)


def test_the_column_asks_with_our_prompt_tokens_sampling_and_seeds_and_reads_the_timings(tmp_path):
    """One server at a time per prompt-run and setting, each with our threads, context, flash
    attention and one slot; the draft settings add the aux; the request carries our prompt ids,
    min-p 0, our sampler order and the run's seed; the timings become tok/s and acceptance."""
    exe, log = fake_server(tmp_path, ms_per_token={"plain": 10.0, "draft": 8.0})
    col = column(exe, score=lambda ids, tokens: [-0.5] * len(tokens))
    col.probe()
    run_all(col)
    starts, requests = entries(log, "start"), entries(log, "request")
    assert len(starts) == 1 + 2 * 2 * 3 and len(requests) == 2 * 2 * 3  # the probe, then a server per run
    assert all(gone(s["pid"]) for s in starts)
    for s in starts:
        args = s["argv"]
        assert args[args.index("-m") + 1] == "t.gguf" and args[args.index("-t") + 1] == "2"
        value = {flag: args[args.index(flag) + 1] for flag in ("-c", "-np", "-fa")}
        assert value == {"-c": "512", "-np": "1", "-fa": "off"}
        assert args[args.index("--host") + 1] == "127.0.0.1"
    by_setting = {}
    for r in requests:
        by_setting.setdefault(" ".join(a for a in r["argv"] if a.startswith("--spec")), []).append(r)
    plain, own, tuned = (
        by_setting[k] for k in ("", "--spec-type", "--spec-type --spec-draft-n-max --spec-draft-p-min")
    )
    assert len(plain) == len(own) == len(tuned) == 4 and all("-md" not in r["argv"] for r in plain)
    args = tuned[0]["argv"]
    assert args[args.index("-md") + 1] == "d.gguf" and args[args.index("--spec-type") + 1] == "draft-simple"
    assert (args[args.index("--spec-draft-n-max") + 1], args[args.index("--spec-draft-p-min") + 1]) == ("8", "0.5")
    assert args[args.index("-td") + 1] == "2"
    body = plain[1]["body"]
    assert body["prompt"] == IDS[1] and body["seed"] == 1 and body["n_predict"] == 6
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.7, 10, 0.9, 0.0)
    assert body["samplers"] == ["top_k", "temperature", "top_p"] and body["cache_prompt"] is False
    assert body["ignore_eos"] is False

    found = col.results([], {"ar": {"tokens_per_s": 50.0}})
    settings = found["settings"]
    assert list(settings) == [s.label for s in col.settings]
    ar, draft = settings["llama-server ar"], settings["llama-server draft n-max 8 p-min 0.5"]
    assert ar["tokens_per_s"] == pytest.approx(100.0) and draft["tokens_per_s"] == pytest.approx(125.0)
    assert ar["acceptance_rate"] is None and draft["acceptance_rate"] == pytest.approx(0.5)
    assert (ar["runs"], ar["generated"], ar["prompt_tokens_differ"]) == (4, 24, 0)
    assert ar["ppl"] == pytest.approx(2.718281828**0.5)
    assert found["x_llama_server_ar"]["ar"] == pytest.approx(0.5)
    assert found["x_llama_server_ar"]["llama-server draft n-max 8 p-min 0.5"] == pytest.approx(1.25)
    assert found["error"] is None and found["no_draft"] is None
    assert "-md d.gguf" in found["commands"]["llama-server draft n-max 3 p-min 0"]


def test_a_prompts_schema_goes_as_its_json_schema_and_the_answers_are_validated(tmp_path):
    pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}, "required": ["n"]}
    exe, log = fake_server(tmp_path, content='{"n": 3}')
    base = DecodeConfig(max_tokens=6)
    prompts = [{**PROMPTS[0], "schema": schema}, PROMPTS[1]]
    col = peer.Column(exe, Path("t.gguf"), None, peer.check_binary(exe), base, prompts, IDS, threads=2, n_ctx=512,
                      flash_attn=None)  # fmt: skip
    run_all(col, repeats=1)
    bodies = [r["body"] for r in entries(log, "request")]
    assert bodies[0]["json_schema"] == schema and "json_schema" not in bodies[1]
    found = col.results([], {})
    assert found["settings"]["llama-server ar"]["structured"] == {"runs": 1, "valid": 1, "validity": 1.0}
    assert "json_schema" not in found["request"]


def test_the_servers_weights_are_placed_as_ours(tmp_path):
    """--n-gpu-layers / --aux-gpu-layers become -ngl / -ngld (our -1, every layer, is its "all");
    unset, llama-server keeps its own default (auto: what fits)."""
    exe, _ = fake_server(tmp_path)
    placed = column(exe, gpu_layers=(-1, 0))
    plain, draft = (placed.command(s) for s in (placed.settings[0], placed.settings[-1]))
    assert plain[plain.index("-ngl") + 1] == "all" and "-ngld" not in plain
    assert draft[draft.index("-ngl") + 1] == "all" and draft[draft.index("-ngld") + 1] == "0"
    assert draft.index("-ngld") > draft.index("-md")
    some = column(exe, gpu_layers=(12, None)).command(placed.settings[-1])
    assert some[some.index("-ngl") + 1] == "12" and "-ngld" not in some
    default = column(exe).command(placed.settings[-1])
    assert "-ngl" not in default and "-ngld" not in default


def test_without_an_aux_or_a_draft_it_can_use_the_column_is_plain_decoding(tmp_path):
    exe, _ = fake_server(tmp_path)
    col = column(exe, aux=False)
    col.probe()
    assert [s.label for s in col.settings] == ["llama-server ar"] and col.no_draft == "the pair has no aux"
    exe, _ = fake_server(tmp_path, speculative=False)  # it loaded the aux and does not draft with it
    said = []
    col = column(exe, say=said.append)
    col.probe()
    assert [s.label for s in col.settings] == ["llama-server ar"] and "does not draft with this aux" in col.no_draft
    assert len(said) == 1 and "plain decoding only" in said[0]


def test_a_server_that_cannot_start_is_a_one_line_error_with_its_own_words(tmp_path):
    exe, log = fake_server(tmp_path, fail_start="llama_model_load: error loading model: tensor 'x' is corrupted")
    with pytest.raises(MtadEdgeError) as e:
        column(exe).probe()
    assert "exited while starting (exit 1)" in str(e.value) and "tensor 'x' is corrupted" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_servers_error_is_its_cause_and_its_last_word_on_one_line(tmp_path):
    """As llama-server logs a model it cannot load (its memory fit tries the load first)."""
    log = """0.00.002.010 I srv  llama_server: initializing ...
0.00.008.086 E gguf_init_from_reader: invalid magic characters: 'not ', expected 'GGUF'
0.00.008.255 E llama_model_load: error loading model: llama_model_loader: failed to load model from x.gguf
0.00.008.337 E common_fit_params: encountered an error while trying to fit params to free device memory
0.00.008.354 E gguf_init_from_reader: invalid magic characters: 'not ', expected 'GGUF'
0.00.008.369 E srv    load_model: failed to load model, 'x.gguf'
0.00.008.370 I srv    operator(): operator(): cleaning up before exit...
0.00.008.864 E srv  llama_server: exiting due to model loading error
"""
    with (tmp_path / "log").open("w+b") as f:
        f.write(log.encode())
        line = peer.Server(None, f, 0, []).last_line()
    cause, then = "gguf_init_from_reader: invalid magic characters: 'not ', expected 'GGUF'", "exiting due to model"
    assert line.startswith(cause) and then in line and "\n" not in line
    with (tmp_path / "log").open("w+b") as f:
        f.write(b"error: invalid argument: --bogus\n")
        assert peer.Server(None, f, 0, []).last_line() == "error: invalid argument: --bogus"


def test_a_port_taken_between_choosing_and_binding_is_tried_again(tmp_path):
    exe, log = fake_server(tmp_path, port_taken=2)
    col = column(exe)
    col.probe()
    assert len(entries(log, "start")) == 3 and col.start_s is not None


def test_a_server_that_dies_mid_run_stops_the_column_and_not_the_bench(tmp_path):
    exe, log = fake_server(tmp_path, die_at=4)
    said = []
    col = column(exe, say=said.append)
    col.probe()
    run_all(col)  # returns: nothing raised to the bench
    assert len(col.rows) == 3 and len(entries(log, "request")) == 4  # no server started after it
    assert col.error.startswith("llama-server ar, prompt 'raw': llama-server exited (exit 134) while answering")
    assert "GGML_ASSERT" in col.error and "\n" not in col.error and len(said) == 1
    assert all(gone(s["pid"]) for s in entries(log, "start"))
    assert col.results([], {})["error"] == col.error


def test_the_server_is_killed_on_ctrl_c(tmp_path):
    exe, _ = fake_server(tmp_path)
    with pytest.raises(KeyboardInterrupt), peer.Server.start([str(exe), "-m", "t.gguf"]) as server:
        pid = server.proc.pid
        raise KeyboardInterrupt
    assert gone(pid)


def test_the_report_puts_every_row_against_llama_servers_plain_decoding():
    def agg(speed, rate=None, **extra):
        return {"tokens_per_s": speed, "tokens_per_s_min": speed, "tokens_per_s_max": speed,
                "acceptance_rate": rate, "ppl": 3.0, **extra}  # fmt: skip

    server = {
        "llama-server ar": agg(40.0, drafted=0, accepted=0, prompt_tokens_differ=0),
        "llama-server draft n-max 3 p-min 0": agg(44.0, 0.5, drafted=20, accepted=10, prompt_tokens_differ=0),
    }
    block = {"binary": "/x/llama-server", "temperature": 1.0, "settings": server, "no_draft": None, "error": None}
    block["x_llama_server_ar"] = {
        "ar": 0.9,
        "mtad": 1.3,
        "llama-server ar": 1.0,
        "llama-server draft n-max 3 p-min 0": 1.1,
    }
    cfg = {"prompts": 2, "repeats": 1, "max_tokens": 8, "temperature": 1.0, "top_k": 10, "top_p": 0.9, "gamma": 4}
    cfg |= {"beam_width": 4, "accept_threshold": 0.5, "threads": 2}
    ours = {"tokens_per_s_min": 1.0, "tokens_per_s_max": 1.0, "ttft_s": None, "block_efficiency": None, "ppl": 3.0}
    ours |= {"cpu_s_per_token": None, "j_per_token": None, "peak_rss_mb": 1, "accept_length_hist": {}}
    methods = {"ar": {**ours, "tokens_per_s": 36.0, "acceptance_rate": None}}
    methods["mtad"] = {**ours, "tokens_per_s": 52.0, "acceptance_rate": 0.6}
    md = report_markdown({"pair": {"name": "fake"}, "config": cfg, "methods": methods, "llama_server": block})
    assert "| ar | 36.0 (1.0-1.0) | 0.90 | – | 3.00 |" in md and "| mtad | 52.0 (1.0-1.0) | 1.30 | 60.0% | 3.00 |" in md
    assert "| llama-server draft n-max 3 p-min 0 | 44.0 (44.0-44.0) | 1.10 | 50.0% | 3.00 |" in md
    assert "llama-server's drafted tokens kept: llama-server draft n-max 3 p-min 0: 10 of 20." in md


@pytest.mark.slow
def test_bench_with_a_llama_server_column_interleaves_it_and_keeps_our_results_when_it_dies(tmp_path, smol_files):
    exe, log = fake_server(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    args = ["bench", "--methods", "ar,sd", "--prompts", str(prompts), "--max-tokens", "4", "--repeats", "2"]
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, [*args, "--out", str(out), "--llama-server", str(exe)])
    assert r.exit_code == 0, r.output
    results = json.loads((out / "results.json").read_text())
    column = results["llama_server"]
    assert set(column["settings"]) == {"llama-server ar", "llama-server draft n-max 3 p-min 0",
                                       "llama-server draft n-max 8 p-min 0.5"}  # fmt: skip
    ours = {(r["prompt_id"], r["repeat"]): r for r in results["runs"] if r["label"] == "ar"}
    for run in column["runs"]:  # the same prompt tokens, in the prompt-run's order among our variants
        assert run["prompt_tokens"] == ours[run["prompt_id"], run["repeat"]]["prompt_tokens"]
        assert run["seed"] == ours[run["prompt_id"], run["repeat"]]["seed"]
    assert sorted({r["ran"] for r in column["runs"]} | {r["ran"] for r in results["runs"]}) == list(range(5))
    speed = column["settings"]["llama-server ar"]["tokens_per_s"]
    assert column["x_llama_server_ar"]["sd"] == pytest.approx(results["methods"]["sd"]["tokens_per_s"] / speed)
    assert "x llama-server ar" in (out / "report.md").read_text()
    assert all(gone(s["pid"]) for s in entries(log, "start"))

    (tmp_path / "dying").mkdir()
    exe, log = fake_server(tmp_path / "dying", die_at=3)
    out = tmp_path / "dies"
    r = CliRunner().invoke(cli, [*args, "--out", str(out), "--llama-server", str(exe)])
    last = r.output.strip().splitlines()[-1]  # after the report: our figures are all there
    assert r.exit_code == 1 and last.startswith("Error: the llama-server column is incomplete: "), r.output
    assert "exited (exit 134)" in last
    results = json.loads((out / "results.json").read_text())
    assert results["methods"]["sd"]["runs"] == 4 and results["llama_server"]["error"]
    assert len(results["llama_server"]["runs"]) == 2

    r = CliRunner().invoke(cli, [*args, "--out", str(out), "--llama-server", str(tmp_path / "missing")])
    assert r.exit_code == 1 and "--llama-server" in r.output and "no such file" in r.output


def real_llama_server() -> Path:
    """MTAD_EDGE_LLAMA_SERVER, else the native build's default place, else llama-server on the PATH."""
    import llama_cpp

    given = os.environ.get("MTAD_EDGE_LLAMA_SERVER")
    if given:
        return Path(given)
    tmp = os.environ.get("TMPDIR", "/tmp")
    for found in (
        Path(tmp) / f"native-llama.cpp-{llama_cpp.__version__}/build/bin/llama-server",
        shutil.which("llama-server"),
    ):
        if found and Path(found).is_file():
            return Path(found)
    pytest.skip("no llama-server: set MTAD_EDGE_LLAMA_SERVER to one built as docs/benchmarking.md shows")


@pytest.mark.slow
def test_bench_against_the_real_llama_server(tmp_path, smol_files):
    """Greedy on the default pair: llama-server's plain decoding counts our prompt tokens and
    gives our ar's tokens; its draft settings draft with our aux."""
    exe = real_llama_server()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The capital of France is"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    out = tmp_path / "out"
    args = ["bench", "--methods", "ar", "--prompts", str(prompts), "--max-tokens", "8", "--temperature", "0"]
    r = CliRunner().invoke(cli, [*args, "--ctx-size", "512", "--out", str(out), "--llama-server", str(exe)])
    assert r.exit_code == 0, r.output
    column = json.loads((out / "results.json").read_text())["llama_server"]
    ar = column["settings"]["llama-server ar"]
    assert ar["runs"] == 2 and ar["prompt_tokens_differ"] == 0 and ar["same_tokens_as_ar"] == 2
    for label, found in column["settings"].items():
        assert found["generated"] == 16 and found["tokens_per_s"] > 0
        assert (found["drafted"] > 0) == ("draft" in label)
