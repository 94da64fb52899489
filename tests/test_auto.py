"""Method auto, the default (runtime/methods/auto.py): mtad where the pair's measured costs say
MTAD's draft pays at its floor, sd otherwise (which drafts only where that pays), said in the stats
and on the command line."""

import pytest

from helpers import fake_engine, generate_tokens, scripted_pair
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.drafting.controller import Model
from mtad_edge.runtime.options import default

T1 = SamplingConfig(1.0, 10, 0.9)


def costs(target_row: float, verify_slope: float, aux_row: float) -> Model:
    """A pair's measured costs: a target call of r rows, an aux call of r rows (seconds)."""
    model = Model()
    for rows in range(1, 10):
        for _ in range(3):
            model.target.observe(rows, target_row + verify_slope * (rows - 1))
            model.aux.observe(rows, aux_row * (1 + 0.3 * (rows - 1)))
    return model


# A big target on a memory-bound machine (a verify row costs little more than one), a small aux:
# the x4 stand-in's shape on the CPU (68 ms a row, 5 rows 146 ms; the aux 6-13 ms).
BIG = dict(target_row=0.068, verify_slope=0.019, aux_row=0.0064)
# The bundled tiny pair on two cores: the aux costs most of a target step, every row adds its cost.
TINY = dict(target_row=0.008, verify_slope=0.006, aux_row=0.005)


def test_it_is_the_default():
    assert default("method") == "auto" and DecodeConfig().method == "auto"


@pytest.mark.parametrize("sampling", [T1, SamplingConfig(0.0)])
def test_mtad_where_its_draft_pays_sd_where_it_does_not(sampling):
    cfg = DecodeConfig(sampling=sampling)
    big, why = cfg.resolved(costs(**BIG), aux=True)
    assert big.method == "mtad" and why.startswith("mtad, forecast") and "x plain decoding" in why
    tiny, why = cfg.resolved(costs(**TINY), aux=True)
    assert tiny.method == "sd" and why.startswith("sd: mtad's draft is forecast")
    assert tiny.beam_width == 1 and big.beam_width == cfg.beam_width  # sd drafts one beam


def test_without_an_aux_or_measured_costs_it_is_sd():
    cfg = DecodeConfig(sampling=T1)
    assert cfg.resolved(costs(**BIG), aux=False)[0].method == "sd"
    chosen, why = cfg.resolved(Model(), aux=True)
    assert chosen.method == "sd" and "not measured" in why
    assert DecodeConfig(method="mtad").resolved(Model(), aux=True) == (DecodeConfig(method="mtad"), None)


def test_a_run_says_what_it_chose_and_runs_it():
    clock, target, aux = scripted_pair(aux_salt=2, aux_cost=lambda rows: 0.03)  # the aux dearer than a step
    cfg = DecodeConfig(max_tokens=30, seed=3, sampling=T1)
    out, st = generate_tokens(target, aux, [1, 2, 3], cfg, model=costs(0.010, 0.0005, 0.03), clock=clock)
    assert st.method == "sd" and st.auto.startswith("sd:") and len(out) == 30
    _, mtad = generate_tokens(target, aux, [1, 2, 3], DecodeConfig(method="mtad", max_tokens=30, seed=3, sampling=T1))
    assert mtad.auto is None


def test_the_engine_takes_auto_on_a_pair_without_an_aux():
    """A target alone: auto is sd drafting by prompt lookup (mtad asked for by name still says
    what it lacks)."""
    eng = fake_engine(aux=None)
    r = eng.generate("abcabcabc", max_tokens=12, seed=1)
    assert r.text() and r.stats.method == "sd" and "no aux model" in r.stats.auto
    assert r.stats.to_dict()["auto"] == r.stats.auto
