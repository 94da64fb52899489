"""Quality metrics (distinct-n, rep-4), their pooling, the plain-decoding curve and bench
variants: exact values on hand-made token lists and aggregates."""

import math

import pytest

from mtad_edge.bench.quality import (
    distinct,
    distinct_counts,
    frontier,
    place,
    quality,
    rep,
    repeat_counts,
    resolution,
    run_counts,
)
from mtad_edge.bench.variants import capacity, expand, parse_spec
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.errors import OptionError

ABAB = [1, 2, 1, 2, 1, 2]


def test_distinct_n_by_hand():
    assert distinct_counts(ABAB, 1) == (2, 6)
    assert distinct_counts(ABAB, 2) == (2, 5)  # (1,2) (2,1) (1,2) (2,1) (1,2)
    assert distinct_counts(ABAB, 3) == (2, 4)
    assert distinct([5, 6, 7, 8, 9], 2) == 1.0
    assert distinct([3, 3, 3], 1) == pytest.approx(1 / 3)
    assert distinct([4], 2) is None and distinct_counts([], 1) == (0, 0)


def test_rep_4_counts_only_later_occurrences():
    assert repeat_counts(ABAB) == (1, 3)  # (1,2,1,2) (2,1,2,1) (1,2,1,2): the third one repeats the first
    assert rep([7] * 6) == pytest.approx(2 / 3)  # three equal 4-grams: the 2nd and 3rd are repeats
    assert rep([5, 6, 7, 8, 9]) == 0.0
    assert rep([1, 2, 3]) is None
    assert repeat_counts([1, 2, 3, 4, 9, 1, 2, 3, 4]) == (1, 6)  # the same 4-gram 5 tokens later
    assert repeat_counts([1, 2, 3, 4, 1, 2, 3, 5], 4) == (0, 5)  # 3-gram repeats are not 4-gram repeats


def _row(tokens, logprob_sum):
    return {"generated": len(tokens), "logprob_sum": logprob_sum, **run_counts(tokens)}


def test_quality_pools_counts_over_runs():
    rows = [_row(ABAB, -6.0), _row([5, 6, 7, 8, 9], -10.0), _row([4], -1.0)]
    q = quality(rows)
    assert q["distinct_1"] == pytest.approx((2 + 5 + 1) / (6 + 5 + 1))
    assert q["distinct_2"] == pytest.approx((2 + 4) / (5 + 4))  # the 1-token run has no bigram
    assert q["distinct_3"] == pytest.approx((2 + 3) / (4 + 3))
    assert q["rep_4"] == pytest.approx(1 / (3 + 2))
    assert q["ppl"] == pytest.approx(math.exp(17 / 12))
    assert q["mean_length"] == pytest.approx(12 / 3)
    assert set(q["se"]) == {"ppl", "distinct_1", "distinct_2", "distinct_3", "rep_4"}
    assert all(v > 0 for v in q["se"].values())  # the runs differ, so resampling moves every figure


def test_quality_of_identical_runs_has_no_spread_and_one_run_no_error():
    q = quality([_row(ABAB, -3.0)] * 5)
    assert q["distinct_2"] == pytest.approx(0.4) and q["se"]["distinct_2"] == pytest.approx(0, abs=1e-12)
    assert q["se"]["rep_4"] == pytest.approx(0, abs=1e-12)
    assert quality([_row(ABAB, -3.0)])["se"]["rep_4"] is None
    assert quality([]) == {}


def _agg(method, ppl, d2, r4, t=1.0, se=None):
    return {"method": method, "temperature": t, "ppl": ppl, "distinct_2": d2, "rep_4": r4, "se": se or {}}


CURVE = {
    "ar": _agg("ar", 3.0, 0.85, 0.05, 1.0),
    "ar T=0.6": _agg("ar", 2.0, 0.75, 0.13, 0.6),
    "ar T=0.4": _agg("ar", 1.8, 0.70, 0.15, 0.4),
}


