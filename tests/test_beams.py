"""What a beam draft costs when its beams collapse, depth by depth, and how far MTAD drafts: the
controller's pure logic, then the loop on fake backends."""

import time

import numpy as np
import pytest

from helpers import FakeLM, scripted_pair
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.drafting.acceptance import Acceptance, Beams
from mtad_edge.runtime.drafting.aux import Draft
from mtad_edge.runtime.drafting.controller import Controller, Model, Plan
from mtad_edge.runtime.methods import StepView, get


def shares(beams, width, depth):
    """P(the call at ``depth`` evaluates r rows) at ``width``, as the controller reads it."""
    readings = beams.readings(width, depth)
    last = readings[-1] if readings else None
    return None if last is None else {r: p for r, p in enumerate(last) if p > 0}


def always_accepted(ctrl: Controller, width: int, gamma: int = 8, steps: int = 60) -> None:
    for _ in range(steps):
        ctrl.acc.observe(width, gamma, [-0.1 * d for d in range(1, gamma + 1)])


def beam_machine() -> Model:
    """A target step of 10 ms plus 2 ms a row; the aux 4 ms a row."""
    model = Model()
    for rows in (1, 2, 5, 9):
        model.target.observe(rows, 0.010 + 0.002 * rows)
    for rows in (1, 2, 3, 4):
        model.aux.observe(rows, 0.004 * rows)
    return model


def test_beams_count_the_rows_of_the_calls_after_the_first_depth_by_depth():
    b = Beams(decay=1.0)
    assert shares(b, 4, 2) is None
    b.observe(4, [1, 1, 4])  # depths 2, 3, 4
    b.observe(4, [1])
    assert shares(b, 4, 2) == {1: 1.0}
    # depth 3: one call of 1 row, read towards depth 2's reading with 2 calls' weight
    assert shares(b, 4, 3) == {1: 1.0}
    assert shares(b, 4, 4) == pytest.approx({1: 2 / 3, 4: 1 / 3})  # (0 + 2 x 1) / 3 and (1 + 0) / 3
    assert shares(b, 4, 7) == shares(b, 4, 4)  # never drafted: the deepest reading carries on
    b.observe(2, [3])  # more rows than the width: counted as the width
    assert shares(b, 2, 2) == {2: 1.0}


def test_deeper_calls_running_more_beams_make_long_drafts_dearer():
    """One flat spot re-opens collapsed beams, so a deep call runs more of them than a shallow one
    (mmtad on Gemma 3 270M, width 4: 2.0 rows at depth 2, 2.9 at depth 7). Read depth by depth,
    the deep calls are priced at their own rows, not at the shallow ones' average."""
    ctrl = Controller(beam_machine(), "mtad", range(1, 9), (4,), tree=False)
    for _ in range(40):
        ctrl.observe_beams(4, [1, 1, 4, 4, 4, 4, 4])
    calls = [ctrl.beam_calls_s(g, 4) for g in range(1, 9)]
    # Pooled, every call was 2/7 x 4 ms + 5/7 x 16 ms = 12.6 ms: a draft of 3 at 25 ms, not its 8
    assert calls[:3] == pytest.approx([0.0, 0.004, 0.008])
    # depth 4 on: 16 ms a call, less a little for the pull of depth 3's one-row reading
    assert calls[7] == pytest.approx(0.008 + 5 * 0.016, rel=0.03) and calls[7] < 0.008 + 5 * 0.016
    for _ in range(40):
        ctrl.observe_beams(4, [1, 1])  # drafts of 3 now: the deeper depths keep their own counts
    assert ctrl.beam_calls_s(8, 4) == pytest.approx(0.008 + 5 * 0.016, rel=0.03)


