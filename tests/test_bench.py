"""`mtad-edge bench`: scoring, aggregation and the files it writes, on tiny real runs."""

import json
import math
import stat
import statistics

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import FakeLM, fake_engine
from mtad_edge.bench.energy import EnergyMeter
from mtad_edge.bench.native import llama_bench, speculative_simple
from mtad_edge.bench.run import projection, run_order, time_split
from mtad_edge.cli import cli
from mtad_edge.logprobs import token_logprobs
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.errors import MtadEdgeError
from mtad_edge.runtime.rules.sampling import log_softmax

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_token_logprobs_on_fake_model_equal_the_definition():
    lm = FakeLM(vocab=7, salt=9)
    prompt, gen = [1, 2, 3], [4, 0, 6, 6, 2]
    got = token_logprobs(lm, prompt, gen)
    want = [log_softmax(lm.logits_for(prompt + gen[:i]))[g] for i, g in enumerate(gen)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert lm.seqs[0] == prompt + gen[:-1]  # the cache holds the scored text, for the next request to reuse


@pytest.mark.slow
def test_token_logprobs_on_real_target_match_token_by_token_scoring(smol_models):
    t = smol_models.target
    prompt = t.tokenize("The capital of France is")
    gen = t.tokenize(" Paris, and it is known for the Eiffel Tower.", add_special=False)
    got = token_logprobs(t, prompt, gen)
    t.rollback(0, 0)
    t.decode(Batch.run(prompt[:-1], 0, logits="none"))
    want, ctx = [], list(prompt)
    for g in gen:  # one token per call: different kernels than the batched pass, same values
        row = np.array(t.decode(Batch.run(ctx[-1:], len(ctx) - 1)))[-1]
        want.append(log_softmax(row)[g])
        ctx.append(g)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05)
    assert np.exp(-np.mean(got)) == pytest.approx(float(np.exp(-np.mean(want))), rel=0.02)


def _prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"id": "raw", "prompt": "The three primary colors are"}\n\n'
        '{"messages": [{"role": "user", "content": "Name a fruit."}]}\n'
    )
    return f


