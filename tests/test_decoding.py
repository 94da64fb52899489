"""The decoding loop and the beam drafter on the fake backend (no real model)."""

import numpy as np
import pytest

from helpers import (
    TWO_TOKEN_RUN,
    FakeLM,
    assert_blocks_follow_trees,
    chi2_critical,
    chi2_stat,
    exact_two_token_joint,
    generate_tokens,
    record_drafts,
    record_trees,
)
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.drafting.aux import BeamDrafter
from mtad_edge.runtime.errors import ContextOverflowError
from mtad_edge.runtime.rules.sampling import filtered_logprobs

PROMPT = [1, 2, 3]
GREEDY = SamplingConfig(temperature=0.0)


def run(target, aux, method, **kw):
    """A run with a fixed draft length (4 unless given): these tests check the step logic."""
    return generate_tokens(target, aux, PROMPT, DecodeConfig(method=method, **{"gamma": 4, **kw}))


def test_greedy_sd_and_mtad_equal_greedy_ar(fake_pair):
    target, aux = fake_pair
    target.n_seq_max = 4 * 5 + 1  # room for the full tree
    ar, _ = run(target, None, "ar", max_tokens=40, sampling=GREEDY)
    for method, tree in (("sd", "final"), ("mtad", "final"), ("mmtad", "final"), ("mmtad", "full")):
        for gamma in (1, 3, 5):
            out, st = run(target, aux, method, max_tokens=40, gamma=gamma, tree=tree, sampling=GREEDY)
            assert out == ar, (method, gamma, tree)
            assert st.generated == 40


def test_ar_is_the_target_greedy_chain(fake_pair):
    target, _ = fake_pair
    out, st = run(target, None, "ar", max_tokens=6, sampling=GREEDY)
    ctx = list(PROMPT)
    for t in out:
        assert t == int(np.argmax(target.logits_for(ctx)))
        ctx.append(t)
    assert st.target_calls == 6 and st.block_efficiency == 1.0 and st.drafted == 0


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0, 0, 1.0), SamplingConfig(0.8, 4, 0.9)])
def test_sd_output_follows_the_target_joint_distribution(sampling):
    """Lossless: the first two tokens from the full sd loop are distributed as under AR."""
    target, aux = FakeLM(salt=1, sharpness=1.0), FakeLM(salt=7, n_seq_max=3, sharpness=1.0)
    counts = np.zeros(target.n_vocab**2)
    for seed in range(3000):
        out, _ = run(target, aux, "sd", max_tokens=TWO_TOKEN_RUN, gamma=3, sampling=sampling, seed=seed)
        counts[out[0] * target.n_vocab + out[1]] += 1
    stat, df = chi2_stat(counts, exact_two_token_joint(target, PROMPT, sampling))
    assert stat < chi2_critical(df)


def test_mtad_accepts_every_draft_when_draft_equals_target():
    """p == q makes every joint ratio 1 > threshold: all gamma tokens pass, plus the bonus."""
    target, aux = FakeLM(salt=3), FakeLM(salt=3, n_seq_max=9)
    out, st = run(target, aux, "mtad", max_tokens=50, gamma=4, beam_width=3, seed=5)
    assert st.accept_lengths[:-1] == [4] * (len(st.accept_lengths) - 1)
    assert st.acceptance_rate > 0.95 and st.block_efficiency >= 4.5


def test_beam_drafter_log_q_matches_a_fresh_computation():
    """Each beam is evaluated on its own cache: the chosen beam's per-token log q equals the
    draft model's filtered log-probs recomputed from scratch along that beam."""
    cfg = SamplingConfig(1.0, 3, 1.0)
    aux = FakeLM(salt=4, n_seq_max=9)
    rng = np.random.default_rng(0)
    drafter = BeamDrafter(aux, cfg, rng=rng, max_width=4)
    tokens = list(PROMPT)
    drafter.start(tokens)
    for _ in range(5):
        d = drafter.propose(tokens, 4, 4, rows=True)
        ctx = list(tokens)
        for i, x in enumerate(d.tokens):
            ref = filtered_logprobs(aux.logits_for(ctx), cfg)
            assert np.isclose(d.logq_x[i], ref[x])
            assert np.allclose(np.nan_to_num(d.q.dense()[i], neginf=-1e9), np.nan_to_num(ref, neginf=-1e9))
            ctx.append(int(x))
        k = int(rng.integers(0, 5))
        drafter.commit(k)
        tokens += [int(t) for t in d.tokens[:k]] + [int(rng.integers(0, 5))]  # the aux context grows with it
        assert aux.seqs[0] == tokens[: len(aux.held(0))]  # committed cache is a prefix
        assert all(not aux.seqs.get(s) for s in range(1, 9))  # beams dropped