def test_a_collapsed_beam_is_priced_by_its_live_rows():
    """A width-4 draft whose top-k / top-p leaves one candidate evaluates one row per aux call,
    not four (Gemma 3 270M at T=1: three in four of its calls). Priced at four rows, drafting
    deep looks dear; priced at what its calls evaluate, it pays."""
    ctrl = Controller(beam_machine(), "mtad", range(1, 9), (4,), tree=False)
    always_accepted(ctrl, 4)
    assert ctrl.beam_calls_s(8, 4) == pytest.approx(7 * 0.016)
    assert ctrl.plan(8).gamma == 1  # every depth adds 18 ms for one token: the shortest draft
    for _ in range(30):
        ctrl.observe_beams(4, [1] * 7)
    assert ctrl.beam_calls_s(8, 4) == pytest.approx(7 * 0.004)
    assert ctrl.step_seconds(8, 4) == pytest.approx(ctrl.first_aux_s(8, 4) + 7 * 0.004 + 0.010 + 0.002 * 9)
    assert ctrl.plan(8).gamma == 8  # now a depth adds 6 ms: the longest


def test_a_tree_is_sized_depth_by_depth_and_an_unmeasured_depth_continues_the_one_before():
    model = Model()
    ctrl = Controller(model, "mmtad", range(3, 9), (4,), tree=True)
    assert ctrl.verify_rows(4, 4) == 1 + 12  # nothing measured: three quarters of g x w
    ctrl.observe_tree(4, [1, 2, 3])  # collapsed beams
    assert ctrl.verify_rows(3, 4) == 1 + 6 and ctrl.verify_rows(6, 4) == 1 + 6 + 3 * 3
    assert ctrl.verify_rows(6, 2) == 1 + 9  # another width: nothing measured there
    ctrl.observe_tree(4, [1, 2, 3, 4])
    assert model.nodes[(4, 3)] == 3 and model.nodes[(4, 4)] == 4
    ctrl.observe_tree(4, [2])
    assert model.nodes[(4, 1)] == pytest.approx(1.2)  # each depth an average of its trees (0.2 a tree)


def test_every_tree_teaches_the_depths_it_reached():
    """Drafts cut at depth 3 where the aux is unsure (its beams many: 4 nodes a depth) and drafts
    of 6 where it is sure (1 node a depth). Learned per draft length, a tree of 3 read 12 nodes
    and a draft of 3 looked dear beside 6, which made drafts long; per depth, the first three
    depths average over every tree."""
    ctrl = Controller(Model(), "mmtad", range(3, 9), (4,), tree=True)
    for _ in range(30):
        ctrl.observe_tree(4, [4, 4, 4])
        for _ in range(3):
            ctrl.observe_tree(4, [1] * 6)
    assert ctrl.nodes(3, 4) < 6  # mostly the sure drafts' single nodes, not the unsure ones' 12
    assert ctrl.nodes(6, 4) == pytest.approx(ctrl.nodes(3, 4) + 3, rel=0.01)


def flat_machine(extra_s: float) -> Model:
    """A drafting step of 10 ms plus ``extra_s`` a depth (the aux's 1 ms and the verify's row),
    each depth one more token (always accepted)."""
    model = Model()
    for rows in (1, 2, 3, 4):
        model.aux.observe(rows, 0.001)
    for rows in range(1, 10):
        model.target.observe(rows, 0.010 + (extra_s - 0.001) * (rows - 1))
    return model


def test_a_draft_goes_on_to_the_planned_length_and_past_it_only_while_it_pays():
    """At 12 ms a depth gamma 3 is the fastest (4 is 1.0 % slower, 8 is 2.6 %): the plan is 3,
    the draft goes on to it and stops there; a plan of 8 is drafted on from 4 only while it pays."""
    ctrl = Controller(flat_machine(0.012), "mmtad", range(3, 9), (4,), tree=False)
    always_accepted(ctrl, 4)
    rates = {g: sum(ctrl.acc.survivals(4, g)) / ctrl.step_seconds(g, 4) for g in range(3, 9)}
    assert max(rates, key=rates.get) == 3
    assert ctrl.plan(8).gamma == 3
    assert all(ctrl.keep_going(d, -0.1 * d) for d in range(3))
    assert not ctrl.keep_going(3, -0.3)
    ctrl._plan.gamma = 8
    assert not ctrl.keep_going(4, -0.4)