def test_place_interpolates_the_curve_at_the_same_ppl():
    curve = frontier(CURVE)["curve"]
    assert [p["temperature"] for p in curve] == [0.4, 0.6, 1.0]  # ordered by PPL
    p = place(_agg("mtad", 2.5, 0.70, 0.16), curve)
    assert p["matched_temperature"] == pytest.approx(0.8) and p["ppl_range"] == "at"
    assert p["curve_distinct_2"] == pytest.approx(0.80) and p["curve_rep_4"] == pytest.approx(0.09)
    assert p["distinct_2_gap"] == pytest.approx(-0.10) and p["rep_4_gap"] == pytest.approx(0.07)
    assert p["verdict"] == "behind"
    assert place(_agg("m", 2.5, 0.82, 0.05), curve)["verdict"] == "beyond"
    assert place(_agg("m", 2.5, 0.82, 0.12), curve)["verdict"] == "mixed"
    assert place(_agg("m", 1.9, 0.725, 0.14), curve)["verdict"] == "beyond"  # on the curve counts as beyond


def test_place_outside_the_curves_range_compares_with_its_end_point():
    curve = frontier(CURVE)["curve"]
    below = place(_agg("m", 1.5, 0.72, 0.10), curve)
    assert below["ppl_range"] == "below" and below["matched_temperature"] == 0.4 and below["verdict"] == "beyond"
    assert place(_agg("m", 1.5, 0.60, 0.10), curve)["verdict"] == "outside"
    assert place(_agg("m", 3.5, 0.80, 0.06), curve)["verdict"] == "behind"  # worse than T=1 at higher PPL
    assert place(_agg("m", 3.5, 0.90, 0.06), curve)["verdict"] == "outside"


def test_gaps_are_clear_only_beyond_two_standard_errors():
    se = {"distinct_2": 0.01, "rep_4": 0.01}
    curve = frontier({k: {**v, "se": se} for k, v in CURVE.items()})["curve"]
    p = place(_agg("m", 2.5, 0.83, 0.08, se=se), curve)  # gaps +0.03 and -0.01 against 2 x 0.0141
    assert p["clear"] == {"distinct_2": True, "rep_4": False}
    assert place(_agg("m", 2.5, 0.83, 0.08), curve)["clear"] == {"distinct_2": None, "rep_4": None}


def test_frontier_places_every_other_variant_and_needs_an_ar_point():
    variants = {**CURVE, "mtad": _agg("mtad", 2.5, 0.7, 0.16), "sd": _agg("sd", 3.1, 0.86, 0.05)}
    f = frontier(variants)
    assert set(f["variants"]) == {"mtad", "sd"} and len(f["curve"]) == 3
    assert frontier({"mtad": _agg("mtad", 2.5, 0.7, 0.16)}) == {}


BASE = DecodeConfig(sampling=SamplingConfig(temperature=1.0))


def test_variants_expand_methods_gammas_and_temperatures_in_order():
    vs, dropped = expand(BASE, ("ar", "sd", "mtad"), [2, 6], [1.0, 0.6])
    assert [v.label for v in vs] == ["ar", "sd g=2", "sd g=6", "mtad g=2", "mtad g=6", "ar T=0.6"]
    assert dropped == [("ar T=1", "ar")]  # the same request as ar at the base temperature
    assert vs[-1].config(BASE, 5).sampling.temperature == 0.6 and vs[-1].config(BASE, 5).seed == 5
    assert vs[1].config(BASE, 0).gamma == 2 and vs[1].config(BASE, 0).method == "sd"
    vs, _ = expand(BASE, ("mtad",), [], [], ["mtad thr=0.5", "mtad accept_threshold=0.3 w=2", "beam g=2 T=0"])
    assert [v.label for v in vs] == ["mtad", "mtad w=2 thr=0.3", "beam g=2 T=0"]
    assert vs[1].options == {"accept_threshold": 0.3, "beam_width": 2}
    assert capacity(BASE, vs) == (8, 4)  # the base drafts gamma 'auto': up to gamma_max 8
    vs, _ = expand(BASE, ("sd", "ar"), [2, "auto"], [], ["mtad g=12 w=auto"])
    assert [v.label for v in vs] == ["sd g=2", "sd g=auto", "ar", "mtad g=12 w=auto"]
    assert capacity(BASE, vs[:3]) == (8, 4) and capacity(BASE, vs) == (12, 4)