@pytest.mark.parametrize(
    "cfg, no_repeat",
    [
        (SamplingConfig(1.0, 3, 1.0), 0),
        (SamplingConfig(0.7, 12, 0.8), 0),
        (SamplingConfig(1.0, 12, 0.95), 2),  # beams that would repeat a bigram lose those tokens
        (SamplingConfig(0.0, 6, 0.9), 0),  # greedy: beams ranked by the temperature-1 rows, no draw
    ],
)
def test_beams_drawn_over_the_top_k_alone_are_the_draws_over_full_rows(monkeypatch, cfg, no_repeat):
    """Where top-k keeps a few tokens the drafter works on those entries alone, never building a
    full row (its q rows for sd included); from the same generator state it draws exactly the
    beams, per-token log q, dead ends and q rows that full rows give, draft after draft."""
    from mtad_edge.runtime.drafting import aux as drafter_module

    runs = []
    for full in (False, True):
        aux = FakeLM(vocab=40, salt=4, n_seq_max=9)
        drafter = BeamDrafter(aux, cfg, rng=np.random.default_rng(7), max_width=4, no_repeat=no_repeat)
        tokens, steps, out = list(PROMPT), np.random.default_rng(1), []
        drafter.start(tokens)
        with monkeypatch.context() as m:
            if full:  # the whole-row route (as for a top-k that keeps every token)
                m.setattr(drafter_module, "kept_logprobs", lambda *a: None)
            else:
                m.setattr(drafter_module, "filtered_logprobs", lambda *a: pytest.fail("a full row was built"))
            for _ in range(8):
                d = drafter.propose(tokens, 5, 4, rows=True)
                dead = None if d.dead is None else d.dead.tolist()
                assert d.q is not None and (d.q.ids is None) == full
                q = np.nan_to_num(d.q.dense(), neginf=-1e9).round(12).tolist()
                out.append((d.beams.tolist(), d.beams_logq.tolist(), d.best, d.tokens.tolist(), dead, q))
                k = int(steps.integers(0, 6))
                drafter.commit(k)
                tokens += [int(t) for t in d.tokens[:k]] + [int(steps.integers(0, 40))]
        runs.append(out)
    assert runs[0] == runs[1]


def test_greedy_beam_draft_is_the_top_joint_sequence():
    """Temperature 0, width = all candidates: the draft is the argmax of joint log q."""
    aux = FakeLM(vocab=3, salt=5, n_seq_max=19)
    cfg = SamplingConfig(0.0, 0, 1.0)
    drafter = BeamDrafter(aux, cfg, rng=np.random.default_rng(0), max_width=9)
    drafter.start(list(PROMPT))
    d = drafter.propose(list(PROMPT), 2, 9)
    best, best_score = None, -np.inf
    score_cfg = SamplingConfig(1.0, 0, 1.0)
    for a in range(3):
        la = filtered_logprobs(aux.logits_for(PROMPT), score_cfg)[a]
        for b in range(3):
            s = la + filtered_logprobs(aux.logits_for(PROMPT + [a]), score_cfg)[b]
            if s > best_score:
                best, best_score = [a, b], s
    assert d.tokens.tolist() == best


@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mmtad"])
def test_stats_are_consistent_with_tokens(fake_pair, method):
    target, aux = fake_pair
    out, st = run(target, aux, method, max_tokens=37, seed=1)
    assert st.generated == len(out) == 37 and st.finish_reason == "length"
    assert st.accepted <= st.drafted and sum(st.accept_lengths) == st.accepted
    assert st.block_efficiency == pytest.approx(len(out) / st.target_calls)
    if method != "ar":
        assert st.drafted <= 4 * st.target_calls  # whole drafts but near the end (the next test)
        assert len(out) <= st.accepted + st.target_calls  # k accepted + 1 bonus per call
    assert st.wall_s >= st.prefill_s + st.draft_s + st.verify_s - 1e-9


