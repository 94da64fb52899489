"""Who drafts (the aux model, prompt lookup, or lookup beside the aux) and how sd verifies (as a
block or token by token), through the whole loop on the fake backend."""

import time

import numpy as np
import pytest

from helpers import (
    TWO_TOKEN_RUN,
    FakeClock,
    FakeLM,
    chi2_critical,
    chi2_stat,
    counted,
    deterministic_q,
    exact_two_token_joint,
    fake_engine,
    generate_tokens,
)
from mtad_edge.runtime.backend import Batch
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.drafting.base import Draft
from mtad_edge.runtime.drafting.lookup import MATCH_EDGES
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.methods import StepView, get
from mtad_edge.runtime.rules.sampling import filtered_logprobs

REPEATS = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # the last bigram recurs: lookup drafts "3 4 1 2"
GREEDY = SamplingConfig(temperature=0.0)


@pytest.mark.parametrize("verify", ["block", "token"])
@pytest.mark.parametrize("drafter", ["ngram", "ngram+aux"])
def test_sd_with_lookup_drafts_keeps_the_target_distribution(drafter, verify):
    """A lookup draft is deterministic (q one-hot): kept while it matches the target's own draws
    (either ``verify``; beside the aux, the aux's drafts go through the rule named); the first two
    tokens are distributed as the target alone makes them."""
    sampling = SamplingConfig(1.0, 0, 1.0)
    target, aux = FakeLM(salt=1, sharpness=1.0), FakeLM(salt=7, n_seq_max=3, sharpness=1.0)
    counts, looked_up = np.zeros(target.n_vocab**2), 0
    for seed in range(3000):
        cfg = DecodeConfig("sd", TWO_TOKEN_RUN, gamma=3, drafter=drafter, verify=verify, sampling=sampling, seed=seed)
        out, st = generate_tokens(target, aux, REPEATS, cfg)
        counts[out[0] * target.n_vocab + out[1]] += 1
        looked_up += counted(st, "ngram")
    stat, df = chi2_stat(counts, exact_two_token_joint(target, REPEATS, sampling))
    assert looked_up >= 3000 and stat < chi2_critical(df)


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_seeded_sd_with_lookup_drafts_writes_the_text_of_seeded_ar(gamma):
    """Each token is the target's own draw, one draw per token from the run's generator as a
    plain step makes it: lookup drafts change how fast a seeded run writes, not what it writes
    (runs that draft differently, e.g. beside an aux, stay comparable text for text)."""
    sampling = SamplingConfig(0.9, 4, 0.95)
    target = FakeLM(salt=1, n_seq_max=5, sharpness=1.0)
    drafted = accepted = 0
    for seed in range(40):
        ar, _ = generate_tokens(target, None, REPEATS, DecodeConfig("ar", 40, sampling=sampling, seed=seed))
        cfg = DecodeConfig("sd", 40, gamma=gamma, drafter="ngram", sampling=sampling, seed=seed)
        out, st = generate_tokens(target, None, REPEATS, cfg)
        assert out == ar
        drafted, accepted = (
            drafted + counted(st, "ngram"),
            accepted + counted(st, "ngram", "accepted"),
        )
    assert 0 < accepted < drafted  # drafts were kept and drafts were cut


