"""draft_ahead: the next block drafted on the aux's thread while the target verifies, giving the
text that drafting in line gives (the fake backend's logits hash the whole context, so a cache
left wrong by a draft made ahead and undone changes the text)."""

import threading
import time

import pytest

from helpers import FakeLM, counted, generate_tokens
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.drafting.beams import Ahead
from mtad_edge.runtime.errors import OptionError

PROMPT = [1, 2, 3]
SAMPLINGS = [SamplingConfig(1.0, 0, 1.0), SamplingConfig(0.8, 4, 0.9), SamplingConfig(0.0)]


class Sleepy(FakeLM):
    """A FakeLM whose calls take ``delay`` seconds: a verify long enough to draft behind."""

    def __init__(self, delay: float, **kw):
        super().__init__(**kw)
        self.delay = delay
        self.threads: set[str] = set()

    def decode(self, batch):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return super().decode(batch)


def both(make_pair, **options):
    """(tokens, stats) drafting in line, then ahead, each on a fresh pair from ``make_pair``."""
    runs = []
    for ahead in ("off", "on"):
        target, aux = make_pair()
        cfg = DecodeConfig(**{"max_tokens": 80, "seed": 5, **options}, draft_ahead=ahead)
        runs.append(generate_tokens(target, aux, PROMPT, cfg))
    return runs


@pytest.mark.parametrize("method", ["sd", "mtad"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("gamma", [2, 4, "auto"])
@pytest.mark.parametrize("aux_salt", [1, 2])  # the target itself (whole drafts kept), another model
def test_drafting_ahead_gives_the_text_drafting_in_line_gives(method, sampling, gamma, aux_salt):
    (inline, st_inline), (ahead, st) = both(
        lambda: (FakeLM(salt=1, n_seq_max=5), FakeLM(salt=aux_salt, n_seq_max=9)),
        method=method,
        gamma=gamma,
        sampling=sampling,
    )
    assert ahead == inline
    assert st.gamma_hist == st_inline.gamma_hist and st.accepted == st_inline.accepted
    assert counted(st_inline, "aux", "ahead_drafts") == 0 and counted(st, "aux", "ahead_drafts") > 0
    assert 0 <= counted(st, "aux", "ahead_hits") <= counted(st, "aux", "ahead_drafts")
    if method == "sd" and aux_salt == 1 and sampling.greedy and gamma != "auto":  # its own greedy draft: all kept
        assert (
            counted(st, "aux", "ahead_hits") >= counted(st, "aux", "ahead_drafts") - 1
        )  # (the last one taken by a step that does not come)


def test_a_draft_ahead_paused_by_the_verify_is_finished_by_the_next_step(monkeypatch):
    """A verify (8 ms) shorter than the draft ahead (the guess and 4 aux calls of 3 ms): the aux
    pauses between depths when the verify is done, and the next step drafts the rest."""
    resumed = []
    finish = Ahead.finish

    def spy(self):
        resumed.append(self.draft is None)
        return finish(self)

    monkeypatch.setattr(Ahead, "finish", spy)
    (inline, _), (ahead, st) = both(
        lambda: (Sleepy(0.008, salt=1, n_seq_max=5), Sleepy(0.003, salt=1, n_seq_max=9)),
        method="mtad",
        gamma=4,
        max_tokens=40,
        sampling=SamplingConfig(0.0),
    )
    assert ahead == inline and counted(st, "aux", "ahead_hits") > 0 and any(resumed)


def test_the_aux_drafts_ahead_on_its_own_thread_while_the_target_verifies():
    target, aux = Sleepy(0.004, salt=1, n_seq_max=5), Sleepy(0.002, salt=1, n_seq_max=9)
    cfg = DecodeConfig("sd", 30, gamma=3, seed=1, sampling=SamplingConfig(0.0), draft_ahead="on")
    generate_tokens(target, aux, PROMPT, cfg)
    assert any(name.startswith("mtad-draft-ahead") for name in aux.threads)
    assert target.threads == {threading.current_thread().name}


def test_a_verify_that_fails_waits_for_the_draft_ahead_and_leaves_the_pair_usable():
    """The target fails mid-run: the error reaches the caller once the aux's thread is done (no
    aux call after it), and the next run on the same pair gives a fresh pair's text."""

    class Failing(Sleepy):
        fail_at = 6

        def decode(self, batch):
            if self.calls == self.fail_at:
                self.calls += 1
                raise RuntimeError("the target's device went away")
            return super().decode(batch)

    target, aux = Failing(0.004, salt=1, n_seq_max=5), Sleepy(0.002, salt=2, n_seq_max=9)
    cfg = DecodeConfig("mtad", 40, gamma=4, seed=3, sampling=SamplingConfig(0.0), draft_ahead="on")
    with pytest.raises(RuntimeError, match="went away"):
        generate_tokens(target, aux, PROMPT, cfg)
    calls = aux.calls
    time.sleep(0.05)
    assert aux.calls == calls  # nothing drafts on behind the error
    again, _ = generate_tokens(target, aux, PROMPT, cfg)
    fresh, _ = generate_tokens(FakeLM(salt=1, n_seq_max=5), FakeLM(salt=2, n_seq_max=9), PROMPT, cfg)
    assert again == fresh


def test_drafting_ahead_stops_where_the_run_stops():
    """A run that ends (max_tokens, or the consumer stops reading) leaves no thread behind, and
    the pair's next run is a fresh pair's."""
    target, aux = FakeLM(salt=1, n_seq_max=5), FakeLM(salt=1, n_seq_max=9)
    cfg = DecodeConfig("sd", 60, gamma=3, seed=2, sampling=SamplingConfig(0.0), draft_ahead="on")
    gen = Generation(target, aux, PROMPT, cfg)
    blocks = iter(gen)
    next(blocks), next(blocks)
    blocks.close()  # type: ignore[attr-defined]
    assert gen.drafters["aux"].ahead._pool is None
    assert not [t for t in threading.enumerate() if t.name.startswith("mtad-draft-ahead")]
    again, _ = generate_tokens(target, aux, PROMPT, cfg)
    assert again == generate_tokens(FakeLM(salt=1, n_seq_max=5), FakeLM(salt=1, n_seq_max=9), PROMPT, cfg)[0]


def test_methods_without_a_straight_aux_draft_refuse_it():
    """ar and beam draft nothing with the aux and mmtad's tree may keep another beam than the best:
    draft_ahead 'on' is refused there (issue 67: it was taken and did nothing)."""
    for method in ("ar", "beam", "mmtad"):
        with pytest.raises(OptionError, match=f"draft_ahead 'on' applies to sd and mtad .*; {method} "):
            DecodeConfig(method=method, gamma=3, draft_ahead="on")
    with pytest.raises(OptionError, match="mtad with drafter ngram does not draft with the aux"):
        DecodeConfig(method="mtad", drafter="ngram", draft_ahead="on")


def test_draft_ahead_is_an_option_with_words_for_a_bad_value():
    with pytest.raises(OptionError, match="draft_ahead must be one of off, on"):
        DecodeConfig(draft_ahead="maybe")


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"method": "mtad", "gamma": 4, "sampling": SamplingConfig(1.0)},
        {"method": "sd", "gamma": 3, "sampling": SamplingConfig(0.0)},
    ],
)
def test_drafting_ahead_on_llama_cpp_gives_the_text_drafting_in_line_gives(smol_models, options):
    """On the real pair: the aux's calls ahead are laid out as in line (its cache as the commit
    leaves it, the last drafted token and the bonus fed as one two-row call), so even llama.cpp's
    batch-shaped numerics give the same text."""
    target, aux = smol_models.target, smol_models.aux
    ids = target.tokenize(target.apply_chat_template([{"role": "user", "content": "Explain how a fridge works."}]))
    runs = []
    for ahead in ("off", "on"):
        cfg = DecodeConfig(**{"max_tokens": 64, "seed": 3, **options}, draft_ahead=ahead)
        runs.append(generate_tokens(target, aux, ids, cfg, reuse=False))
    (inline, _), (out, st) = runs
    assert out == inline and len(out) == 64
    assert counted(st, "aux", "ahead_drafts") > 0 and counted(st, "aux", "ahead_hits") > 0