def test_the_loop_learns_the_live_beams_of_its_drafts():
    for top_k, rows in ((1, {1: 1.0}), (0, {3: 1.0})):
        clock, target, aux = scripted_pair(aux_salt=2, aux_cost=lambda r: 0.001 * r)
        cfg = DecodeConfig(
            "mtad", 60, gamma="auto", gamma_max=6, beam_width=3, sampling=SamplingConfig(1.0, top_k, 1.0)
        )
        gen = Generation(target, aux, [1, 2, 3], cfg, clock=clock)
        [t for b in gen for t in b]
        assert isinstance(gen.controller, Controller)
        assert shares(gen.controller.acc.beams, 3, 2) == rows  # top-k 1 leaves one candidate a depth


@pytest.mark.parametrize(("method", "temperature"), [("mmtad", 1.0), ("mmtad", 0.0), ("mtad", 1.0)])
def test_mtad_auto_floor_and_following_hold_only_when_sampling(method, temperature):
    """When sampling, mtad and mmtad draft at least four tokens (gamma 3 straddles the 1.05x PPL
    bound) and every option drafts, so a barely drafted depth follows the depths before it. Greedy,
    every length gives ar's text: plain steps are an option, read cautiously."""
    clock, target, aux = scripted_pair(aux_salt=2, aux_cost=lambda r: 0.001 * r)
    cfg = DecodeConfig(method, 8, gamma="auto", sampling=SamplingConfig(temperature))
    gen = Generation(target, aux, [1, 2, 3], cfg, clock=clock)
    assert isinstance(gen.controller, Controller)
    assert gen.controller.gammas[0] == (4 if temperature > 0 else 0)
    assert gen.controller.acc.follow == (temperature > 0)
    assert len([t for b in gen for t in b]) == 8


def test_a_depth_drafted_once_is_read_as_the_depths_before_it_predict():
    """Where drafts of 3 are accepted whole (Gemma 3 270M: 98 % of drafted tokens), one draft of
    4 accepted whole must not read as 0.8 (the flat prior's pull): that made gamma 4 look 4 %
    dearer than gamma 3, more than mmtad's 3 % preference for it. Only where every option
    drafts (``follow``): where plain steps are an option, a barely drafted depth stays shrunk
    towards the flat prior, as optimism there turns plain steps into drafts that lose."""
    a = Acceptance(follow=True)
    for _ in range(40):
        a.observe(4, 3, [-0.1, -0.2, -0.3])
    assert a.survival(4, 3) > 0.97
    assert a.survival(4, 4) > 0.97  # never drafted: the depths before, continued
    a.observe(4, 4, [-0.1, -0.2, -0.3, -0.4])
    assert a.survival(4, 4) > 0.97
    cautious = Acceptance(follow=False)
    for _ in range(40):
        cautious.observe(4, 3, [-0.1, -0.2, -0.3])
    cautious.observe(4, 4, [-0.1, -0.2, -0.3, -0.4])
    assert cautious.survival(4, 4) == pytest.approx((1 + 0.6) / 2)
    low = Acceptance(follow=True)  # where little is accepted, a drafted depth is still shrunk towards the prior
    for _ in range(40):
        low.observe(1, 0, [-0.1, -0.2])
    low.observe(1, 3, [-0.1, -0.2, -0.3])
    assert low.survival(1, 3) == pytest.approx((1 + 0.6) / 2)


def tree_machine() -> Model:
    """A straight verify of 10 ms plus 1 ms a row; a tree's rows cost four times as much (a tree
    mask on a CPU); the aux 1 ms a row."""
    model = Model()
    for rows in (1, 2, 5, 9, 13, 17):
        model.target.observe(rows, 0.010 + 0.001 * rows)
        model.tree.observe(rows, 0.010 + 0.004 * rows)
    for rows in (1, 2, 3, 4):
        model.aux.observe(rows, 0.001 * rows)
    return model


