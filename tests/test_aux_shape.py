"""aux_shape: every drafting call of the aux evaluates the same rows (llama.cpp's CUDA graphs are kept
only across calls of one shape), with the same drafts; the aux's calls and shapes counted in the stats."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from test_pinned import FAKE_CASES, FAKE_PROMPT, fake_run, stored

from helpers import FakeLM, generate_tokens
from mtad_edge.bench.report import _aux_calls_table
from mtad_edge.bench.run import drafters
from mtad_edge.cli import cli
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.backends import llama_cpp_backend
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.drafting.aux import aux_rows
from mtad_edge.runtime.drafting.beams import SPLIT_MAX, BeamDrafter
from mtad_edge.runtime.errors import OptionError

T1 = SamplingConfig(1.0, 0, 1.0)


class Recording(FakeLM):
    """A FakeLM that keeps every batch it evaluated."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[Batch] = []

    def decode(self, batch):
        self.batches.append(batch)
        return super().decode(batch)


def test_calls_of_one_shape_give_the_pinned_texts():
    """The fake backend's logits hash the whole context of a row, so a filler row or a tag that
    reached a real row's context, or a spare sequence a beam read, would change a text: every
    pinned case that drafts with a fixed plan gives its record with every aux call padded (the
    scripted-clock cases plan from the aux's measured costs, which padding changes: not compared)."""
    record = stored()["fake"]
    for name, (kind, options) in FAKE_CASES.items():
        if kind != "clock":
            assert fake_run(kind, {**options, "aux_shape": "fixed"}) == record[name], name


@pytest.mark.parametrize("method, rows", [("sd", 2), ("mtad", 4), ("mmtad", 4)])
def test_every_drafting_call_has_the_same_rows_each_in_its_own_sequence_all_read(method, rows):
    target, aux = FakeLM(vocab=6, salt=1, n_seq_max=17), Recording(vocab=6, salt=2, n_seq_max=9)
    cfg = DecodeConfig(method, 60, gamma=3, seed=7, sampling=T1, aux_shape="fixed")
    _, st = generate_tokens(target, aux, FAKE_PROMPT, cfg)
    prefill, *calls = aux.batches
    assert len(prefill) == len(FAKE_PROMPT) - 1 and calls
    for b in calls:  # llama.cpp reuses its graph where rows, outputs and distinct sequences repeat
        assert len(b) == rows and all(b.logits) and len({s for ids in b.seq_ids for s in ids}) == rows
    counted = st.drafters["aux"]
    assert counted["calls"] == len(aux.batches)
    assert counted["shapes"] == {len(prefill): 1, rows: len(calls)}
    assert counted["shape_changes"] == 2  # the prefill, then the first draft: one shape ever after


def test_free_calls_change_shape_every_step_and_are_counted():
    target, aux = FakeLM(vocab=6, salt=1, n_seq_max=17), Recording(vocab=6, salt=2, n_seq_max=9)
    cfg = DecodeConfig("mtad", 60, gamma=3, seed=7, sampling=T1, aux_shape="free")
    _, st = generate_tokens(target, aux, FAKE_PROMPT, cfg)
    sizes = [len(b) for b in aux.batches]
    counted = st.drafters["aux"]
    assert counted["calls"] == len(sizes) and sum(counted["shapes"].values()) == len(sizes)
    assert counted["shapes"] == {n: sizes.count(n) for n in set(sizes)}
    assert counted["shape_changes"] == 1 + sum(a != b for a, b in zip(sizes, sizes[1:]))
    assert counted["shape_changes"] >= counted["steps"]  # the pending row, then a row per beam


def drafter(rows: int, seed: int = 3) -> tuple[Recording, BeamDrafter]:
    aux = Recording(vocab=6, salt=2, n_seq_max=9, n_ctx=512)
    return aux, BeamDrafter(aux, T1, np.random.default_rng(seed), 4, rows=rows)


