"""`beam`: the target's own beam search over windows of gamma tokens (the reference MTAD
approximates). Exactness on the fake backend, then the real pair."""

import itertools

import numpy as np
import pytest

from helpers import FakeLM, generate_tokens, greedy
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.methods import get
from mtad_edge.runtime.rules.sampling import filtered_logprobs

PROMPT = [1, 2, 3, 4]


def windows(target, cfg):
    """The committed blocks of one run (each block is one window) and the run's stats."""
    gen = Generation(target, None, PROMPT, cfg)
    return list(gen), gen.stats


def joint(target, context, window, sampling):
    """log p(window | context) under the filtered target distribution, token by token."""
    total = 0.0
    for i, t in enumerate(window):
        total += filtered_logprobs(target.logits_for(list(context) + list(window[:i])), sampling)[t]
    return total


def test_layout_and_registry():
    m = get("beam")
    assert not m.needs_aux and m.uses_beams
    lay = m.layout(4, 3)
    assert lay.target_seqs == 7 and lay.aux_seqs == 0 and lay.aux_cells == 0
    assert lay.target_cells == 2 * 3 * 3 + 2  # two banks of w x (gamma - 1) beam cells + pending


def test_greedy_with_width_equal_to_the_vocabulary_is_the_exact_argmax_of_the_joint():
    """w = V keeps every first token, so the best of the w x V pairs it ranks at depth 2 is the
    exact maximum of the joint over all V^2 pairs, window after window."""
    vocab = 5
    target = FakeLM(vocab=vocab, salt=3, n_seq_max=2 * vocab + 1, sharpness=0.7)
    sampling = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0)
    blocks, st = windows(target, DecodeConfig("beam", 16, gamma=2, beam_width=vocab, sampling=sampling, seed=0))
    score = SamplingConfig(1.0, 0, 1.0)  # greedy beams rank by the temperature-1 joint
    context = list(PROMPT)
    greedy_differs = 0
    for block in blocks:
        pairs = list(itertools.product(range(vocab), repeat=2))
        best = max(pairs, key=lambda ab: joint(target, context, ab, score))
        assert tuple(block) == best
        greedy_differs += best[0] != int(np.argmax(target.logits_for(context)))
        context += block
    assert greedy_differs  # the test has teeth: on this model the best pair does not start greedily
    assert len(blocks) == 8 and st.target_calls == 16 and st.block_efficiency == 1.0
    assert st.drafted == 0 and st.acceptance_rate is None


def test_greedy_width_one_is_greedy_ar():
    target = FakeLM(vocab=7, salt=5, n_seq_max=3)
    cfg = DecodeConfig("beam", 30, beam_width=1, sampling=SamplingConfig(temperature=0.0))
    out, st = generate_tokens(target, None, PROMPT, cfg)
    assert out == greedy(FakeLM(vocab=7, salt=5), None, PROMPT, 30)[0]
    assert st.target_calls == 32  # gamma 4 per window: 8 windows, the last one clipped to 2 tokens


def test_sampled_window_is_the_best_joint_among_the_beams_kept(monkeypatch):
    """At temperature 1 the beams are drawn at random, but the committed window is always the
    kept beam with the highest joint log p (recomputed here from the target's own logits)."""
    import mtad_edge.runtime.methods.beam as beam_module

    drafts = []

    class Spy(beam_module.BeamDrafter):
        def propose(self, tokens, gamma, width, rows=False, keep_going=None):
            d = super().propose(tokens, gamma, width, rows, keep_going)
            drafts.append((list(tokens), d))
            return d

    monkeypatch.setattr(beam_module, "BeamDrafter", Spy)
    target = FakeLM(vocab=6, salt=7, n_seq_max=7, sharpness=1.0)
    sampling = SamplingConfig(temperature=0.9, top_k=0, top_p=1.0)
    blocks, _ = windows(target, DecodeConfig("beam", 30, gamma=3, beam_width=3, sampling=sampling, seed=11))
    assert len(drafts) == len(blocks) == 10
    not_first = 0
    for (context, d), block in zip(drafts, blocks):
        assert d.beams.shape == (3, 3)
        joints = [joint(target, context, b, sampling) for b in d.beams.tolist()]
        np.testing.assert_allclose(joints, d.beams_logq.sum(axis=1), rtol=0, atol=1e-9)
        assert block == d.beams[int(np.argmax(joints))].tolist()
        not_first += int(np.argmax(joints)) != 0
        assert len({tuple(b) for b in d.beams.tolist()}) == 3  # distinct beams
    assert not_first  # the draw order is not the ranking: picking the best joint matters