@pytest.mark.parametrize(
    "spec,words",
    [("", "empty"), ("nope g=2", "method must be"), ("mtad g", "not OPTION=VALUE"), ("mtad g=0", "gamma must be")],
)
def test_bad_variant_specs_name_the_problem(spec, words):
    with pytest.raises(OptionError, match=words):
        parse_spec(spec)


# -- an independent judge's PPL, and the frontier at equal judge PPL ------------------------------
def _judged(tokens, logprob_sum, judge_sum, judge_tokens):
    return {**_row(tokens, logprob_sum), "judge_logprob_sum": judge_sum, "judge_tokens": judge_tokens}


def test_judge_ppl_pools_the_judges_own_tokens_with_a_standard_error():
    rows = [_judged(ABAB, -6.0, -9.0, 5), _judged([5, 6, 7, 8, 9], -10.0, -4.0, 7)]
    q = quality(rows)
    assert q["ppl"] == pytest.approx(math.exp(16 / 11))  # the target's, per generated token
    assert q["judge_ppl"] == pytest.approx(math.exp(13 / 12))  # the judge's, per judge token
    assert q["se"]["judge_ppl"] > 0
    assert set(q["se"]) == {"ppl", "judge_ppl", "distinct_1", "distinct_2", "distinct_3", "rep_4"}
    assert "judge_ppl" not in quality([_row(ABAB, -6.0)] * 2)  # no judge: no judge figures
    assert "judge_ppl" not in quality([_row(ABAB, -6.0), _judged(ABAB, -6.0, -1.0, 2)])  # only where all were judged


def _judged_agg(method, ppl, judge_ppl, d2, r4, t=1.0, se=None):
    return {**_agg(method, ppl, d2, r4, t, se), "judge_ppl": judge_ppl}


def test_frontier_places_variants_at_equal_judge_ppl_too():
    """The judge orders the curve by its own PPL and matches each variant at its judge PPL: a
    variant the target scores low (it verified the text) can sit at a hotter temperature for the
    judge, and the verdict changes with it."""
    se = {"distinct_2": 0.005, "rep_4": 0.005}
    curve = {
        "ar": _judged_agg("ar", 3.0, 12.0, 0.85, 0.05, 1.0, se),
        "ar T=0.6": _judged_agg("ar", 2.0, 9.0, 0.75, 0.13, 0.6, se),
        "ar T=0.4": _judged_agg("ar", 1.8, 8.0, 0.70, 0.15, 0.4, se),
    }
    mtad = _judged_agg("mtad", 2.0, 11.0, 0.78, 0.10, se=se)
    f = frontier({**curve, "mtad": mtad})
    at_target, at_judge = f["variants"]["mtad"], f["judge"]["variants"]["mtad"]
    assert at_target["matched_temperature"] == pytest.approx(0.6) and at_target["verdict"] == "beyond"
    assert [p["temperature"] for p in f["judge"]["curve"]] == [0.4, 0.6, 1.0]
    assert [p["judge_ppl"] for p in f["judge"]["curve"]] == [8.0, 9.0, 12.0]
    # judge PPL 11 lies 2/3 of the way from T=0.6 (9) to T=1 (12): T 0.867, distinct-2 0.8167, rep-4 0.0767
    assert at_judge["matched_temperature"] == pytest.approx(0.6 + 0.4 * 2 / 3)
    assert at_judge["curve_distinct_2"] == pytest.approx(0.75 + 0.1 * 2 / 3)
    assert at_judge["distinct_2_gap"] == pytest.approx(0.78 - (0.75 + 0.1 * 2 / 3))
    assert at_judge["rep_4_gap"] == pytest.approx(0.10 - (0.13 - 0.08 * 2 / 3))
    assert at_judge["verdict"] == "behind" and at_judge["clear"] == {"distinct_2": True, "rep_4": True}
    beyond = frontier({**curve, "m": _judged_agg("m", 2.5, 7.0, 0.72, 0.12)})["judge"]["variants"]["m"]
    assert beyond["ppl_range"] == "below" and beyond["matched_temperature"] == 0.4 and beyond["verdict"] == "beyond"
    assert "judge" not in frontier(CURVE)  # no judge PPL anywhere: the target's frontier alone