def test_no_draft_ahead_where_the_guess_alone_would_outlast_the_verify():
    """Costs known (a target call 1 ms, an aux call 10 ms, and so the calls take on the run's
    clock): the loop would wait for the aux after every verify, so no draft is made ahead; the text
    is the in-line one."""
    from helpers import FakeClock
    from mtad_edge.runtime.drafting.controller import Model

    model = Model()
    for rows in range(1, 6):
        for _ in range(3):
            model.target.observe(rows, 0.001)
            model.aux.observe(rows, 0.010)
    runs = []
    for ahead in ("off", "on"):
        cfg = DecodeConfig("mtad", 40, gamma=4, seed=5, sampling=SamplingConfig(0.0), draft_ahead=ahead)
        clock = FakeClock()
        target = FakeLM(salt=1, n_seq_max=5, clock=clock, cost=lambda rows: 0.001)
        aux = FakeLM(salt=1, n_seq_max=9, clock=clock, cost=lambda rows: 0.010)
        runs.append(generate_tokens(target, aux, PROMPT, cfg, model=model, clock=clock))
    (inline, _), (out, st) = runs
    assert out == inline and counted(st, "aux", "ahead_drafts") == 0


@pytest.mark.parametrize("options", [{"no_repeat": 2}, {"repeat_bar": 3.0}, {"drafter": "ngram+aux"}])
def test_drafting_ahead_keeps_the_text_with_repeat_rules_and_prompt_lookup(options):
    """A draft ahead skips the n-grams of the text it bets on (no_repeat indexes that text, then the
    real one); beside prompt lookup, a step that takes lookup's draft undoes the aux's bet."""
    (inline, _), (ahead, st) = both(
        lambda: (FakeLM(salt=1, n_seq_max=5, vocab=4), FakeLM(salt=1, n_seq_max=9, vocab=4)),
        method="mtad",
        gamma="auto" if "drafter" in options else 4,
        sampling=SamplingConfig(1.0, 0, 1.0),
        **options,
    )
    assert ahead == inline and counted(st, "aux", "ahead_drafts") > 0
    assert counted(st, "ngram") > 0 or "drafter" not in options