@pytest.mark.slow
def test_bench_writes_consistent_results_report_and_plots(tmp_path, smol_files):
    out = tmp_path / "out"
    r = CliRunner().invoke(
        cli,
        [
            "bench",
            "--prompts",
            str(_prompts(tmp_path)),
            "--max-tokens",
            "8",
            "--repeats",
            "2",
            "--out",
            str(out),
            "--sweep",
            "--sweep-thresholds",
            "0.3",
            "--sweep-gammas",
            "2",
            "--sweep-widths",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert list(res["methods"]) == ["ar", "sd", "mtad"]
    for agg in res["methods"].values():
        for key in (
            "tokens_per_s",
            "block_efficiency",
            "acceptance_rate",
            "ppl",
            "cpu_s_per_token",
            "j_per_token",
            "peak_rss_mb",
        ):
            assert key in agg
        assert agg["tokens_per_s_min"] <= agg["tokens_per_s"] <= agg["tokens_per_s_max"]
        assert agg["ppl"] >= 1 and agg["cpu_s_per_token"] > 0 and agg["peak_rss_mb"] > 0
        assert agg["j_per_token"] is None if not EnergyMeter().available else agg["j_per_token"] > 0
        assert agg["block_efficiency"] == pytest.approx(agg["generated"] / agg["target_calls"])
    assert res["methods"]["ar"]["acceptance_rate"] is None and res["methods"]["ar"]["block_efficiency"] == 1
    assert res["ratios"]["vs_ar"]["ar"]["tokens_per_s"] == 1 and "vs_sd" in res["ratios"]
    # sampling not given: the pair's recommended, what a user gets (named in the report)
    manifest = "the pair's manifest"
    assert (res["config"]["temperature"], res["config"]["top_k"], res["config"]["top_p"]) == (0.7, 40, 0.95)
    assert res["config"]["recommended"] == {
        "temperature": [0.7, manifest],
        "top_k": [40, manifest],
        "top_p": [0.95, manifest],
    }
    runs = res["runs"]
    assert len(runs) == 2 * 2 * 3 and {r["prompt_id"] for r in runs} == {"raw", "p2"}
    for run in runs:
        assert run["accepted"] <= run["drafted"] and run["generated"] == len(run["tokens"]) <= 8
        assert run["block_efficiency"] == pytest.approx(run["generated"] / run["target_calls"])
        assert sum(run["accept_lengths"]) == run["accepted"]
    seeds = {(r["repeat"], r["prompt_id"]): set() for r in runs}
    for run in runs:
        seeds[(run["repeat"], run["prompt_id"])].add(run["seed"])
    assert all(len(s) == 1 for s in seeds.values())  # methods share a seed within a repeat
    # Rows come back in listed order; each prompt-run ran its variants in its own seeded order.
    assert [r["label"] for r in runs] == ["ar", "sd", "mtad"] * 4
    orders = [tuple(r["ran"] for r in runs[i : i + 3]) for i in range(0, 12, 3)]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert [tuple(run_order(3, r["seed"]).index(k) for k in range(3)) for r in runs[::3]] == orders
    assert len(res["sweep"]) == 4 and {s["beam_width"] for s in res["sweep"]} == {4, 2}
    # Prompt lookup's ceiling, from what a lookup draft could keep at each position of ar's texts.
    ceil = res["lookup_ceiling"]
    for run in runs:
        kept = run["lookup_kept"]
        assert (kept is None) == (run["label"] != "ar")
        if kept is not None:
            assert len(kept) == run["generated"]
            assert all(0 <= j <= min(ceil["gamma"], run["generated"] - i - 1) for i, j in enumerate(kept))
    assert ceil["gamma"] == 8 and ceil["block_efficiency"] >= 1 and ceil["x_ar"] > 0
    md = (out / "report.md").read_text()
    assert "| mtad |" in md and "MTAD sweep" in md and "Prompt lookup's ceiling on ar's texts" in md
    assert "took the model's recommended values: temperature 0.7 (the pair's manifest), top_k 40" in md
    said = r.stdout.splitlines()  # the terminal gets the summary: the main figures, bars and the verdict
    assert said[1].split() == ["variant", "tok/s", "x", "ar", "acceptance", "PPL"] and said[-1].startswith("Verdict: ")
    assert [line.split()[0] for line in said[2:5]] == ["ar", "sd", "mtad"] and said[-1] in md
    from mtad_edge.runtime.backends.llama_cpp_backend import uses_amx

    machine = res["machine"]
    assert machine["amx"] == uses_amx() and set(machine["kernels"]) == {"target", "aux"}
    assert machine["kernels"]["target"] == {"amx": 0, "repacked": 0}  # F16: nothing for AMX or repacking
    aux = machine["kernels"]["aux"]
    assert ("This CPU has AMX" in md) == uses_amx()
    if uses_amx():  # the Q4_0 aux goes to AMX where the build runs it, else to the repacked kernels
        assert (aux["amx"] > 0) != (aux["repacked"] > 0)
        assert ("build's AMX kernels do not run" in md) == (aux["repacked"] > 0)
    for png in ("bench.png", "sweep.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
        import matplotlib.pyplot as plt

        assert plt.imread(out / png).ndim == 3


def test_run_order_is_a_seeded_permutation_that_moves_every_variant():
    orders = [run_order(6, seed) for seed in range(40)]
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert orders == [run_order(6, seed) for seed in range(40)]  # the same seed, the same order
    for k in range(6):  # each variant runs first, and last, for some prompts
        assert any(o[0] == k for o in orders) and any(o[-1] == k for o in orders)


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{oops\n", "line 1: not JSON"),
        ('{"text": "x"}\n', "needs a 'prompt'"),
        ("\n", "no prompts"),
        ('{"prompt": "a"}\n{"n": ' + "9" * 5000 + "}\n", "line 2: not JSON (a number over 4300 digits long)"),
        ("[" * 30000 + "]" * 30000, "line 1: not JSON (nested too deeply)"),  # was a RecursionError traceback
        (b'{"prompt": "\xff"}\n', "not UTF-8 text"),  # was a UnicodeDecodeError traceback
        # these two failed only when their prompt's turn came, after the prompts before it had run
        ('{"prompt": "a"}\n{"prompt": ""}\n', "line 2: the 'prompt' is empty"),
        ('{"prompt": "a"}\n{"prompt": "\\udcff"}\n', "line 2: the 'prompt' is not valid UTF-8 text: b'\\xff'"),
        ('{"prompt": "a", "schema": "object"}\n', "line 1: the 'schema' must be a JSON schema object"),
    ],
)
def test_bad_prompts_file_is_a_one_line_error(tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    r = CliRunner().invoke(cli, ["bench", "--prompts", str(f), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_a_prompt_that_cannot_run_fails_before_the_prompts_before_it_run(tmp_path, smol_files, command, monkeypatch):
    """A prompt longer than the context (or as long: it leaves no room to answer), or chat messages
    that do not render, ended a bench or a tune when their turn came, after the prompts before them
    had run. (One that fitted the context but not mtad's step, its beams' cells, did too; the
    context now holds --ctx-size tokens whatever the method, and the step's cells come on top.)"""
    import mtad_edge.bench.run as bench_run

    ran = []
    monkeypatch.setattr(bench_run, "measure", lambda *a, **k: ran.append(a) or pytest.fail("a run started"))
    pair = ["--target", str(smol_files.target), "--aux", str(smol_files.aux), "--ctx-size", "64"]
    out = [] if command == "tune" else ["--out", str(tmp_path / "o"), "--methods", "ar,mtad"]
    for second, needle in [
        ('{"prompt": "' + "word " * 300 + '"}', "prompt 'p2' has 301 tokens, and the context holds 64 with the answer"),
        ('{"prompt": "' + "word " * 63 + '"}', "prompt 'p2' has 64 tokens, and the context holds 64 with the answer"),
        ('{"messages": [{"role": "user", "content": "\\udcff"}]}', "prompt 'p2': each message's content is not valid"),
    ]:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"prompt": "Once upon a time"}\n' + second + "\n")
        r = CliRunner().invoke(cli, [command, *pair, "--prompts", str(prompts), "--max-tokens", "8", *out])
        assert r.exit_code == 1 and needle in r.stderr and "Traceback" not in r.output, r.output
    assert ran == [] and not (tmp_path / "o" / "results.json").exists()


@pytest.mark.parametrize("methods", ["beams", "ar,nope", ","])
def test_bad_methods_are_usage_errors(methods):
    r = CliRunner().invoke(cli, ["bench", "--methods", methods])
    assert r.exit_code == 2 and "--methods" in r.output


def _fake_tool(folder, name, stdout="", stderr=""):
    """Stand-ins that print what llama.cpp's tools print, to test the parsing and plumbing."""
    path = folder / name
    path.write_text(f"#!/bin/sh\ncat <<'OUT'\n{stdout}\nOUT\ncat >&2 <<'ERR'\n{stderr}\nERR\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_native_tool_output_is_parsed(tmp_path):
    _fake_tool(tmp_path, "llama-bench", stdout=json.dumps([{"avg_ts": 140.5, "stddev_ts": 0.5, "n_gen": 128}]))
    _fake_tool(
        tmp_path,
        "llama-speculative-simple",
        stderr=(
            "main: some log\nencoded   19 tokens in    0.039 seconds, speed:  483.239 t/s\n"
            "decoded  261 tokens in    3.538 seconds, speed:   73.775 t/s\n"
            "n_draft   = 4\nn_predict = 261\nn_drafted = 327\nn_accept  = 179\naccept    = 54.740%"
        ),
    )
    b = llama_bench(tmp_path, tmp_path / "t.gguf", 128, 2)
    assert b["tokens_per_s"] == 140.5
    args = b["command"].split()
    assert args[args.index("-d") + 1] == "0"  # no prompt: tg from an empty cache

    s = speculative_simple(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", "hi", 256, 2, 4)
    assert (s["generated"], s["tokens_per_s"], s["drafted"], s["accepted"]) == (261, 73.775, 327, 179)
    assert s["acceptance_rate"] == pytest.approx(179 / 327)


def test_native_tools_run_with_our_targets_flash_attention(tmp_path):
    """Peers compare only at the same setting: -fa as our target's context runs, none where
    llama.cpp decided for it too."""
    _fake_tool(tmp_path, "llama-bench", stdout=json.dumps([{"avg_ts": 140.5}]))
    for on, value in ((False, "off"), (True, "on"), (None, None)):
        args = llama_bench(tmp_path, tmp_path / "t.gguf", 128, 2, flash_attn=on)["command"].split()
        assert (args[args.index("-fa") + 1] if "-fa" in args else None) == value
    log = tmp_path / "args"
    tool = tmp_path / "llama-speculative-simple"
    tool.write_text(f'#!/bin/sh\necho "$@" > {log}\necho "decoded  8 tokens in 0.100 seconds, speed: 80.000 t/s" >&2\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    speculative_simple(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", "hi", 8, 2, 4, flash_attn=False)
    args = log.read_text().split()
    assert args[args.index("-fa") + 1] == "off"


def test_llama_bench_uses_amx_where_our_target_does(tmp_path, monkeypatch):
    """On AMX machines llama-bench runs without its extra buffer types, as our models load,
    unless AMX multiplies our target's weights (a build whose AMX kernels run)."""
    from mtad_edge.bench import native

    _fake_tool(tmp_path, "llama-bench", stdout=json.dumps([{"avg_ts": 140.5}]))
    for machine, ours, repack_off in ((True, False, True), (True, True, False), (False, False, False)):
        monkeypatch.setattr(native, "uses_amx", lambda machine=machine: machine)
        b = llama_bench(tmp_path, tmp_path / "t.gguf", 128, 2, amx=ours)
        args = b["command"].split()
        assert (args[args.index("--repack") + 1] == "0" if "--repack" in args else False) == repack_off
        assert b["amx"] == ours


def test_llama_bench_is_measured_after_as_many_cached_tokens_as_our_runs(tmp_path):
    """Our tok/s is measured after the prompt; llama-bench's tg after -d cached tokens is its peer
    (and tg after none is kept beside it); output it cannot read is a one-line error."""
    entries = [{"n_depth": 0, "avg_ts": 62.0, "stddev_ts": 0.4}, {"n_depth": 23, "avg_ts": 60.5, "stddev_ts": 0.5}]
    _fake_tool(tmp_path, "llama-bench", stdout=json.dumps(entries))
    b = llama_bench(tmp_path, tmp_path / "t.gguf", 128, 2, depth=23)
    assert "-d 0,23" in b["command"]
    assert (b["tokens_per_s"], b["depth"], b["tokens_per_s_depth_0"]) == (60.5, 23, 62.0)
    _fake_tool(tmp_path, "llama-bench", stdout="not json")
    with pytest.raises(MtadEdgeError, match="llama-bench printed no result"):
        llama_bench(tmp_path, tmp_path / "t.gguf", 128, 2, depth=23)


@pytest.mark.slow
def test_bench_native_column_lands_in_results_and_report(tmp_path, smol_files):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_tool(bin_dir, "llama-bench", stdout=json.dumps([{"avg_ts": 140.5, "stddev_ts": 0.5}]))
    _fake_tool(
        bin_dir,
        "llama-speculative-simple",
        stderr="decoded  8 tokens in    0.100 seconds, speed:   80.000 t/s\nn_drafted = 8\nn_accept  = 6",
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n')
    out = tmp_path / "out"
    r = CliRunner().invoke(
        cli,
        [
            "bench",
            "--methods",
            "ar",
            "--prompts",
            str(prompts),
            "--max-tokens",
            "4",
            "--repeats",
            "2",
            "--gamma",
            "4",
            "--out",
            str(out),
            "--llama-cpp-bin",
            str(bin_dir),
        ],
    )
    assert r.exit_code == 0, r.output
    native = json.loads((out / "results.json").read_text())["native"]
    assert native["llama-bench tg target"]["tokens_per_s"] == 140.5
    assert native["llama-bench tg target"]["tokens_per_s_runs"] == [140.5] * 3  # before the repeats and after each
    assert "-fa off" in native["llama-bench tg target"]["command"]  # as the default pair runs on a CPU
    report_md = (out / "report.md").read_text()
    ar = json.loads((out / "results.json").read_text())["methods"]["ar"]["tokens_per_s"]
    assert f"ar runs {ar / 140.5:.3f}x llama-bench's tg" in report_md
    spec = native["speculative-simple temp 0, draft 4"]
    assert spec["tokens_per_s"] == pytest.approx(80.0) and spec["acceptance_rate"] == pytest.approx(0.75)
    assert "Native llama.cpp" in (out / "report.md").read_text()


def test_ar_against_llama_bench_pairs_each_repeat_with_the_runs_beside_it():
    """The machine's speed drifts: repeat r is compared with llama-bench's runs just before and
    just after it, and the ratio is the median over repeats; runs that do not bracket every
    repeat give none."""
    from mtad_edge.bench.native import against_tg, pooled

    assert against_tg([90.0, 60.0, 80.0], [100.0, 100.0, 50.0, 100.0]) == pytest.approx(0.9)  # 0.9, 0.8, 1.07
    assert against_tg([90.0], [100.0]) is None and against_tg([], []) is None
    runs = [{"tokens_per_s": t, "tokens_per_s_depth_0": t + 1, "depth": 23} for t in (100.0, 50.0)]
    assert pooled(runs) == {
        **runs[-1],
        "tokens_per_s": 75.0,
        "tokens_per_s_depth_0": 76.0,
        "tokens_per_s_runs": [100.0, 50.0],
    }


@pytest.mark.slow
def test_bench_variants_quality_and_the_plain_decoding_curve(tmp_path, smol_files):
    """--gammas, --ar-temperatures and --variant expand into labelled variants on the same prompts
    and seeds; every variant gets pooled quality figures and a place against the ar curve."""
    from mtad_edge.bench.quality import run_counts

    out = tmp_path / "out"
    args = ["bench", "--prompts", str(_prompts(tmp_path)), "--max-tokens", "12", "--out", str(out)]
    args += ["--temperature", "1", "--methods", "ar,mtad,beam", "--gammas", "2,auto", "--ar-temperatures", "1,0.5"]
    args += ["--variant", "mmtad w=2 thr=0.3"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "'ar T=1' is the same request as 'ar'" in r.stderr
    res = json.loads((out / "results.json").read_text())
    labels = ["ar", "mtad g=2", "mtad g=auto", "beam g=2", "beam g=auto", "ar T=0.5", "mmtad w=2 thr=0.3"]
    assert list(res["methods"]) == labels and [v["label"] for v in res["variants"]] == labels
    assert res["variants"][6] == {
        "label": labels[6],
        "method": "mmtad",
        "options": {"beam_width": 2, "accept_threshold": 0.3},
    }
    runs = res["runs"]
    assert len(runs) == 2 * len(labels)
    for run in runs:
        assert run["generated"] == len(run["tokens"]) and run_counts(run["tokens"]).items() <= run.items()
    for label, agg in res["methods"].items():
        mine = [x for x in runs if x["label"] == label]
        assert {x["seed"] for x in mine} == {x["seed"] for x in runs}  # the same seeds for every variant
        assert agg["method"] == mine[0]["method"] and agg["temperature"] == (0.5 if label == "ar T=0.5" else 1.0)
        ngrams = sum(x["ngrams_2"] for x in mine)
        assert agg["distinct_2"] == pytest.approx(sum(x["unique_2"] for x in mine) / ngrams)
        assert agg["mean_length"] == pytest.approx(sum(x["generated"] for x in mine) / 2)
        assert 0 <= agg["rep_4"] <= 1 and 0 < agg["distinct_1"] <= 1 and "se" in agg
    for x in runs:
        if x["method"] == "beam":
            gamma = 2 if x["label"] == "beam g=2" else 4  # 'auto': beam's fixed window of 4
            assert x["target_calls"] == gamma * -(-x["generated"] // gamma) or x["finish_reason"] == "stop"
            assert x["drafted"] == 0 and x["accept_lengths"] == []
    auto, fixed = res["methods"]["mtad g=auto"], res["methods"]["mtad g=2"]
    assert sum(auto["gamma_hist"].values()) == auto["target_calls"] and auto["predicted_tokens_per_s"] > 0
    # a fixed gamma of 2 drafts 2, but 1 and then none where max_tokens leaves 2 and 1 (at most once each a run)
    short = {g: n for g, n in fixed["gamma_hist"].items() if g != "2"}
    assert sum(fixed["gamma_hist"].values()) == fixed["target_calls"] and fixed["predicted_tokens_per_s"] is None
    assert set(short) <= {"0", "1"} and all(n <= fixed["runs"] for n in short.values())
    assert res["methods"]["beam g=auto"]["width_hist"] is None or res["methods"]["beam g=auto"]["width_hist"] == {}
    front = res["frontier"]
    assert [p["label"] for p in front["curve"]] == sorted(["ar", "ar T=0.5"], key=lambda k: res["methods"][k]["ppl"])
    assert set(front["variants"]) == set(labels) - {"ar", "ar T=0.5"}
    for p in front["variants"].values():
        assert p["verdict"] in ("beyond", "behind", "mixed", "outside")
    md = (out / "report.md").read_text()
    pairs = {(r["variant"], r["against"]): r for r in res["paired"]}
    row = pairs[("mtad g=auto", "mtad g=2")]
    assert row["runs"] == len(res["runs"]) // len(labels) and row["speed"]["ratio"] > 0 and row["ppl"]["ratio"] > 0
    assert "| mtad g=auto | mtad g=2 |" in md
    assert "| beam g=auto |" in md and "distinct-2" in md and "ar T at same PPL" in md and "| mtad g=auto |" in md
    for png in ("bench.png", "quality.png", "gammas.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    "args,hint",
    [
        (["--gammas", "2,0"], "--gammas"),
        (["--ar-temperatures", "1,hot"], "--ar-temperatures"),
        (["--variant", "mtad zz=1"], "--variant"),
    ],
)
def test_bad_variant_options_are_usage_errors(args, hint):
    r = CliRunner().invoke(cli, ["bench", *args])
    assert r.exit_code == 2 and hint in r.output


def test_auto_is_paired_with_each_fixed_setting_on_the_same_prompt_runs():
    """Ratios of pooled tok/s and PPL over the prompt-runs both variants made, with a bootstrap
    interval: exact where every prompt-run agrees, wide where they scatter."""
    from mtad_edge.bench.paired import paired

    def run(label, prompt, repeat, seconds, logprob_sum=-64.0):
        return {"label": label, "prompt_id": prompt, "repeat": repeat, "generated": 64, "decode_s": seconds,
                "logprob_sum": logprob_sum}  # fmt: skip

    keys = [(p, r) for p in ("a", "b", "c") for r in (0, 1)]
    runs = [run("ar", p, r, 2.0) for p, r in keys] + [run("sd g=2", p, r, 2.5) for p, r in keys]
    runs += [run("sd g=auto", p, r, 2.0 / 1.1, -64.0 * 1.2) for p, r in keys]  # 1.1x ar's speed everywhere
    runs += [run("mtad g=4", p, r, 1.0 + i) for i, (p, r) in enumerate(keys)]
    runs += [run("mtad g=auto", p, r, 1.0 + (len(keys) - 1 - i)) for i, (p, r) in enumerate(keys)]  # scattered
    runs += [run("mtad g=auto", "d", 0, 1.0)]  # a prompt-run the fixed setting did not make
    rows = {(r["variant"], r["against"]): r for r in paired(runs)}
    assert set(rows) == {("sd g=auto", "ar"), ("sd g=auto", "sd g=2"), ("mtad g=auto", "mtad g=4")}
    ar = rows[("sd g=auto", "ar")]
    assert ar["runs"] == 6 and ar["speed"] == pytest.approx({"ratio": 1.1, "low": 1.1, "high": 1.1})
    assert ar["ppl"]["ratio"] == pytest.approx(math.exp(0.2))
    assert rows[("sd g=auto", "sd g=2")]["speed"]["ratio"] == pytest.approx(1.1 * 1.25)
    assert ar["speed_median"] == pytest.approx(1.1)
    mtad = rows[("mtad g=auto", "mtad g=4")]
    assert mtad["runs"] == 6 and mtad["speed"]["ratio"] == pytest.approx(1.0)
    assert mtad["speed"]["low"] < 0.9 and mtad["speed"]["high"] > 1.1
    # per-run ratios (1+i)/(6-i) for i = 0..5: 1/6, 2/5, 3/4, 4/3, 5/2, 6; their median is (3/4 + 4/3) / 2
    assert mtad["speed_median"] == pytest.approx((3 / 4 + 4 / 3) / 2)


def test_one_stalled_prompt_run_moves_the_pooled_ratio_and_not_the_median():
    """Where the variants tie on every prompt-run but one, in which the auto variant stalled at half
    its speed, the pooled ratio falls and the median of per-run ratios stays at 1."""
    from mtad_edge.bench.paired import paired

    keys = [(p, r) for p in "abcdef" for r in (0, 1)]
    runs = [{"label": "mtad g=3", "prompt_id": p, "repeat": r, "generated": 96, "decode_s": 1.5} for p, r in keys]
    runs += [
        {
            "label": "mtad g=auto",
            "prompt_id": p,
            "repeat": r,
            "generated": 96,
            "decode_s": 3.0 if (p, r) == ("a", 0) else 1.5,
        }
        for p, r in keys
    ]
    (row,) = paired(runs)
    assert row["speed"]["ratio"] == pytest.approx(12 * 1.5 / (11 * 1.5 + 3.0)) and row["speed"]["ratio"] < 0.93
    assert row["speed_median"] == pytest.approx(1.0) and row["ppl"] is None


def test_report_and_quality_plot_from_aggregates(tmp_path):
    """report.md's quality and frontier tables and quality.png, from hand-made aggregates."""
    from mtad_edge.bench.quality import frontier
    from mtad_edge.bench.report import plot_quality, report_markdown

    def agg(method, t, ppl, d2, r4, **extra):
        speed = {"tokens_per_s": 50.0, "tokens_per_s_min": 49.0, "tokens_per_s_max": 51.0, "ttft_s": 0.01}
        rates = {"block_efficiency": 1.0, "acceptance_rate": None, "cpu_s_per_token": 0.02, "j_per_token": None}
        figures = {"distinct_1": 0.5, "distinct_2": d2, "distinct_3": 0.9, "rep_4": r4, "mean_length": 90.0}
        se = {"se": {"ppl": 0.05, "distinct_2": 0.01, "rep_4": 0.01}}
        return {"method": method, "temperature": t, "ppl": ppl, "peak_rss_mb": 300, **speed, **rates, **figures,
                **se, "accept_length_hist": {}, **extra}  # fmt: skip

    forecast = {"predicted_tokens_per_s": 60.0, "predicted_over_realised": 1.18}
    methods = {
        "ar": agg("ar", 1.0, 3.0, 0.85, 0.05),
        "ar T=0.6": agg("ar", 0.6, 2.0, 0.75, 0.13),
        "mtad": agg("mtad", 1.0, 2.2, 0.70, 0.16, gamma_hist={"2": 3, "4": 5}, **forecast),
        "sd": agg("sd", 1.0, 3.0, 0.85, 0.05, gamma_hist={"4": 8}, predicted_tokens_per_s=None),
        "beam T=0": agg("beam", 0.0, 1.5, 0.5, 0.3),
    }
    cfg = {"prompts": 8, "repeats": 3, "max_tokens": 96, "temperature": 1.0, "top_k": 10, "top_p": 0.9, "gamma": 4}
    cfg |= {"beam_width": 4, "accept_threshold": 0.5, "threads": 2}
    results = {"pair": {"name": "fake"}, "config": cfg, "methods": methods, "frontier": frontier(methods)}
    md = report_markdown(results)
    assert "| mtad | 1 | 2.20 ± 0.05 | 0.500 | 0.700 ± 0.010 | 0.900 | 0.160 ± 0.010 | 90.0 |" in md
    assert "| mtad | 2.20 | 0.68 | 0.700 (0.770, -0.070*) | 0.160 (0.114, +0.046*) | behind |" in md
    assert "| beam T=0 | 1.50 | < 0.6 (lowest PPL) |" in md and "| mtad | 2: 3, 4: 5 | – | 60.0 | 50.0 | 1.18 |" in md
    assert "| sd | 4: 8 | – | – | 50.0 | – |" in md  # a fixed gamma beside the adaptive one
    png = plot_quality(tmp_path, results)
    assert png is not None and png.read_bytes().startswith(PNG_MAGIC)


def test_report_says_whether_amx_multiplied_the_pairs_weights():
    from mtad_edge.bench.report import _amx_line

    on = {"target": {"amx": 0, "repacked": 0}, "aux": {"amx": 8, "repacked": 0}}
    assert _amx_line({"amx": True, "kernels": on}) == [
        "",
        "This CPU has AMX: llama.cpp multiplied 8 of the aux's matrix kinds with it.",
    ]
    broken = {"target": {"amx": 0, "repacked": 0}, "aux": {"amx": 0, "repacked": 7}}
    assert "build's AMX kernels do not run" in _amx_line({"amx": True, "kernels": broken})[1]
    floats = {"target": {"amx": 0, "repacked": 0}, "aux": None}  # an F16 model alone, or an ONNX aux
    assert "none of the pair's matrices" in _amx_line({"amx": True, "kernels": floats})[1]
    assert _amx_line({"amx": False, "kernels": on}) == [] and _amx_line({}) == []  # no AMX, or an older results.json


@pytest.mark.slow
def test_bench_reports_drafting_across_vocabularies(tmp_path, gemma_files, smol_files):
    """An aux with another tokenizer: each drafting run records the share of its tokens the aux
    could draft and the re-tokenisations; the aggregate weights the share by length, ar has none."""
    out, prompts = tmp_path / "out", tmp_path / "raw.jsonl"  # this Gemma GGUF has no chat template
    prompts.write_text('{"prompt": "The three primary colors are"}\n{"prompt": "def fibonacci(n):"}\n')
    args = ["bench", "--prompts", str(prompts), "--max-tokens", "10", "--out", str(out)]
    args += ["--target", str(gemma_files.target), "--aux", str(smol_files.aux), "--methods", "ar,sd,mtad"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    for run in res["runs"]:  # the aux drafter's own counters (Stats.drafters)
        if run["method"] == "ar":
            assert "aux" not in run["drafters"]
        else:
            aux = run["drafters"]["aux"]
            assert 0.5 < aux["vocab_mapped_share"] <= 1 and aux["vocab_resyncs"] >= 0
    for m in ("sd", "mtad"):
        mine = [(x["drafters"]["aux"]["vocab_mapped_share"], x["generated"]) for x in res["runs"] if x["method"] == m]
        want = sum(share * n for share, n in mine) / sum(n for _, n in mine)
        assert res["methods"][m]["drafters"]["aux"]["vocab_mapped_share"] == pytest.approx(want)
    assert res["methods"]["ar"]["drafters"] is None
    assert "Across vocabularies" in (out / "report.md").read_text()


def test_projection_prices_every_target_call_at_ars_one_row_call():
    methods = {
        "ar": {"generated": 100, "decode_s": 10.0, "target_s": 8.0, "target_calls": 100, "draft_s": 0.0},
        "mtad": {"generated": 100, "decode_s": 8.0, "target_s": 5.0, "target_calls": 30, "draft_s": 2.0},
    }
    proj = projection(methods)
    # one row: 8 s / 100 calls; mtad: 8 - 5 + 30 x 0.08 = 5.4 s for its 100 tokens
    assert proj["ar"]["tokens_per_s"] == pytest.approx(10.0) and proj["ar"]["x_ar"] == pytest.approx(1.0)
    assert proj["mtad"]["tokens_per_s"] == pytest.approx(100 / 5.4)
    assert proj["mtad"]["x_ar"] == pytest.approx(10 / 5.4)
    assert projection({"mtad": methods["mtad"]}) == {}  # nothing to price a call at without ar
    split = time_split(methods["mtad"])
    assert split == pytest.approx({"target_ms": 50.0, "aux_ms": 20.0, "rest_ms": 10.0})


def test_size_curve_reads_earlier_runs_by_target_size(tmp_path):
    def run(name, params, mtad, projected, standin=None):
        return {
            "pair": {"name": name, "target_parameters": params, "standin": standin},
            "ratios": {"vs_ar": {"ar": {"tokens_per_s": 1.0}, "mtad": {"tokens_per_s": mtad}}},
            "projection": {"ar": {"x_ar": 1.0}, "mtad": {"x_ar": projected}},
        }

    runs = [run("x4", 1.9e9, 1.6, 2.5, {"factor": 4}), run("base", 1.35e8, 0.55, 2.2), run("unsized", None, 9, 9)]
    for i, r in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "results.json").write_text(json.dumps(r))
    out = tmp_path / "curve"
    res = CliRunner().invoke(
        cli, ["bench", *sum((["--curve", str(tmp_path / str(i))] for i in range(3)), []), "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    md = (out / "sizes.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| base") or ln.startswith("| x4")]
    assert rows == [
        "| base | 0.14 B | 1.00 [1.00] | 0.55 [2.20] |",
        "| x4 (stand-in) | 1.90 B | 1.00 [1.00] | 1.60 [2.50] |",
    ]
    assert (out / "sizes.png").read_bytes().startswith(PNG_MAGIC)
    bad = CliRunner().invoke(cli, ["bench", "--curve", str(tmp_path), "--out", str(out)])
    assert bad.exit_code == 1 and "cannot read" in bad.output and "Traceback" not in bad.output
    # a results.json of another shape was a KeyError / TypeError / AttributeError traceback
    for other, problem in [
        ({"a": 1}, "no pair name"),
        ([1], "no pair name"),
        ({"pair": {"name": "x", "target_parameters": "2B"}}, "target_parameters is not a number"),
        ({"pair": {"name": "x"}, "ratios": {"vs_ar": 3}}, "ratios.vs_ar is not a table of numbers"),
        ({"pair": {"name": "x"}, "projection": {"ar": {"x_ar": "1"}}}, "projection is not a table of numbers"),
    ]:
        (tmp_path / "3").mkdir(exist_ok=True)
        (tmp_path / "3" / "results.json").write_text(json.dumps(other))
        bad = CliRunner().invoke(cli, ["bench", "--curve", str(tmp_path / "3"), "--out", str(out)])
        assert bad.exit_code == 1 and problem in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output


# -- an independent judge (bench --judge) ---------------------------------------------------------
class MergingLM(FakeLM):
    """A fake judge whose tokenizer adds BOS (0), reads a-z as 1..26 and merges "st" into 27, so a
    prompt ending in "s" and an answer starting with "t" share a token across the boundary."""

    def __init__(self, **kw):
        super().__init__(vocab=28, salt=5, **kw)

    def tokenize(self, text, add_special=True):
        out, i = [0] if add_special else [], 0
        while i < len(text):
            if text.startswith("st", i):
                out.append(27)
                i += 2
            else:
                out.append(ord(text[i]) - ord("a") + 1)
                i += 1
        return out

    def apply_chat_template(self, messages, template=None, add_assistant=True):
        from mtad_edge.runtime.errors import ModelLoadError

        raise ModelLoadError("no chat template")


def _direct(lm, ids, k):
    """The judge's log p of ids[k:] after ids[:k], one context at a time (the definition)."""
    return sum(float(log_softmax(lm.logits_for(ids[:i]))[ids[i]]) for i in range(k, len(ids)))


def test_judge_scores_the_answer_beyond_the_common_prefix_of_its_own_tokens():
    from mtad_edge.bench.judge import Judge, continuation
    from mtad_edge.pairs import Pair

    lm = MergingLM()
    context, answer = continuation(lm, "abes", "tday")
    assert context == [0, 1, 2, 5] and answer == [27, 4, 1, 25]  # "s" + "t" merged: scored as the answer's
    judge = Judge(lm, Pair(None, None), "fake")
    got = judge.score("abes", "tday")
    full = lm.tokenize("abestday")
    assert got["judge_tokens"] == 4 and got["judge_truncated"] is False
    assert got["judge_logprob_sum"] == pytest.approx(_direct(lm, full, 4), abs=1e-9)
    assert got["judge_logprob_sum"] == pytest.approx(float(token_logprobs(lm, context, answer).sum()), abs=1e-12)
    assert got["judge_ppl"] == pytest.approx(math.exp(-got["judge_logprob_sum"] / 4))
    assert judge.score("abes", "")["judge_tokens"] == 0 and judge.score("a", "")["judge_ppl"] is None
    short = Judge(MergingLM(n_ctx=6), Pair(None, None), "fake").score("abes", "tday")  # room for 2 of 4
    assert short["judge_tokens"] == 2 and short["judge_truncated"] is True
    assert short["judge_logprob_sum"] == pytest.approx(_direct(lm, full[:6], 4), abs=1e-9)
    # A chat prompt: the judge's own template, else (as this one, which has none) the pair's text
    assert judge.prompt_text({"prompt": "raw"}, "ignored") == "raw" and judge.chat_prompts is None
    assert judge.prompt_text({"messages": [{"role": "user", "content": "hi"}]}, "<pair>hi") == "<pair>hi"
    assert judge.chat_prompts == "pair"
    templated = Judge(FakeLM(vocab=7, salt=3), Pair(None, None), "fake")
    assert templated.prompt_text({"messages": [{"role": "user", "content": "hi"}]}, "x") == "<user>hi<assistant>"
    assert templated.chat_prompts == "judge"


def test_bench_runs_are_scored_by_the_judge_and_pooled_per_variant(tmp_path):
    """run_bench with a judge on fake models: each run's judge figures equal the judge's own
    log-probs of the run's text after the prompt; aggregate pools them; ratios and the frontier
    at equal judge PPL follow."""
    from helpers import fake_engine
    from mtad_edge.bench.judge import Judge
    from mtad_edge.bench.quality import frontier
    from mtad_edge.bench.run import BenchConfig, aggregate, run_bench
    from mtad_edge.bench.variants import Variant
    from mtad_edge.pairs import Pair
    from mtad_edge.textstream import detokenize

    engine = fake_engine(max_tokens=6)
    lm = FakeLM(vocab=11, salt=7)
    judge = Judge(lm, Pair(None, None), "fake")
    prompts = [{"id": "a", "prompt": "abc"}, {"id": "b", "messages": [{"role": "user", "content": "dd"}]}]
    variants = (Variant("ar", "ar"), Variant("ar T=0.5", "ar", {"temperature": 0.5}), Variant("sd", "sd"))
    cfg = BenchConfig(variants=variants, repeats=2, decode=engine.defaults)
    rows = run_bench(engine, prompts, cfg, judge=judge)
    target = engine._require_open().target
    for r in rows:
        item = prompts[0] if r["prompt_id"] == "a" else prompts[1]
        prompt = item.get("prompt", "<user>dd<assistant>")  # a chat: FakeLM's own template
        ids = lm.tokenize(prompt + detokenize(target, r["tokens"]))
        k = len(lm.tokenize(prompt))
        assert r["judge_tokens"] == len(ids) - k == r["generated"]  # one character per token on both sides
        assert r["judge_logprob_sum"] == pytest.approx(_direct(lm, ids, k), abs=1e-9)
    agg = aggregate(rows, {v.label: v for v in variants})
    for label, a in agg.items():
        mine = [r for r in rows if r["label"] == label]
        want = math.exp(-sum(r["judge_logprob_sum"] for r in mine) / sum(r["judge_tokens"] for r in mine))
        assert a["judge_ppl"] == pytest.approx(want) and a["se"]["judge_ppl"] is not None
        assert a["judge_tokens"] == sum(r["judge_tokens"] for r in mine) and a["judge_truncated"] == 0
    from mtad_edge.bench.run import ratios

    assert ratios(agg)["vs_ar"]["sd"]["judge_ppl"] == pytest.approx(agg["sd"]["judge_ppl"] / agg["ar"]["judge_ppl"])
    front = frontier(agg)
    assert {p["label"] for p in front["judge"]["curve"]} == {"ar", "ar T=0.5"}
    assert set(front["judge"]["variants"]) == {"sd"}


def test_report_shows_the_judge_beside_the_target_and_what_is_within_noise(tmp_path):
    """report.md with a judge: its PPL beside the target's, the frontier at equal judge PPL, and the
    smallest resolvable gap; quality.png gets a row by the judge's PPL."""
    from mtad_edge.bench.quality import frontier, resolution
    from mtad_edge.bench.report import plot_quality, report_markdown

    def agg(method, t, ppl, judge_ppl, d2, r4):
        speed = {"tokens_per_s": 50.0, "tokens_per_s_min": 49.0, "tokens_per_s_max": 51.0, "ttft_s": 0.01}
        rates = {"block_efficiency": 1.0, "acceptance_rate": None, "cpu_s_per_token": 0.02, "j_per_token": None}
        figures = {"distinct_1": 0.5, "distinct_2": d2, "distinct_3": 0.9, "rep_4": r4, "mean_length": 90.0}
        se = {"se": {"ppl": 0.05, "judge_ppl": 0.2, "distinct_2": 0.01, "rep_4": 0.01}}
        judge = {"judge_ppl": judge_ppl, "judge_truncated": 0, "runs": 96}
        return {"method": method, "temperature": t, "ppl": ppl, "peak_rss_mb": 300, **judge, **speed, **rates,
                **figures, **se, "accept_length_hist": {}}  # fmt: skip

    methods = {
        "ar": agg("ar", 1.0, 3.0, 12.0, 0.85, 0.05),
        "ar T=0.6": agg("ar", 0.6, 2.0, 9.0, 0.75, 0.13),
        "mtad": agg("mtad", 1.0, 2.2, 11.0, 0.78, 0.10),
    }
    cfg = {"prompts": 24, "repeats": 4, "max_tokens": 128, "temperature": 1.0, "top_k": 10, "top_p": 0.9}
    cfg |= {"gamma": 4, "beam_width": 4, "accept_threshold": 0.5, "threads": 2, "judge": {"name": "gemma3-270m"}}
    results = {"pair": {"name": "fake"}, "config": cfg, "methods": methods, "frontier": frontier(methods)}
    results["resolution"] = resolution(methods)
    md = report_markdown(results)
    assert (
        "scored by gemma3-270m, a model that took no part" in md
        and "| variant | T | PPL | judge PPL | distinct-1 |" in md
    )
    assert "| mtad | 1 | 2.20 ± 0.05 | 11.00 ± 0.20 | 0.500 | 0.780 ± 0.010 |" in md
    assert "| mtad | 2.20 | 0.68 | 0.780 (0.770, +0.010) | 0.100 (0.114, -0.014) | beyond |" in md  # target PPL
    assert "Against plain decoding at the same judge PPL (the ar curve, judge PPL by temperature: " in md
    assert "| mtad | 11.00 | 0.87 | 0.780 (0.817, -0.037*) | 0.100 (0.077, +0.023) | behind |" in md
    assert "Gaps below 0.028 in distinct-2, 0.028 in rep-4, 0.14 in PPL, 0.57 in judge PPL are within noise" in md
    assert "(96 runs each)" in md and "held" not in md  # no run was cut short by the judge's context
    png = plot_quality(tmp_path, results)
    assert png is not None and png.read_bytes().startswith(PNG_MAGIC)
    import matplotlib.pyplot as plt

    assert plt.imread(png).shape[0] > plt.imread(png).shape[1] * 0.6  # two rows: by the target's PPL and the judge's


@pytest.mark.parametrize(
    "judge,words",
    [
        ("no-such-pair", "--judge no-such-pair: unknown pair 'no-such-pair'"),
        ("{tmp}/notes.txt", "is not a GGUF file"),
        ("{tmp}", "a folder; the judge is a pair name or a GGUF file"),
        ("{tmp}/missing.gguf", "no such file"),
    ],
)
def test_a_bad_judge_is_a_one_line_error_before_anything_loads(tmp_path, judge, words):
    (tmp_path / "notes.txt").write_text("not a model\n")
    r = CliRunner().invoke(cli, ["bench", "--judge", judge.format(tmp=tmp_path), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and words in r.output and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.slow
def test_bench_with_an_independent_judge(tmp_path, smol_files, gemma_files):
    """The default pair judged by Gemma 3 270M: every run carries the judge's figures, each
    variant its pooled judge PPL, and the frontier a section at equal judge PPL."""
    out, prompts = tmp_path / "out", tmp_path / "one.jsonl"
    prompts.write_text('{"id": "sky", "messages": [{"role": "user", "content": "Why is the sky blue?"}]}\n')
    args = ["bench", "--prompts", str(prompts), "--max-tokens", "8", "--out", str(out), "--methods", "ar,mtad"]
    r = CliRunner().invoke(cli, [*args, "--judge", "gemma3-270m"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    judge = res["config"]["judge"]
    assert judge["name"] == "gemma3-270m" and judge["model"] == str(gemma_files.target)
    assert judge["n_vocab"] == 262144 and judge["chat_prompts"] == "judge" and judge["same_as_target"] is False
    assert judge["n_ctx"] >= 8 * 4
    for run in res["runs"]:
        assert 0 < run["judge_tokens"] <= 4 * run["generated"] and run["judge_truncated"] is False
        assert run["judge_logprob_sum"] < 0
        assert run["judge_ppl"] == pytest.approx(math.exp(-run["judge_logprob_sum"] / run["judge_tokens"]))
    for label, agg in res["methods"].items():
        (run,) = [x for x in res["runs"] if x["label"] == label]
        assert agg["judge_ppl"] == pytest.approx(run["judge_ppl"]) and agg["judge_tokens"] == run["judge_tokens"]
    front = res["frontier"]["judge"]
    assert [p["label"] for p in front["curve"]] == ["ar"] and set(front["variants"]) == {"mtad"}
    assert "| judge PPL |" in (out / "report.md").read_text()


def test_the_controllers_forecast_is_pooled_and_compared_repeat_by_repeat():
    """aggregate's predicted tok/s is each repeat's expected tokens over expected seconds (its runs
    pooled, as the realised speed is), and predicted / realised the median of the per-repeat
    ratios; a variant the controller did not plan (ar) has neither."""
    from helpers import fake_engine
    from mtad_edge.bench.run import BenchConfig, aggregate, run_bench
    from mtad_edge.bench.variants import Variant

    engine = fake_engine(max_tokens=8)
    prompts = [{"id": "a", "prompt": "abc"}, {"id": "b", "prompt": "dd"}]
    variants = (Variant("ar", "ar"), Variant("sd", "sd"), Variant("mtad", "mtad"))
    rows = run_bench(engine, prompts, BenchConfig(variants=variants, repeats=3, decode=engine.defaults))
    agg = aggregate(rows, {v.label: v for v in variants})
    assert agg["ar"]["predicted_tokens_per_s"] is None and agg["ar"]["predicted_over_realised"] is None
    for label in ("sd", "mtad"):
        pooled, ratio = [], []
        for rep in range(3):
            mine = [r for r in rows if r["label"] == label and r["repeat"] == rep]
            assert all(r["predicted_s"] > 0 for r in mine)
            forecast = sum(r["predicted_tokens"] for r in mine) / sum(r["predicted_s"] for r in mine)
            realised = sum(r["generated"] for r in mine) / sum(r["decode_s"] for r in mine)
            pooled.append(forecast)
            ratio.append(forecast / realised)
        assert agg[label]["predicted_tokens_per_s"] == pytest.approx(statistics.median(pooled))
        assert agg[label]["predicted_over_realised"] == pytest.approx(statistics.median(ratio))
        assert agg[label]["tokens_per_s_repeats"] == pytest.approx([f / r for f, r in zip(pooled, ratio)])


def test_an_output_folder_that_cannot_be_made_is_a_one_line_error_before_any_run(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = CliRunner().invoke(cli, ["bench", "--methods", "ar", "--max-tokens", "1", "--out", str(blocker / "o")])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot make the output folder"), r.stderr
    assert "Not a directory" in lines[0] and blocker.read_text() == ""


def test_each_variants_drafting_share_and_its_spread_over_repeats_are_reported():
    """As the issue's two runs minutes apart (sd drafted 387 tokens, then 65, at the same
    acceptance): every variant that drafted gets its drafted share, its share of drafting steps
    and its drafted tokens per repeat with their spread, in results and report, llama-server's
    settings beside ours; a repeat that drafted far less than the others shows in the spread."""
    from helpers import fake_engine
    from mtad_edge.bench.peer import aggregate as peer_aggregate
    from mtad_edge.bench.report import report_markdown
    from mtad_edge.bench.run import BenchConfig, aggregate, run_bench
    from mtad_edge.bench.variants import Variant

    engine = fake_engine(max_tokens=12)
    prompts = [{"id": "a", "prompt": "abc"}, {"id": "b", "prompt": "dd"}]
    # fixed gammas: gamma 'auto' on the fake pair's real (microsecond) timings may not draft at all
    variants = (Variant("ar", "ar"), Variant("sd", "sd", {"gamma": 2}), Variant("mtad g=3", "mtad", {"gamma": 3}))
    rows = run_bench(engine, prompts, BenchConfig(variants=variants, repeats=3, decode=engine.defaults))
    agg = aggregate(rows, {v.label: v for v in variants})
    assert agg["ar"]["drafted_repeats"] == [0, 0, 0] and agg["ar"]["drafting_steps_share"] == 0
    for label in ("sd", "mtad g=3"):
        mine = [[r for r in rows if r["label"] == label and r["repeat"] == k] for k in range(3)]
        drafted = [sum(r["drafted"] for r in rr) for rr in mine]
        steps = [sum(sum(r["gamma_hist"].values()) for r in rr) for rr in mine]
        drafting = [sum(len(r["accept_lengths"]) for r in rr) for rr in mine]  # a verified draft a drafting step
        a = agg[label]
        assert a["drafted_repeats"] == drafted and sum(drafted) > 0
        assert a["drafted_share"] == pytest.approx(sum(drafted) / a["generated"])
        assert a["drafting_steps_share_repeats"] == pytest.approx([d / s for d, s in zip(drafting, steps)])
    assert agg["mtad g=3"]["drafting_steps_share"] > 0.5  # a fixed gamma drafts but at a run's last token

    def run(rep, drafted):
        return {"repeat": rep, "generated": 384, "decoded": 383, "decode_s": 9.0, "drafted": drafted, "accepted": 0}

    peer_rows = [run(0, 387), run(1, 65), run(2, 380)]
    for r in peer_rows:
        r.update(logprob_sum=None, tokens=[], start_s=0.1, prompt_tokens=5, prompt_sent=5)
    flip = peer_aggregate(peer_rows)
    assert flip["drafted_repeats"] == [387, 65, 380] and flip["drafted_spread"] == pytest.approx((387 - 65) / 380)
    assert "drafting_steps_share" not in flip  # llama-server does not say how many steps it made

    cfg = {"prompts": 2, "repeats": 3, "max_tokens": 12, "temperature": 1.0, "top_k": 10, "top_p": 0.9, "gamma": "auto"}
    cfg |= {"beam_width": 4, "accept_threshold": 0.5, "threads": 2}
    peer = {"binary": "llama-server", "temperature": 1.0, "settings": {"llama-server draft": flip}}
    md = report_markdown({"pair": {"name": "fake"}, "config": cfg, "methods": agg, "llama_server": peer})
    table = md.split("Drafting share")[1].split("\n\n")[1]  # after the header's paragraph
    assert "| sd | " in table and "| mtad g=3 | " in table and "| ar | " not in table  # ar drafted nothing
    assert "| llama-server draft | 72% (17%-101%) | – | 387, 65, 380 | 85% |" in table


# -- a bench that talks: the verdict, the table in the terminal, a chart without matplotlib -------
def _talking(speeds: dict[str, float], ppl: dict[str, float] | None = None) -> dict:
    from mtad_edge.bench.run import ratios

    methods = {
        m: {"tokens_per_s": v, "acceptance_rate": None if m == "ar" else 0.5, "ppl": (ppl or {}).get(m, 3.0)}
        | {"cpu_s_per_token": 0.01, "j_per_token": None, "block_efficiency": 1.0}
        for m, v in speeds.items()
    }
    return {"methods": methods, "ratios": ratios(methods)}


@pytest.mark.parametrize(
    "speeds,verdict",
    [
        (
            {"ar": 50.0, "sd": 55.0, "mtad": 70.0},
            "Verdict: mtad is 1.40x as fast as plain decoding (ar) here; sd 1.10x. mtad's text: 0.80x ar's perplexity.",
        ),
        ({"ar": 50.0, "mtad": 51.0}, "Verdict: mtad runs about as fast as plain decoding (ar) here (1.02x)."),
        (
            {"ar": 54.2, "sd": 54.0, "mtad": 36.9},
            "Verdict: sd runs about as fast as plain decoding (ar) here (1.00x); mtad 0.68x.",
        ),
        (
            {"ar": 54.2, "sd": 40.0, "mtad": 36.9},
            "Verdict: nothing beat plain decoding (ar) here: the fastest, sd, ran 0.74x its speed",
        ),
        ({"sd": 5.0, "mtad": 6.0}, "Verdict: no plain decoding (ar) ran, so there is nothing to compare"),
    ],
)
def test_the_verdict_says_the_run_in_plain_words(speeds, verdict):
    from mtad_edge.bench.report import verdict as said

    assert said(_talking(speeds, {"ar": 3.0, "mtad": 2.4})).startswith(verdict)


def test_the_verdict_says_what_auto_decoded_with():
    from mtad_edge.bench.report import verdict as said
    from mtad_edge.bench.run import aggregate

    results = _talking({"ar": 6.0, "auto": 13.4, "sd": 11.5})
    results["methods"]["auto"]["chose"] = {"mtad": 6}
    assert said(results).startswith("Verdict: auto (as mtad) is 2.23x as fast as plain decoding (ar) here; sd 1.92x.")
    results["methods"]["auto"]["chose"] = {"sd": 2, "mtad": 4}
    assert "auto (as mtad 4, sd 2) is 2.23x" in said(results)
    t = FakeLM(salt=1, n_seq_max=9)
    engine = fake_engine(t, FakeLM(salt=2, n_seq_max=9), max_tokens=6)
    from mtad_edge.bench.run import BenchConfig, run_bench
    from mtad_edge.bench.variants import Variant

    variants = (Variant("ar", "ar"), Variant("auto", "auto"))
    rows = run_bench(engine, [{"id": "a", "prompt": "abc"}], BenchConfig(variants=variants, decode=engine.defaults))
    agg = aggregate(rows, {v.label: v for v in variants})
    assert agg["ar"]["chose"] is None and sum(agg["auto"]["chose"].values()) == 1
    assert next(iter(agg["auto"]["chose"])) in ("sd", "mtad")


def test_the_terminal_summary_and_the_text_chart():
    from mtad_edge.bench.report import summary_text, text_chart

    results = _talking({"ar": 50.0, "sd": 25.0, "mtad": 37.5})
    chart = text_chart(results["methods"], results["ratios"]["vs_ar"])
    assert chart[0] == "ar    " + "█" * 30 + "  50.0 tok/s  1.00x ar"
    assert chart[1] == "sd    " + "█" * 15 + " " * 17 + "25.0 tok/s  0.50x ar"
    assert chart[2].startswith("mtad  " + "█" * 22 + "▌ ") and chart[2].endswith("37.5 tok/s  0.75x ar")
    lines = summary_text(results).splitlines()
    assert lines[0].split() == ["variant", "tok/s", "x", "ar", "acceptance", "PPL"]
    assert lines[1].split() == ["ar", "50.0", "1.00", "–", "3.00"] and lines[3].split()[:3] == ["mtad", "37.5", "0.75"]
    assert lines[5:8] == chart and lines[-1].startswith("Verdict: nothing beat plain decoding")


def test_the_report_explains_its_terms_and_charts_in_text_without_matplotlib():
    from mtad_edge.bench.report import COLUMNS, report_markdown

    results = _talking({"ar": 50.0, "mtad": 60.0})
    for m, a in results["methods"].items():
        a.update(tokens_per_s_min=a["tokens_per_s"], tokens_per_s_max=a["tokens_per_s"], ttft_s=0.01)
        a.update(peak_rss_mb=100, method=m)
    cfg = {"prompts": 1, "repeats": 1, "max_tokens": 8, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "gamma": 4}
    cfg |= {"beam_width": 4, "accept_threshold": 0.5, "threads": 2, "recommended": {"temperature": [0.7, "pm"]}}
    results.update(pair={"name": "fake"}, config=cfg)
    md = report_markdown(results, chart=True).splitlines()
    table_end = md.index("| mtad | 60.0 (60.0-60.0) | 1.20 | – | 0.010 | 1.00 | 50.0% | 3.00 | 1.00 | 0.0100 "
                         "| n/a (no GPU) | 100 |")  # fmt: skip
    assert md[2].startswith("Verdict: mtad is 1.20x as fast") and md[table_end + 2] == COLUMNS
    for term in ("**block eff.** (block efficiency)", "**acceptance**", "**PPL** (perplexity)", "**x ar**"):
        assert term in COLUMNS
    assert md[table_end + 4 : table_end + 7] == ["```text", md[table_end + 5], md[table_end + 6]]
    assert "Options not given took the model's recommended values: temperature 0.7 (pm)." in md[4]
    assert "```text" not in report_markdown(results)  # with matplotlib: the plots


def test_bench_writes_each_run_into_a_new_dated_folder(tmp_path, monkeypatch):
    import re

    vs_ar = {"ar": {"tokens_per_s": 1.0}, "mtad": {"tokens_per_s": 0.7}}
    run = {"pair": {"name": "x", "target_parameters": 1e8}, "ratios": {"vs_ar": vs_ar}}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "results.json").write_text(json.dumps(run))
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the same minute: the second takes -2, nothing is overwritten
        r = CliRunner().invoke(cli, ["bench", "--curve", "in"])
        assert r.exit_code == 0, r.output
    made = sorted(p.name for p in (tmp_path / "bench-out").iterdir())
    assert len(made) == 2 and re.fullmatch(r"\d{4}-\d\d-\d\d-\d{4}", made[0]) and made[1] in (made[0] + "-2",)
    assert all((tmp_path / "bench-out" / m / "sizes.md").is_file() for m in made)


def test_the_structured_set_has_20_schemas_of_every_kind_and_each_compiles():
    """--prompts structured: each prompt's schema is a valid JSON schema, compiles for a vocabulary,
    and the set has what the issue asks for (nested objects, bounded arrays, enums, ranges,
    optional fields, anyOf, string formats)."""
    jsonschema = pytest.importorskip("jsonschema")
    from helpers import ASCII
    from mtad_edge.bench.run import load_prompts
    from mtad_edge.runtime.text import constraint as C

    prompts = load_prompts("structured")
    assert len(prompts) >= 20 and all("schema" in p and "messages" in p for p in prompts)
    text = json.dumps([p["schema"] for p in prompts])
    for word in ('"properties": {"', '"maxItems"', '"enum"', '"minimum"', '"anyOf"', '"format": "date"', '"email"'):
        assert word in text, word
    assert any(set(p["schema"].get("properties", {})) - set(p["schema"].get("required", [])) for p in prompts)
    vocab = FakeLM(alphabet=ASCII)
    for p in prompts:
        jsonschema.validators.validator_for(p["schema"]).check_schema(p["schema"])
        C.compile(C.Grammar.json_schema(p["schema"], strict=True), vocab)  # strict: nothing in it is ignored


def test_structured_runs_report_validity_the_forced_share_and_the_mask_share(tmp_path):
    """run_bench with schemas on fake models: every answer that ended 'stop' validates; the rows and
    the aggregate count valid answers, the forced drafter's share and the masks' time; the report
    has a table of them, llama-server's rows beside ours."""
    pytest.importorskip("jsonschema")
    from helpers import ASCII, fake_engine
    from mtad_edge.bench.report import report_markdown
    from mtad_edge.bench.run import BenchConfig, aggregate, run_bench, structured, valid_json
    from mtad_edge.bench.variants import Variant

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    assert valid_json('{"n": 3}', schema) and not valid_json('{"n": 30}', schema) and not valid_json("{", schema)
    assert valid_json('"a@b.c"', {"format": "email"}) and not valid_json('"ab"', {"format": "email"})
    cents = {"type": "number", "multipleOf": 0.01}  # decimals as JSON writes them (0.07 / 0.01 is not 7.0 in floats)
    assert valid_json("0.07", cents) and not valid_json("0.071", cents) and valid_json("2.0", {"type": "integer"})
    t = FakeLM(salt=1, n_seq_max=9, alphabet=ASCII, sharpness=2.0)
    engine = fake_engine(t, FakeLM(salt=2, n_seq_max=9, alphabet=ASCII), max_tokens=40)
    prompts = [{"id": "a", "prompt": "x", "schema": schema}, {"id": "b", "prompt": "y", "schema": {"enum": ["yes"]}}]
    cfg = BenchConfig(variants=(Variant("ar", "ar"), Variant("sd", "sd")), repeats=2, decode=engine.defaults)
    rows = run_bench(engine, prompts, cfg)
    assert all(r["valid"] == (r["finish_reason"] == "stop") and r["mask_s"] > 0 for r in rows), rows
    agg = aggregate(rows)
    st = agg["ar"]["structured"]
    assert st["runs"] == 4 and st["valid"] == sum(r["valid"] for r in rows if r["label"] == "ar")
    assert 0 < st["mask_share"] < 1 and st["forced_share"] is None  # no forced drafter among these
    forced_rows = [{**r, "drafters": {"forced": {"drafted": 5, "accepted": 5}}} for r in rows if r["label"] == "ar"]
    assert structured(forced_rows, {"forced": {}})["forced_share"] == pytest.approx(
        20 / sum(r["generated"] for r in forced_rows)
    )
    peer = {"settings": {"llama-server ar": {"structured": {"runs": 4, "valid": 3, "validity": 0.75}}}}
    cfg = {"prompts": 2, "repeats": 2, "max_tokens": 40, "temperature": 1.0, "top_k": 10, "top_p": 0.9, "gamma": 4}
    cfg |= {"beam_width": 4, "accept_threshold": 0.5, "threads": 2}
    md = report_markdown({"pair": {"name": "p"}, "config": cfg, "methods": agg, "ratios": {}, "llama_server": None})
    assert "Structured answers" in md and f"| ar | {st['valid']} of 4" in md
    from mtad_edge.bench.report import _structured_table

    assert "| llama-server ar | 3 of 4 (75%) | – | – | – |" in _structured_table({}, peer)
