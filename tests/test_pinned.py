"""Seeded texts pinned before the drafters moved behind one protocol (issue 68), kept through it.

Each case runs one seeded generation and compares its tokens and what its steps did (drafted,
accepted, target calls, the drafted lengths and widths) with tests/data/pinned.json, recorded on
main before the move. It guards what a restructuring of the loop can silently change: the
per-step draft streams, draft-ahead's replay of the keep-going answers, the order target
rollback -> drafter commit, the controllers' arbitration between prompt lookup and the aux.

The fake cases (the fake backend's logits hash the whole context) hold on every machine. The
real default pair's hold where llama.cpp's kernels are the ones they were recorded with: the
record is keyed by llama.cpp's CPU feature line, and a machine without one says so and skips.

    MTAD_PIN_RECORD=1 pytest tests/test_pinned.py   # (re)record this machine's entries
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import FakeLM, cross_pair, generate_tokens, scripted_pair
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.drafting.controller import Model

RECORD = Path(__file__).parent / "data" / "pinned.json"
RECORDING = os.environ.get("MTAD_PIN_RECORD") == "1"
T1 = SamplingConfig(1.0, 10, 0.9)
T1_FULL = SamplingConfig(1.0, 0, 1.0)
T0 = SamplingConfig(0.0)
FAKE_PROMPT = [1, 2, 3, 4, 2, 3, 4, 1, 2, 3, 0, 1, 2]  # repeats: prompt lookup finds matches

# name -> (pair kind, options); "fake": FakeLM target and aux; "cross": an aux of another
# vocabulary; "clock": a scripted machine, so gamma 'auto' adapts (learning, as bench does).
FAKE_CASES: dict[str, tuple[str, dict]] = {
    "sd T1 g3": ("fake", dict(method="sd", gamma=3, sampling=T1)),
    "sd T1 g3 token": ("fake", dict(method="sd", gamma=3, sampling=T1_FULL, verify="token")),
    "sd T0 g3": ("fake", dict(method="sd", gamma=3, sampling=T0)),
    "mtad T1 g3": ("fake", dict(method="mtad", gamma=3, sampling=T1)),
    "mtad T0 g3": ("fake", dict(method="mtad", gamma=3, sampling=T0)),
    "mmtad T1 g3": ("fake", dict(method="mmtad", gamma=3, sampling=T1_FULL)),
    "mmtad T1 g3 full": ("fake", dict(method="mmtad", gamma=3, sampling=T1_FULL, tree="full")),
    "mmtad T0 g3": ("fake", dict(method="mmtad", gamma=3, sampling=T0)),
    "beam T1": ("fake", dict(method="beam", gamma=3, beam_width=2, sampling=T1_FULL)),
    "mtad T1 g3 no_repeat": ("fake", dict(method="mtad", gamma=3, sampling=T1_FULL, no_repeat=2)),
    "mtad T1 g3 repeat_bar": ("fake", dict(method="mtad", gamma=3, sampling=T1_FULL, repeat_bar=2.0)),
    "sd T1 g3 ngram": ("fake", dict(method="sd", gamma=3, sampling=T1_FULL, drafter="ngram")),
    "mtad T1 g3 ngram+aux": ("fake", dict(method="mtad", gamma=3, sampling=T1_FULL, drafter="ngram+aux")),
    "sd T0 g3 ngram+aux": ("fake", dict(method="sd", gamma=3, sampling=T0, drafter="ngram+aux")),
    "sd T1 g3 ahead": ("fake", dict(method="sd", gamma=3, sampling=T1, draft_ahead="on")),
    "mtad T1 g3 ahead": ("fake", dict(method="mtad", gamma=3, sampling=T1_FULL, draft_ahead="on")),
    "mtad T0 g2 ahead": ("fake", dict(method="mtad", gamma=2, sampling=T0, draft_ahead="on")),
    "cross sd T1 g3": ("cross", dict(method="sd", gamma=3, sampling=T1_FULL)),
    "cross mtad T1 g3": ("cross", dict(method="mtad", gamma=3, sampling=T1_FULL)),
    "cross mmtad T0 g3": ("cross", dict(method="mmtad", gamma=3, sampling=T0)),
    "clock sd T1 auto": ("clock", dict(method="sd", sampling=T1_FULL)),
    "clock sd T0 auto": ("clock", dict(method="sd", sampling=T0)),
    "clock mtad T1 auto": ("clock", dict(method="mtad", sampling=T1_FULL)),
    "clock mtad T1 auto width": ("clock", dict(method="mtad", sampling=T1_FULL, beam_width="auto")),
    "clock mmtad T1 auto": ("clock", dict(method="mmtad", sampling=T1_FULL)),
    "clock sd T1 auto aux": ("clock", dict(method="sd", sampling=T1_FULL, drafter="aux")),
    "clock sd T1 auto ngram": ("clock", dict(method="sd", sampling=T1_FULL, drafter="ngram")),
}

# The real default pair (F16 target, Q4_0 aux), and Gemma 3 drafted by SmolLM2's aux.
REAL_PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
REAL_CASES: dict[str, dict] = {
    "sd T1 g3": dict(method="sd", gamma=3, sampling=T1),
    "sd T0 g3": dict(method="sd", gamma=3, sampling=T0),
    "mtad T1 g3": dict(method="mtad", gamma=3, sampling=T1),
    "mtad T0 g3": dict(method="mtad", gamma=3, sampling=T0),
    "mmtad T1 g3": dict(method="mmtad", gamma=3, sampling=T1),
    "mmtad T0 g3": dict(method="mmtad", gamma=3, sampling=T0),
    "sd T1 g3 ngram": dict(method="sd", gamma=3, sampling=T1, drafter="ngram"),
    "mtad T1 g3 ngram+aux": dict(method="mtad", gamma=3, sampling=T1, drafter="ngram+aux"),
    "mtad T1 g3 ahead": dict(method="mtad", gamma=3, sampling=T1, draft_ahead="on"),
    "sd T0 g3 ahead": dict(method="sd", gamma=3, sampling=T0, draft_ahead="on"),
}
CROSS_CASES: dict[str, dict] = {
    "cross sd T1 g3": dict(method="sd", gamma=3, sampling=T1),
    "cross mtad T0 g3": dict(method="mtad", gamma=3, sampling=T0),
}


def outcome(tokens, st) -> dict:
    """What a seeded run is pinned by: its text and what its steps did."""
    return {
        "tokens": [int(t) for t in tokens],
        "drafted": st.drafted,
        "accepted": st.accepted,
        "target_calls": st.target_calls,
        "gamma_hist": {str(k): v for k, v in sorted(st.gamma_hist.items())},
        "width_hist": {str(k): v for k, v in sorted(st.width_hist.items())},
    }


def fake_run(kind: str, options: dict) -> dict:
    cfg = DecodeConfig(**{"max_tokens": 60, "seed": 7, **options})
    if kind == "fake":
        target, aux = FakeLM(vocab=6, salt=1, n_seq_max=17), FakeLM(vocab=6, salt=2, n_seq_max=9)
        return outcome(*generate_tokens(target, aux, FAKE_PROMPT, cfg))
    if kind == "cross":
        target, aux, vm = cross_pair()
        return outcome(*generate_tokens(target, aux, [1, 2, 3, 1, 2], cfg, vocab=vm))
    clock, target, aux = scripted_pair(aux_salt=2, aux_cost=lambda rows: 0.002 + 0.0005 * rows)
    cfg = DecodeConfig(**{"max_tokens": 150, "seed": 7, **options})
    prompt = [t % target.n_vocab for t in FAKE_PROMPT]
    return outcome(*generate_tokens(target, aux, prompt, cfg, model=Model(), clock=clock, learn=True))


def machine() -> str:
    """The llama.cpp build's CPU feature line: what its kernels, and so its logits, depend on."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def stored() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {"fake": {}, "llama.cpp": {}}