@pytest.mark.parametrize("verify", ["block", "token"])
def test_sd_with_aux_drafts_keeps_the_target_distribution_either_rule(verify):
    sampling = SamplingConfig(0.8, 4, 0.9)
    target, aux = FakeLM(salt=1, sharpness=1.0), FakeLM(salt=7, n_seq_max=3, sharpness=1.0)
    counts = np.zeros(target.n_vocab**2)
    for seed in range(3000):
        cfg = DecodeConfig("sd", TWO_TOKEN_RUN, gamma=3, verify=verify, sampling=sampling, seed=seed)
        out, _ = generate_tokens(target, aux, [1, 2, 3], cfg)
        counts[out[0] * target.n_vocab + out[1]] += 1
    stat, df = chi2_stat(counts, exact_two_token_joint(target, [1, 2, 3], sampling))
    assert stat < chi2_critical(df)


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
@pytest.mark.parametrize("drafter", ["ngram", "ngram+aux"])
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_lookup_drafting_gives_greedy_ar(method, drafter, gamma):
    target, aux = FakeLM(salt=1, n_seq_max=5), FakeLM(salt=2, n_seq_max=9)
    ar, _ = generate_tokens(target, None, REPEATS, DecodeConfig("ar", 60, sampling=GREEDY))
    cfg = DecodeConfig(method, 60, gamma=gamma, drafter=drafter, sampling=GREEDY)
    out, st = generate_tokens(target, aux if drafter != "ngram" else None, REPEATS, cfg)
    assert out == ar
    assert counted(st, "ngram") > 0 and st.drafters.get("ngram", {}).get("accepted", 0) <= counted(
        st, "ngram"
    )  # a 5-token vocabulary repeats itself
    if drafter == "ngram":
        assert st.drafted == counted(st, "ngram") and st.accepted == st.drafters.get("ngram", {}).get("accepted", 0)
    else:
        assert st.drafted > st.drafters.get("ngram", {}).get(
            "drafted", 0
        )  # where lookup found nothing, the aux drafted


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_the_default_drafter_adds_lookup_where_the_controller_chooses_the_draft(method):
    """drafter 'auto' is ngram+aux under gamma 'auto' (the controller prices lookup's free drafts
    beside the aux's) and the aux alone with a fixed gamma, where the user pinned the drafts."""
    target, aux = FakeLM(salt=1, n_seq_max=5), FakeLM(salt=2, n_seq_max=9)
    ar, _ = generate_tokens(target, None, REPEATS, DecodeConfig("ar", 60, sampling=GREEDY))
    looked_up = {}
    for gamma in ("auto", 3):
        cfg = DecodeConfig(method, 60, gamma=gamma, sampling=GREEDY)
        assert cfg.drafter == "auto"
        gen = Generation(target, aux, REPEATS, cfg)
        assert [d.name for d in gen.drafters.drafters] == (["ngram", "aux"] if gamma == "auto" else ["aux"])
        out, st = [t for block in gen for t in block], gen.stats
        assert out == ar
        looked_up[gamma] = counted(st, "ngram")
        assert st.drafted > counted(st, "ngram")  # the aux drafted either way
    assert looked_up["auto"] > 0 and looked_up[3] == 0


def test_sd_with_the_default_drafter_keeps_the_target_distribution():
    """Under gamma 'auto' the default drafter mixes lookup and aux drafts step by step, as the
    controller chooses from what earlier runs taught it (as an engine's requests share one model):
    the first two tokens are still distributed as the target alone makes them."""
    from mtad_edge.runtime.drafting.controller import Model

    sampling, model = SamplingConfig(1.0, 0, 1.0), Model()
    target, aux = FakeLM(salt=1, sharpness=1.0), FakeLM(salt=7, n_seq_max=3, sharpness=1.0)
    counts, looked_up, aux_drafted = np.zeros(target.n_vocab**2), 0, 0
    for seed in range(3000):
        cfg = DecodeConfig("sd", TWO_TOKEN_RUN, sampling=sampling, seed=seed)
        out, st = generate_tokens(target, aux, REPEATS, cfg, model=model, learn=True)
        counts[out[0] * target.n_vocab + out[1]] += 1
        looked_up, aux_drafted = (
            looked_up + counted(st, "ngram"),
            aux_drafted + st.drafted - counted(st, "ngram"),
        )
    stat, df = chi2_stat(counts, exact_two_token_joint(target, REPEATS, sampling))
    assert looked_up > 0 and aux_drafted > 0 and stat < chi2_critical(df)


def test_lookups_of_each_match_class_are_learned_apart(monkeypatch):
    """A copied passage and a chance bigram are accepted at very different rates: each match class
    has its own acceptance, taught by its own drafts only."""
    from mtad_edge.runtime.drafting.controller import Model
    from mtad_edge.runtime.drafting.lookup import LookupDrafter, NgramDrafter, match_class

    last, drafted_classes = [], set()
    lookup, lookup_draft = NgramDrafter.lookup, LookupDrafter.draft

    def recording_lookup(self, tokens, gamma):
        found = lookup(self, tokens, gamma)
        last[:] = [found]
        return found

    def recording_draft(self, offer, tokens, step):
        drafted_classes.add(match_class(last[0].matched))
        return lookup_draft(self, offer, tokens, step)

    monkeypatch.setattr(NgramDrafter, "lookup", recording_lookup)
    monkeypatch.setattr(LookupDrafter, "draft", recording_draft)
    clock, model = FakeClock(), Model()
    target = FakeLM(salt=1, n_seq_max=9, clock=clock, cost=lambda rows: 0.010 + 0.0005 * rows)
    model.target.observe(1, 0.0105)  # costs known, as an engine's load-time calibration leaves them
    model.target.observe(9, 0.0145)
    prompt = [0, 3] + [1, 2, 3, 4] * 5  # a passage that repeats up to the prompt's end
    cfg = DecodeConfig("sd", 60, gamma="auto", drafter="ngram", sampling=GREEDY)
    out, st = generate_tokens(target, None, prompt, cfg, model=model, clock=clock)
    ar, _ = generate_tokens(target, None, prompt, DecodeConfig("ar", 60, sampling=GREEDY))
    assert out == ar and counted(st, "ngram") > 0
    taught = {
        int(key.rsplit(" m", 1)[1])
        for key, acc in model.acceptance.items()
        if " lookup m" in key and acc.tries(1, 1) > 0
    }
    assert taught == drafted_classes and len(MATCH_EDGES) in taught  # the repeating passage: long matches