@pytest.mark.parametrize("tree_k, alone_k, alone", [(5, 5, True), (5, 0, False)])
def test_mmtad_verifies_the_best_beam_alone_where_its_tree_keeps_no_more(tree_k, alone_k, alone):
    """A tree that keeps what its best beam alone keeps pays for rows it does not need: MMTAD then
    verifies the best beam alone (MTAD's straight verify). A tree that keeps more stays. Before
    trees are measured at a width, the tree is verified (the priors would make the two tie)."""
    ctrl = Controller(tree_machine(), "mmtad", range(4, 6), (4,), tree=True)
    first = ctrl.plan(5)
    assert first.gamma and not first.alone
    cum = [-0.1 * d for d in range(1, 6)]
    for _ in range(30):
        ctrl.observe_step(Plan(5, 4), tree_k, cum, 0.05)
        ctrl.observe_alone(4, alone_k, cum)
    plan = ctrl.plan(5)
    assert plan.gamma and plan.alone is alone
    assert plan.seconds == pytest.approx(ctrl.step_seconds(plan.gamma, 4, alone=alone, survivals=None))


def test_a_straight_method_never_plans_the_best_beam_alone():
    ctrl = Controller(tree_machine(), "mtad", range(4, 6), (1, 2, 4), tree=False)
    assert ctrl.verifies(4) == (False,) and not ctrl.plan(5).alone
    tree = Controller(tree_machine(), "mmtad", range(4, 6), (1, 2), tree=True)
    assert tree.verifies(1) == (True,) and tree.verifies(2) == (False, True)  # one beam: always straight


def step_view(target, tokens, threshold=0.3):
    sampling = SamplingConfig(1.0, 0, 1.0)
    target.clear()
    target.decode(Batch.run(tokens[:-1], 0, logits="none"))
    return StepView(
        target, list(tokens), sampling, threshold, "final", "block", 1.0, np.random.default_rng(0), time.perf_counter
    )


def test_mmtad_verifies_one_beam_as_mtad_does_and_tells_a_tree_what_its_best_beam_alone_keeps():
    """One beam (width 1, lookup, or the best beam alone) gets MTAD's straight verify: the same
    step as MTAD's, priced as a straight call. A tree step reports what its best beam would have
    kept verified alone: MTAD's own result on that beam."""
    target = FakeLM(salt=3, sharpness=2.5, n_seq_max=5)
    tokens = [1, 2, 3]
    beams = np.array([[0, 4, 2, 2], [0, 4, 1, 3], [2, 1, 2, 0]])
    beams_logq = np.log(np.array([[0.9, 0.8, 0.7, 0.6], [0.9, 0.1, 0.5, 0.5], [0.05, 0.5, 0.5, 0.5]]))
    checked = 0
    for best in range(3):
        draft = Draft(beams[best], beams_logq[best], None, beams, beams_logq, best)
        alone = get("mmtad").step(step_view(target, tokens), 4, 3, draft.best_only())
        mtad = get("mtad").step(step_view(target, tokens), 4, 3, draft.best_only())
        assert (alone.tokens, alone.accepted) == (mtad.tokens, mtad.accepted)
        assert not alone.calls[0].tree and alone.beam is None and alone.alone_accepted is None
        tree = get("mmtad").step(step_view(target, tokens), 4, 3, draft)
        assert tree.calls[0].tree and tree.alone_accepted == mtad.accepted
        assert tree.accepted >= mtad.accepted  # the tree holds the best beam
        checked += tree.accepted > mtad.accepted
    assert checked  # some tree kept more than its best beam alone


def test_the_loop_verifies_the_best_beam_alone_once_trees_keep_no_more():
    """The aux is the target: every beam is kept whole, so a tree keeps no more than its best beam
    and costs more rows. After trees are measured, MMTAD verifies the best beam alone; the caches
    still hold exactly the committed text."""
    clock, target, aux = scripted_pair(aux_salt=1, aux_cost=lambda rows: 0.001)
    gen = Generation(target, aux, [1, 2, 3], DecodeConfig("mmtad", 300, gamma="auto", gamma_max=6), clock=clock)
    out = [t for b in gen for t in b]
    assert len(out) == 300
    assert 0 < gen.stats.alone_steps < sum(gen.stats.width_hist.values())
    assert gen.model.tree.table  # trees were verified first
    assert target.held(0) == gen.tokens[:-1]
    assert gen.tokens[: len(aux.held(0))] == aux.held(0)