def test_a_catch_up_is_fed_in_calls_of_the_same_rows_and_past_a_few_as_a_prefill():
    """Tokens the aux skipped (plain steps, a span) are fed R rows a call; a catch-up longer than
    SPLIT_MAX such calls feeds all but its last R in one call. The drafts are those of free calls."""
    text = [int(t) for t in np.random.default_rng(0).integers(0, 6, 200)]
    for pending in (1, 2, 3, 4, 5, 9, 4 * SPLIT_MAX, 4 * SPLIT_MAX + 1, 60):
        drafts = {}
        for rows in (0, 4):
            aux, beams = drafter(rows)
            ctx = text[:20]
            beams.start(ctx)  # the aux's context is the committed list itself: it grows with it
            aux.batches.clear()
            ctx += text[20 : 20 + pending - 1]
            drafts[rows] = beams.propose(ctx, 3, 4, rows=True)
            first = aux.batches[:-2]  # the pending tokens' calls, then one call a depth (gamma 3)
            fed = [t for b in first for t, ids in zip(b.tokens, b.seq_ids) if ids[0] == 0]
            assert fed == text[19 : 20 + pending - 1], (pending, rows)
            if rows:
                split = -(-pending // 4)
                want = [4] * split if split <= SPLIT_MAX else [pending - 4, 4]
                assert [len(b) for b in aux.batches] == [*want, 4, 4], pending
        a, b = drafts[0], drafts[4]
        assert np.array_equal(a.beams, b.beams) and np.array_equal(a.beams_logq, b.beams_logq)
        assert np.array_equal(a.q.logp, b.q.logp) and [n for n, _ in a.calls] == [n for n, _ in b.calls]


def test_a_commit_after_a_padded_draft_leaves_what_a_free_one_does_and_no_spare_held():
    held = {}
    for rows in (0, 4):
        text = [int(t) for t in np.random.default_rng(1).integers(0, 6, 80)]
        aux, beams = drafter(rows)
        ctx = text[:10]
        beams.start(ctx)
        trace = []
        for k in (3, 0, 1, 2, 3):
            draft = beams.propose(ctx, 3, 4)
            beams.commit(k)
            ctx += [*(int(t) for t in draft.tokens[:k]), text[len(ctx) + k]]  # kept, then the target's token
            trace.append((list(aux.held(0)), [list(aux.held(s)) for s in range(1, 9)]))
        held[rows] = trace
    for (free0, _), (fixed0, spares) in zip(held[0], held[4]):
        assert fixed0 == free0 and not any(spares)


def test_aux_shape_auto_is_fixed_where_the_aux_replays_cuda_graphs(monkeypatch):
    class Graphs(FakeLM):
        graphs = True

    assert aux_rows("auto", FakeLM(), 4) == 0 and aux_rows("auto", Graphs(), 4) == 4
    assert aux_rows("auto", Graphs(), 1) == 2  # a draft kept whole leaves two tokens pending
    assert aux_rows("fixed", FakeLM(), 3) == 3 and aux_rows("free", Graphs(), 4) == 0

    class Lib:
        def __init__(self, info: bytes):
            self.info = info

        def llama_print_system_info(self) -> bytes:
            return self.info

    cuda = Lib(b"CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : AVX2 = 1 |")
    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS", raising=False)
    assert llama_cpp_backend.cuda_graphs(cuda)
    assert not llama_cpp_backend.cuda_graphs(Lib(b"CPU : SSE3 = 1 | AVX2 = 1 | LLAMAFILE = 1 |"))
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "1")
    assert not llama_cpp_backend.cuda_graphs(cuda)


def test_aux_shape_is_an_option_everywhere_with_words_for_a_bad_value():
    with pytest.raises(OptionError, match="aux_shape must be one of auto, fixed, free, got 'one'"):
        DecodeConfig(aux_shape="one")
    r = CliRunner().invoke(cli, ["generate", "--aux-shape", "one", "hi"])
    assert r.exit_code == 2 and "aux_shape must be one of auto, fixed, free" in r.output


def test_room_keeps_a_call_of_filler_rows():
    target, aux = FakeLM(vocab=6, salt=1, n_seq_max=17, n_ctx=256), FakeLM(vocab=6, salt=2, n_seq_max=9, n_ctx=64)
    rooms = {}
    for shape in ("free", "fixed"):
        gen = Generation(target, aux, FAKE_PROMPT, DecodeConfig("mtad", 8, gamma=3, seed=1, aux_shape=shape))
        rooms[shape] = gen._room()
    assert rooms["free"] - rooms["fixed"] == 4


def test_bench_sums_the_aux_shapes_and_reports_calls_per_step():
    runs = [
        {"generated": 10, "drafters": {"aux": {"drafted": 6, "accepted": 3, "steps": 3, "calls": 7,
                                               "shapes": {"12": 1, "4": 6}, "shape_changes": 2}}},
        {"generated": 10, "drafters": {"aux": {"drafted": 4, "accepted": 2, "steps": 2, "calls": 5,
                                               "shapes": {"9": 1, "4": 4}, "shape_changes": 2}}},
    ]  # fmt: skip
    agg = drafters(runs)["aux"]
    assert agg["calls"] == 12 and agg["shapes"] == {4: 10, 9: 1, 12: 1} and agg["shape_changes"] == 4
    methods = {"mtad": {"drafters": {"aux": agg}}}
    table = "\n".join(_aux_calls_table(methods))
    assert "| mtad | 2.40 | 4: 10, 9: 1, 12: 1 | 0.80 |" in table


@pytest.mark.slow
def test_the_default_pair_drafts_in_calls_of_one_shape(smol_models):
    """On llama.cpp: with aux_shape fixed every drafting call of the aux has max(width, 2) rows (the
    prefill aside), so its shape changes once; free calls change shape every step. The texts may
    differ: llama.cpp's CPU kernels round a row by the batch it came in (tests/test_repack.py)."""
    target, aux = smol_models.target, smol_models.aux
    ids = target.tokenize("<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n")
    seen = {}
    for shape in ("fixed", "free"):
        cfg = DecodeConfig("mtad", 24, gamma=3, beam_width=3, sampling=SamplingConfig(0.0, 0, 1.0), aux_shape=shape)
        out, st = generate_tokens(target, aux, ids, cfg, reuse=False)
        assert out and st.drafted
        seen[shape] = st.drafters["aux"]
    fixed, free = seen["fixed"], seen["free"]
    assert fixed["calls"] == sum(fixed["shapes"].values()) and max(fixed["shapes"], key=fixed["shapes"].get) == 3
    assert fixed["shape_changes"] <= 2 < fixed["calls"] and free["shape_changes"] >= free["steps"]