@pytest.mark.parametrize(
    "method, options",
    [("sd", {}), ("mtad", {}), ("mmtad", {}), ("sd", {"drafter": "ngram"}), ("mtad", {"gamma": "auto"})],
)
def test_a_draft_stops_one_token_short_of_max_tokens(fake_pair, monkeypatch, method, options):
    """A step commits at most its draft and one token more, so a draft never holds more than one
    token fewer than max_tokens leaves: a fixed gamma drafts min(gamma, left - 1) tokens, and the
    last token is a plain step's."""
    target, aux = fake_pair
    cfg = DecodeConfig(method=method, max_tokens=11, seed=1, **{"gamma": 4, **options})
    gen = Generation(target, aux, [1, 2, 1, 2, 1], cfg)
    steps = record_drafts(gen, monkeypatch)
    out = [t for block in gen for t in block]
    assert len(out) == 11 and all(drafted <= 11 - made - 1 for made, drafted in steps)
    if cfg.gamma == 4 and cfg.drafter != "ngram":  # the aux drafts whole drafts, cut only by the cap
        assert all(drafted == min(4, 11 - made - 1) for made, drafted in steps)
    if steps[-1][0] == 10:  # a step for the last token alone
        assert steps[-1][1] == 0


def test_end_of_generation_token_stops_and_is_not_emitted():
    target = FakeLM(salt=1, eog=0)
    out, st = generate_tokens(target, None, PROMPT, DecodeConfig(method="ar", max_tokens=500, sampling=GREEDY))
    ctx = PROMPT + out
    assert 0 not in out and st.finish_reason == "stop"
    assert int(np.argmax(target.logits_for(ctx))) == 0


def test_prompt_too_long_for_context_is_refused(fake_pair):
    target, aux = FakeLM(salt=1, n_ctx=10), FakeLM(salt=2, n_seq_max=9)
    with pytest.raises(ContextOverflowError, match="prompt has 8 tokens"):
        Generation(target, aux, list(range(8)), DecodeConfig(method="mtad", gamma=4))


def test_prompt_too_long_names_the_context_that_bounds_it():
    """The message gave the target's cells even where the aux's beams left less room (n_ctx minus 9
    where the aux held 454 of 512)."""
    cfg = DecodeConfig(method="mtad", gamma=4, beam_width=4)
    aux_bound = FakeLM(salt=1, n_ctx=100), FakeLM(salt=2, n_ctx=40, n_seq_max=9)
    with pytest.raises(ContextOverflowError) as e:
        Generation(*aux_bound, list(range(20)), cfg)
    assert "holds 14 (the aux's 40 cells less 26 for the draft's beams)" in str(e.value)  # 2 banks x 4 x 3 + 2
    target_bound = FakeLM(salt=1, n_ctx=10), FakeLM(salt=2, n_ctx=100, n_seq_max=9)
    with pytest.raises(ContextOverflowError) as e:
        Generation(*target_bound, list(range(8)), cfg)
    assert "holds 5 (the target's 10 cells less 5 for a step)" in str(e.value)


def test_generation_stops_when_context_is_full():
    target = FakeLM(salt=1, n_ctx=20)
    out, st = generate_tokens(target, None, PROMPT, DecodeConfig(method="ar", max_tokens=100))
    assert st.finish_reason == "context" and len(PROMPT) + len(out) == 20  # cache holds 19 + pending


@pytest.mark.parametrize(
    "kw",
    [
        dict(gamma=0),
        dict(beam_width=0),
        dict(accept_threshold=0.0),
        dict(accept_threshold=1.1),
        dict(max_tokens=0),
        dict(method="beams"),
    ],
)
def test_invalid_decode_config(kw):
    with pytest.raises(ValueError):
        DecodeConfig(**kw)


def test_same_seed_same_output(fake_pair):
    target, aux = fake_pair
    a, _ = run(target, aux, "mtad", max_tokens=30, seed=11)
    b, _ = run(target, aux, "mtad", max_tokens=30, seed=11)
    c, _ = run(target, aux, "mtad", max_tokens=30, seed=12)
    assert a == b and a != c