def test_resolution_is_two_combined_errors_of_the_median_variant_and_projects_to_more_runs():
    def agg(se_d2, se_r4, runs=8):
        return {"runs": runs, "se": {"distinct_2": se_d2, "rep_4": se_r4, "ppl": 0.1, "judge_ppl": None}}

    variants = {"a": agg(0.01, 0.02), "b": agg(0.02, 0.03), "c": agg(0.03, 0.01)}
    res = resolution(variants)
    assert res["distinct_2"] == pytest.approx(2 * math.sqrt(2) * 0.02)  # the median error, 0.02
    assert res["rep_4"] == pytest.approx(2 * math.sqrt(2) * 0.02)
    assert res["ppl"] == pytest.approx(2 * math.sqrt(2) * 0.1) and "judge_ppl" not in res and res["runs"] == 8
    more = resolution(variants, runs=96)  # 12 times the runs: errors over sqrt(12)
    assert more["distinct_2"] == pytest.approx(res["distinct_2"] / math.sqrt(12)) and more["runs"] == 96
    assert resolution({"x": {"runs": 1, "se": {"distinct_2": None}}}) == {}


# -- the quality preset -------------------------------------------------------------------------
def test_the_large_quality_set_is_24_open_ended_chat_prompts():
    from mtad_edge.bench.run import load_prompts

    items = load_prompts("quality-large")
    assert len(items) == 24 and len({i["id"] for i in items}) == 24
    assert all(len(i["messages"]) == 1 and i["messages"][0]["role"] == "user" for i in items)
    kinds = [i["id"].split("-")[1] for i in items]
    assert {k: kinds.count(k) for k in kinds} == dict.fromkeys(
        ("advice", "explain", "story", "describe", "opinion", "howto"), 4
    )


def test_preset_settings_yield_to_the_options_given():
    from mtad_edge.bench.run import PRESETS, preset_settings

    assert preset_settings(None, set()) == {}
    assert preset_settings("quality", set()) == PRESETS["quality"]
    assert preset_settings("quality", {"repeats", "max_tokens"}) == {
        "prompts_file": "quality-large",
        "ar_temperatures": "1,0.8,0.6,0.4",
    }


def test_bench_preset_quality_fills_what_the_command_line_leaves_out(monkeypatch):
    from click.testing import CliRunner

    import mtad_edge.cli.bench as command
    from mtad_edge.cli import cli
    from mtad_edge.runtime.errors import MtadEdgeError

    seen: dict = {}
    real = command.BenchConfig

    def capture(**kw):
        seen.update(kw)
        return real(**kw)

    def stop(path):
        seen["prompts"] = path
        raise MtadEdgeError("stopped before loading")

    monkeypatch.setattr(command, "BenchConfig", capture)
    monkeypatch.setattr(command, "load_prompts", stop)
    r = CliRunner().invoke(cli, ["bench", "--preset", "quality"])
    assert "stopped before loading" in r.output
    assert seen["prompts"] == "quality-large" and seen["repeats"] == 4 and seen["decode"].max_tokens == 128
    assert [v.label for v in seen["variants"]] == ["ar", "sd", "mtad", "ar T=0.8", "ar T=0.6", "ar T=0.4"]
    args = ["--prompts", "quality", "--repeats", "2", "--max-tokens", "64", "--ar-temperatures", "0.5"]
    CliRunner().invoke(cli, ["bench", "--preset", "quality", *args, "--methods", "ar"])
    assert seen["prompts"] == "quality" and seen["repeats"] == 2 and seen["decode"].max_tokens == 64
    assert [v.label for v in seen["variants"]] == ["ar", "ar T=0.5"]