def test_seeded_output_is_reproducible_and_seeds_matter():
    sampling = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)

    def run(seed):
        cfg = DecodeConfig("beam", 40, gamma=4, beam_width=2, sampling=sampling, seed=seed)
        return generate_tokens(FakeLM(vocab=6, salt=2, n_seq_max=5), None, PROMPT, cfg)[0]

    assert run(3) == run(3)
    assert any(run(s) != run(3) for s in (4, 5, 6))


def test_needs_its_beam_sequences():
    with pytest.raises(OptionError, match="needs a target context with 9 sequences"):
        Generation(FakeLM(n_seq_max=5), None, PROMPT, DecodeConfig("beam", beam_width=4))


def test_ends_at_eog_inside_a_window():
    target = FakeLM(vocab=5, salt=1, n_seq_max=9, eog=0)
    out, st = generate_tokens(target, None, PROMPT, DecodeConfig("beam", 200, seed=1))
    assert st.finish_reason == "stop" and 0 not in out and len(out) < 200


@pytest.fixture(scope="module")
def smol_beam(smol_files):
    """The default pair's target alone, sized by open_pair from beam's layout (w 4, gamma 4)."""
    from mtad_edge.loader import ModelOptions, open_pair

    with open_pair(smol_files, ["beam"], 4, 4, ModelOptions(n_ctx=512)) as models:
        assert models.aux is None and models.target.n_seq_max == 9
        yield models.target


@pytest.mark.slow
def test_real_target_beam(smol_beam, monkeypatch):
    """Width 1 at temperature 0 is greedy ar token for token; width 4 commits the best joint of
    its final beams (recomputed token by token on the target) and runs again identically."""
    import mtad_edge.runtime.methods.beam as beam_module
    from mtad_edge.runtime.backend import Batch

    t = smol_beam
    ids = t.tokenize("<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n")
    greedy_cfg = SamplingConfig(temperature=0.0)
    narrow = DecodeConfig("beam", 24, gamma=4, beam_width=1, sampling=greedy_cfg)
    assert generate_tokens(t, None, ids, narrow)[0] == greedy(t, None, ids, 24)[0]
    drafts = []

    class Spy(beam_module.BeamDrafter):
        def propose(self, tokens, gamma, width, rows=False, keep_going=None):
            drafts.append(super().propose(tokens, gamma, width, rows, keep_going))
            return drafts[-1]

    monkeypatch.setattr(beam_module, "BeamDrafter", Spy)
    cfg = DecodeConfig("beam", 4, gamma=4, beam_width=4, sampling=greedy_cfg)
    wide, st = generate_tokens(t, None, ids, cfg)
    assert st.target_calls == 4 and len(wide) == 4 and generate_tokens(t, None, ids, cfg)[0] == wide
    score = SamplingConfig(1.0)  # greedy beams rank by the temperature-1 filtered joint

    def joint_real(window):
        total = 0.0
        for i in range(len(window)):
            t.rollback(0, 0)
            logits = np.array(t.decode(Batch.run(ids + window[:i], 0)))[-1]
            total += filtered_logprobs(logits, score)[window[i]]
        t.rollback(0, 0)
        return total

    joints = [joint_real(b) for b in drafts[0].beams.tolist()]
    assert wide == drafts[0].beams[int(np.argmax(joints))].tolist()
    np.testing.assert_allclose(joints, drafts[0].beams_logq.sum(axis=1), atol=0.05)


@pytest.mark.slow
def test_engine_opens_room_for_beam_by_default(smol_files):
    """Engine.open's default method list includes beam, so a plain engine serves it at the
    default width, and on a target-only pair too."""
    from mtad_edge import Engine
    from mtad_edge.pairs import Pair

    with Engine.open(Pair(target=smol_files.target, aux=None), defaults=DecodeConfig("ar")) as eng:
        r = eng.generate("The capital of France is", method="beam", max_tokens=8, seed=1)
        r.text()
        assert r.stats.method == "beam" and r.stats.generated == 8 and r.stats.target_calls == 8


def test_auto_gamma_and_width_mean_the_papers_window_and_width():
    """No controller adapts beam (nothing drafts): 'auto' is gamma 4 and width 4, every step."""
    target = FakeLM(vocab=5, salt=4, n_seq_max=9)
    gen = Generation(target, None, PROMPT, DecodeConfig("beam", 12, gamma="auto", beam_width="auto", seed=2))
    blocks = list(gen)
    assert [len(b) for b in blocks] == [4, 4, 4] and gen.stats.target_calls == 12
    fixed = DecodeConfig("beam", 12, gamma=4, beam_width=4, seed=2)
    assert generate_tokens(FakeLM(vocab=5, salt=4, n_seq_max=9), None, PROMPT, fixed)[0] == sum(blocks, [])