@pytest.mark.parametrize("forced_k", [0, 2, 4])
def test_mtad_bonus_token_comes_from_target_at_position_k_plus_1(monkeypatch, forced_k):
    """After k accepted draft tokens, the next token is sampled from p(. | prefix, x_1..x_k):
    with top-k 2 it must be one of the target's two best there, and for k = 0 its frequencies
    follow p(. | prompt)."""
    import mtad_edge.runtime.methods.mtad as mtad

    monkeypatch.setattr(mtad, "mtad_accept_length", lambda lp, lq, thr, bars=None: forced_k)
    cfg = SamplingConfig(1.0, 2, 1.0)
    target, aux = FakeLM(salt=1, sharpness=0.5), FakeLM(salt=2, n_seq_max=9, sharpness=0.5)
    counts = np.zeros(target.n_vocab)
    for seed in range(1500 if forced_k == 0 else 200):
        # room for a draft of forced_k + 1 (up to gamma), then one plain step for the last token
        out, st = run(target, aux, "mtad", max_tokens=forced_k + 2, gamma=4, sampling=cfg, seed=seed)
        assert st.accept_lengths == [forced_k] and len(out) == forced_k + 2
        bonus = out[forced_k]
        p = np.exp(filtered_logprobs(target.logits_for(PROMPT + out[:forced_k]), cfg))
        assert p[bonus] > 0
        counts[bonus] += 1
    if forced_k == 0:
        stat, df = chi2_stat(counts, np.exp(filtered_logprobs(target.logits_for(PROMPT), cfg)))
        assert stat < chi2_critical(df)


@pytest.mark.parametrize("tree", ["final", "full"])
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0, 10, 0.9), SamplingConfig(0.0)])
def test_mmtad_commits_a_path_of_the_drafted_tree(fake_pair, monkeypatch, sampling, tree):
    target, aux = fake_pair
    target.n_seq_max = 4 * 4 + 1
    trees = record_trees(monkeypatch)
    gen = Generation(target, aux, PROMPT, DecodeConfig("mmtad", 200, gamma=4, tree=tree, sampling=sampling, seed=4))
    blocks = list(gen)
    # Every drafting step's block is whole (a draft stops short of max_tokens); the last token may
    # be a plain step's, after the last tree.
    drafted = len(gen.stats.accept_lengths)
    assert len(trees) == drafted and len(blocks) in (drafted, drafted + 1)
    assert_blocks_follow_trees(blocks[:drafted], trees, gen.stats.accept_lengths)
    assert all(not target.seqs.get(s) for s in range(1, target.n_seq_max))  # only sequence 0 keeps cells
    if tree == "full" and sampling.temperature:
        assert any((t < 0).any() for t in trees)  # beams that died early were verified too


def test_the_full_tree_accepts_at_least_what_the_final_beams_do():
    """Every node of the final beams' tree is in the full tree, so on the same drafts the full tree
    accepts as much or more: over long seeded runs its acceptance is higher."""
    acc = {}
    for tree in ("final", "full"):
        target, aux = FakeLM(salt=1, n_seq_max=17), FakeLM(salt=2, n_seq_max=9)
        runs = [run(target, aux, "mmtad", max_tokens=300, tree=tree, seed=s)[1] for s in range(3)]
        acc[tree] = sum(st.accepted for st in runs) / sum(st.drafted for st in runs)
    assert acc["full"] > acc["final"]


def test_mmtad_accepts_more_than_mtad_with_the_same_beams():
    """MMTAD accepts from any beam, MTAD only from the best one: over a long seeded run MMTAD
    accepts a larger share of drafted tokens."""
    target, aux = FakeLM(salt=1, n_seq_max=5), FakeLM(salt=2, n_seq_max=9)
    acc = {m: run(target, aux, m, max_tokens=300, seed=0)[1].acceptance_rate for m in ("mtad", "mmtad")}
    assert acc["mmtad"] > acc["mtad"]


def test_mmtad_needs_target_sequences_for_its_beams():
    with pytest.raises(ValueError, match="needs a target context with 5 sequences"):
        Generation(FakeLM(salt=1), FakeLM(salt=2, n_seq_max=9), PROMPT, DecodeConfig("mmtad"))