def check(section: dict, name: str, got: dict) -> None:
    if RECORDING:
        section[name] = got
        return
    assert name in section, f"no pinned record for {name!r}: record it on main (MTAD_PIN_RECORD=1)"
    assert got == section[name], name


def save(record: dict) -> None:
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def test_fake_pairs_give_the_pinned_texts():
    record = stored()
    for name, (kind, options) in FAKE_CASES.items():
        check(record["fake"], name, fake_run(kind, options))
    if RECORDING:
        save(record)


@pytest.mark.slow
def test_the_default_pair_gives_the_pinned_texts(smol_models, gemma_files, smol_files):
    from mtad_edge.loader import ModelOptions, open_pair
    from mtad_edge.pairs import Pair

    record = stored()
    here = record["llama.cpp"].setdefault(machine(), {}) if RECORDING else record["llama.cpp"].get(machine())
    if here is None:
        pytest.skip(f"seeded llama.cpp texts were recorded on other CPUs only ({', '.join(record['llama.cpp'])})")
    target, aux = smol_models.target, smol_models.aux
    ids = target.tokenize(REAL_PROMPT)
    for name, options in REAL_CASES.items():
        cfg = DecodeConfig(**{"max_tokens": 40, "seed": 3, **options})
        check(here, name, outcome(*generate_tokens(target, aux, ids, cfg, reuse=False)))
    with open_pair(Pair(gemma_files.target, smol_files.aux), ["mtad"], 3, 4, ModelOptions(n_ctx=256)) as m:
        ids = m.target.tokenize(REAL_PROMPT)
        for name, options in CROSS_CASES.items():
            cfg = DecodeConfig(**{"max_tokens": 32, "seed": 3, **options})
            check(here, name, outcome(*generate_tokens(m.target, m.aux, ids, cfg, reuse=False, vocab=m.vocab)))
    if RECORDING:
        save(record)