def test_beside_lookup_an_idle_aux_is_fed_its_prompt_only_when_it_drafts():
    """Where the aux does not pay its controller stops planning drafts; beside lookup, the next
    request then leaves the aux's prompt unfed until the aux drafts (here: never). A fresh engine,
    or the aux drafting alone, feeds it up front."""
    from mtad_edge.runtime.drafting.aux import AUX_IDLE_PLANS
    from mtad_edge.runtime.drafting.controller import Model

    prompt = list(range(40))  # no bigram recurs: lookup finds little
    clock = FakeClock()
    target = FakeLM(salt=1, n_seq_max=9, vocab=50, clock=clock, cost=lambda rows: 0.010 + 0.0005 * rows)
    aux = FakeLM(salt=2, n_seq_max=9, vocab=50, clock=clock, cost=lambda rows: 0.03)  # 3 target steps a call
    ar, _ = generate_tokens(target, None, prompt, DecodeConfig("ar", 30, sampling=GREEDY))
    model = Model()
    model.target.observe(1, 0.0105)
    model.target.observe(9, 0.0145)
    model.aux.observe(1, 0.03)
    model.aux.observe(2, 0.03)
    fed = []
    for drafter in ("ngram+aux", "ngram+aux", "aux"):
        aux.clear()
        cfg = DecodeConfig("sd", 30, gamma="auto", drafter=drafter, sampling=GREEDY)
        out, st = generate_tokens(target, aux, prompt, cfg, model=model, clock=clock)
        assert out == ar and st.drafted == counted(st, "ngram")  # the aux never drafted
        fed.append(aux.held(0)[: len(prompt) - 1] == prompt[:-1])
    idle = [acc.since_draft for key, acc in model.acceptance.items() if "lookup" not in key]
    assert max(idle) >= AUX_IDLE_PLANS
    assert fed == [True, False, True]  # fresh: up front; idle beside lookup: never; alone: up front


def test_beside_an_aux_that_plans_a_plain_step_lookup_drafts_as_it_chose(monkeypatch):
    """Lookup's controller chose its draft over a plain step by its own measure (its forecasts
    scaled by what its steps delivered); an aux planning a plain step does not overrule it, while
    an aux planning a faster draft does."""
    from mtad_edge.runtime.decoding import Generation
    from mtad_edge.runtime.drafting.controller import Controller, Plan

    target, aux = FakeLM(salt=1, n_seq_max=9), FakeLM(salt=2, n_seq_max=9)
    cfg = DecodeConfig("sd", 8, gamma="auto", drafter="ngram+aux", sampling=GREEDY)
    gen = Generation(target, aux, [0, 3] + [1, 2, 3, 4] * 5, cfg)
    aux_ctrl = gen.drafters["aux"].ctrl
    assert isinstance(aux_ctrl, Controller)
    lookup_plan = Plan(3, 1, tokens=2.0, seconds=0.02)  # 100 tokens/s as forecast, unscaled
    for ctrl in gen.drafters["ngram"].ctrls:
        monkeypatch.setattr(ctrl, "plan", lambda max_gamma, lag=0: lookup_plan)
    for aux_plan, drafts_lookup in ((Plan(0, 1, 1.0, 0.005), True), (Plan(4, 1, 4.0, 0.02), False)):
        monkeypatch.setattr(aux_ctrl, "plan", lambda max_gamma, lag=0, p=aux_plan: p)
        offer = gen.drafters.choose(gen.tokens, gen._draft_cap(), 1)
        assert (offer.plan is lookup_plan and offer.found is not None) == drafts_lookup
        assert drafts_lookup or (offer.plan is aux_plan and offer.drafter is gen.drafters["aux"])


