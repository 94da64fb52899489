"""`mtad-edge tune`: the floor rule, the cache that carries a floor to later requests, and a real
run on the default pair."""

import json
import math

import pytest
from click.testing import CliRunner

from mtad_edge import floors, tune
from mtad_edge.cli import cli
from mtad_edge.pairs import Pair
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.errors import OptionError


@pytest.mark.parametrize(
    "within,floor",
    [
        ({3: 0.9}, 3),  # 2 not measured: no further
        ({3: 0.9, 2: 0.6}, 3),
        ({3: 0.79}, 4),
        ({3: 1.0, 2: 0.8, 1: 0.1}, 2),  # the confidence itself passes
        ({3: 1.0, 2: 0.95, 1: 0.85}, 1),
        ({2: 1.0}, 4),  # a gap: 3 was never shown to pass
        ({3: math.nan, 2: 1.0}, 4),
    ],
)
def test_the_floor_is_the_shortest_gamma_whose_every_longer_one_was_shown_within_the_bound(within, floor):
    assert tune.choose(within, 4, 0.8) == floor


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Two model files and a private cache dir for floors."""
    monkeypatch.setattr(floors, "folder", lambda: tmp_path / "cache" / "floors")
    target, aux = tmp_path / "t.gguf", tmp_path / "a.gguf"
    target.write_bytes(b"target")
    aux.write_bytes(b"aux")
    return Pair(target, aux)


def sampled(**kw):
    return DecodeConfig("mtad", gamma="auto", **kw)


def test_a_saved_floor_reaches_the_requests_it_was_measured_for_and_no_other(files):
    cfg = sampled()
    assert floors.floor_for(files, cfg) is cfg  # nothing measured: the method's own floor
    floors.save(files, cfg, {"floor": 2})
    assert floors.floor_for(files, cfg).gamma_min == 2
    assert floors.floor_for(files, sampled(gamma_max=3)).gamma_min == 2  # gamma_max does not change the text
    assert floors.floor_for(files, sampled(gamma_min=3)).gamma_min == 3  # the request's own wins
    unrelated = [
        sampled(sampling=SamplingConfig(0.7, 10, 0.9)),  # other sampling options
        sampled(accept_threshold=0.3),
        sampled(beam_width=2),
        sampled(beam_width="auto"),
        sampled(sampling=SamplingConfig(0.0, 10, 0.9)),  # greedy
        DecodeConfig("mtad", gamma=4),  # a fixed gamma
        DecodeConfig("sd", gamma="auto"),
        DecodeConfig("mmtad", gamma="auto"),
    ]
    for other in unrelated:
        assert floors.floor_for(files, other) is other, other
    files.aux.write_bytes(b"a requantised aux")  # other model files: measured for something else
    assert floors.floor_for(files, cfg) is cfg


def test_a_floor_is_capped_by_gamma_max_and_a_damaged_record_is_ignored(files):
    cfg = sampled(gamma_max=2)
    floors.save(files, cfg, {"floor": 3})
    assert floors.floor_for(files, cfg).gamma_min == 2
    for bad in ({"floor": 9}, {"floor": "3"}, {"floor": 0}, {"floor": True}, {}):
        floors.save(files, cfg, bad)
        assert floors.floor_for(files, cfg) is cfg, bad
    floors.path_for(files, cfg).write_text("{not json")
    assert floors.floor_for(files, cfg) is cfg


@pytest.mark.parametrize(
    "cfg,needle",
    [
        (DecodeConfig("sd"), "sd has no quality floor"),
        (DecodeConfig("mtad", sampling=SamplingConfig(0.0, 10, 0.9)), "temperature 0 is greedy"),
        (DecodeConfig("mtad", beam_width="auto"), "give --beam-width N"),
    ],
)
def test_what_cannot_be_tuned_says_why(cfg, needle):
    with pytest.raises(OptionError, match=needle):
        tune.check_tunable(cfg)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--temperature", "0"], "temperature 0 is greedy"),
        (["--beam-width", "auto"], "give --beam-width N"),
        (["--method", "sd"], "--method"),
        (["--bound", "0.9"], "--bound"),
        (["--confidence", "1"], "--confidence"),
        (["--prompts", "/nonexistent.jsonl"], "cannot read prompts file"),
    ],
)
def test_tune_cli_bad_input_is_one_line(args, needle):
    r = CliRunner().invoke(cli, ["tune", *args])
    assert r.exit_code in (1, 2) and needle in r.output and "Traceback" not in r.output, r.output


@pytest.mark.slow
def test_tune_measures_saves_and_auto_starts_from_the_floor(smol_files, tmp_path, monkeypatch):
    """The real default pair on two prompts: gammas 4, 3, ... measured on the same seeds until one
    is over the bound, the floor the shortest within it, the ratios those of the pooled PPLs; then
    the engine's 'auto' requests for the same options draft no shorter than that floor."""
    from mtad_edge import Engine

    monkeypatch.setattr(floors, "folder", lambda: tmp_path / "floors")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n{"prompt": "The best way to learn"}\n')
    pair = ["--target", str(smol_files.target), "--aux", str(smol_files.aux), "--ctx-size", "256"]
    small = ["--prompts", str(prompts), "--repeats", "1", "--max-tokens", "16", "--bound", "1.3", "--confidence", "0.6"]
    r = CliRunner().invoke(cli, ["tune", *pair, *small])
    assert r.exit_code == 0, r.output
    [path] = (tmp_path / "floors").glob("*.json")
    record = json.loads(path.read_text())
    gammas = {int(g): row for g, row in record["gammas"].items()}
    assert record["reference"] == 4 and record["prompt_runs"] == 2 and 4 in gammas
    assert sorted(gammas, reverse=True) == list(range(4, 4 - len(gammas), -1))
    within = {g: row["within"] for g, row in gammas.items() if g < 4}
    for g in within:
        ratio = gammas[g]["ppl_ratio"]["ratio"]
        assert ratio == pytest.approx(gammas[g]["ppl"] / gammas[4]["ppl"])
        low, high = gammas[g]["ppl_ratio"]["low"], gammas[g]["ppl_ratio"]["high"]
        assert low - 1e-9 <= ratio <= high + 1e-9  # half the resamples of two runs are the pair itself
        # two runs a, b: half the resamples are ab or ba, whose ratio is the pooled one
        assert within[g] > 0.45 if ratio <= 1.3 else within[g] < 0.55
    assert all(0 < row["generated"] <= 2 * 16 and row["tokens_per_s"] > 0 for row in gammas.values())
    shortest = min(gammas)
    assert shortest == 1 or within[shortest] < 0.6  # stopped at the first not shown within, or at 1
    assert all(within[g] >= 0.6 for g in within if g > shortest)
    assert record["floor"] == tune.choose(within, 4, 0.6) and record["confidence"] == 0.6
    assert f"at least {record['floor']}" in r.output and "saved to" in r.output

    with Engine.load(target=str(smol_files.target), aux=str(smol_files.aux), n_ctx=256, gamma="auto") as engine:
        for method, floor in (("mtad", record["floor"]), ("mmtad", 4)):  # mmtad was not tuned
            resp = engine.generate("Once upon a time", method=method, max_tokens=40, temperature=1.0, seed=3)
            resp.text()
            hist = resp.stats.gamma_hist
            assert resp.stats.gamma_min == floor and sum(hist.values()) == resp.stats.target_calls
            # shorter only in the last steps, where max_tokens leaves fewer than floor + 1 (each commits one or more)
            assert sum(n for g, n in hist.items() if g < floor) <= floor, hist
        own = engine.generate("Once upon a time", method="mtad", max_tokens=8, temperature=1.0, gamma_min=5)
        own.text()
        assert own.stats.gamma_min == 5


def test_a_cache_that_refuses_the_floor_is_one_line_naming_it(smol_files, tmp_path, monkeypatch):
    """After minutes of measuring, an unwritable cache was an OSError traceback and the record was lost."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(floors, "folder", lambda: blocker / "floors")  # under a file: NotADirectoryError
    record = {"floor": 2, "reference": 4, "gammas": {}}
    monkeypatch.setattr(tune, "tune", lambda *a, **k: record)
    pair = ["--target", str(smol_files.target), "--aux", str(smol_files.aux), "--ctx-size", "64"]
    r = CliRunner().invoke(cli, ["tune", *pair, "--json"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "floor 2 measured, but the cache refused it: Not a directory" in r.output
    assert json.loads(r.stdout.splitlines()[0]) == record  # the measurement is not lost