def test_a_plain_step_beside_the_aux_earns_lookups_next_probe_too(monkeypatch):
    """Where lookup planned no draft and the aux stepped plainly, the plain step counts toward
    lookup's probe budget as its own plain steps do: else a lookup class that stopped drafting
    beside the aux never probes again (and ngram+aux drafts less than ngram alone)."""
    from mtad_edge.runtime.decoding import Generation
    from mtad_edge.runtime.drafting.controller import Plan
    from mtad_edge.runtime.drafting.lookup import match_class

    target, aux = FakeLM(salt=1, n_seq_max=9), FakeLM(salt=2, n_seq_max=9)
    prompt = [0, 3] + [1, 2, 3, 4] * 5
    for drafter in ("ngram", "ngram+aux"):
        cfg = DecodeConfig("sd", 8, gamma="auto", drafter=drafter, sampling=GREEDY)
        gen = Generation(target, aux if drafter != "ngram" else None, prompt, cfg)
        ctrl = gen.drafters["ngram"].ctrls[match_class(16)]
        monkeypatch.setattr(ctrl, "plan", lambda max_gamma, lag=0: Plan(0, 1, 1.0, 0.01))
        if drafter != "ngram":
            monkeypatch.setattr(gen.drafters["aux"].ctrl, "plan", lambda max_gamma, lag=0: Plan(0, 1, 1.0, 0.01))
        gen._prefill()
        before = ctrl.pot.plain_s  # the run's probe budget, which lookup's classes share
        gen._step()
        assert gen.stats.drafted == 0 and ctrl.pot.plain_s > before, drafter


def test_lookup_alone_without_a_match_steps_plainly():
    target = FakeLM(salt=1, n_seq_max=5, vocab=50)
    prompt = list(range(10))  # no bigram recurs, and a sharp-ish 50-token model rarely repeats one
    out, st = generate_tokens(target, None, prompt, DecodeConfig("sd", 3, drafter="ngram", sampling=GREEDY))
    assert st.drafted == 0 and st.gamma_hist == {0: 3} and len(out) == 3


def test_drafting_with_the_aux_needs_one():
    target = FakeLM(salt=1, n_seq_max=5)
    with pytest.raises(OptionError, match="needs an aux model"):
        generate_tokens(target, None, REPEATS, DecodeConfig("sd", 4, drafter="aux"))
    engine = fake_engine(FakeLM(salt=1, n_seq_max=5), None)
    with pytest.raises(OptionError, match="--drafter ngram") as e:
        engine.generate("abc", method="mtad")
    assert e.value.param == "method"
    assert engine.generate("abcabcab", method="sd", drafter="ngram", max_tokens=4, seed=1).text()


def test_mtad_accepts_the_longest_lookup_prefix_the_target_gives_more_than_the_threshold():
    """With a deterministic draft q = 1, so MTAD's joint test log p(x_1..x_k) - log q(x_1..x_k) >
    log(threshold) keeps the longest prefix whose joint target probability exceeds it."""
    sampling = SamplingConfig(1.0, 0, 1.0)
    target = FakeLM(salt=3, sharpness=2.5)
    tokens, draft_tokens = [1, 2, 3], np.array([0, 4, 2, 2])
    for threshold in (0.05, 0.2, 0.5):
        target.clear()
        target.decode(Batch.run(tokens[:-1], 0, logits="none"))
        view = StepView(
            target,
            list(tokens),
            sampling,
            threshold,
            "final",
            "block",
            1.0,
            np.random.default_rng(0),
            time.perf_counter,
        )
        logq_x, _ = deterministic_q(draft_tokens, target.n_vocab)
        result = get("mtad").step(view, 4, 1, Draft(draft_tokens, logq_x, None, draft_tokens[None], logq_x[None]))
        joint, ctx = [], list(tokens)
        for x in draft_tokens:
            joint.append(filtered_logprobs(target.logits_for(ctx), sampling)[x])
            ctx.append(int(x))
        passing = [d + 1 for d, c in enumerate(np.cumsum(joint)) if c > np.log(threshold)]
        assert result.accepted == (passing[-1] if passing else 0), threshold
