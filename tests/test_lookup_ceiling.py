"""Prompt lookup's ceiling on a text (bench/lookup.py): what a lookup draft could keep at each
position, the cheapest steps over the text, and that real lookup drafting never beats it."""

import itertools
import random

import pytest

from helpers import FakeLM, counted, generate_tokens
from mtad_edge.bench.lookup import ceiling, cheapest_cover, keepable
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig

REPEATS = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


def test_keepable_counts_the_lookup_tokens_the_text_goes_on_with():
    # After "1 2" the lookup drafts "3 4 5 1 2" (what followed 1 2 in the prompt): the text keeps
    # "3 4" of it; after "1 2 3" it drafts "4 5 ..." and keeps "4"; elsewhere nothing matches.
    prompt, tokens = [1, 2, 3, 4, 5], [1, 2, 3, 4, 9]
    assert keepable(prompt, tokens, 8) == [0, 0, 2, 1, 0]
    assert keepable(prompt, tokens, 1) == [0, 0, 1, 1, 0]  # drafts of one token keep one at most
    assert keepable(prompt, [], 8) == []


def _brute_force(kept, price):
    """Every way to cover the text by steps, the cheapest (seconds, steps)."""
    n, best = len(kept), None
    for choice in itertools.product(*(range(k + 1) for k in kept)):
        i, seconds, steps = 0, 0.0, 0
        while i < n:  # only the choices at the positions a step starts from count
            seconds, steps, i = seconds + price(choice[i]), steps + 1, i + choice[i] + 1
        if best is None or (seconds, steps) < best:
            best = (seconds, steps)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_cheapest_cover_is_the_cheapest_of_all_step_choices(seed):
    rng = random.Random(seed)
    kept = [rng.choice([0, 0, 1, 2, 3]) for _ in range(rng.randint(1, 9))]
    kept = [min(k, len(kept) - i - 1) for i, k in enumerate(kept)]  # a draft ends with the text
    slope, base = rng.choice([0.0, 0.15, 0.6, 1.5]), rng.uniform(0.5, 2)
    price = lambda j: base + slope * j  # noqa: E731
    seconds, steps = cheapest_cover(kept, price)
    assert (seconds, steps) == pytest.approx(_brute_force(kept, price))


def test_the_ceiling_is_plain_decoding_where_nothing_is_keepable_and_its_block_efficiency_the_fewest_steps():
    rows = [{"label": "ar", "lookup_kept": [0, 0, 0, 0]}]
    assert ceiling(rows, lambda j: 1.0 + j) == {"block_efficiency": 1.0, "x_ar": 1.0, "keepable_share": 0.0}
    rows = [{"label": "ar", "lookup_kept": [3, 2, 1, 0, 0, 1, 0]}, {"label": "ar", "lookup_kept": [1, 0]}]
    free = ceiling(rows, lambda j: 1.0)
    # Free rows: one step over the first four tokens, two over the last three; one over the second run.
    assert free["block_efficiency"] == pytest.approx(9 / 4) and free["x_ar"] == pytest.approx(9 / 4)
    assert free["keepable_share"] == pytest.approx(5 / 9)
    # Where a kept token costs more than a plain step, drafting cannot pay: the cheapest steps are
    # plain ones. The most tokens a step do not depend on the price.
    dear = ceiling(rows, lambda j: 1.0 + 2.0 * j)
    assert dear["x_ar"] == pytest.approx(1.0) and dear["block_efficiency"] == free["block_efficiency"]
    assert ceiling([{"label": "ar", "lookup_kept": None}], lambda j: 1.0) is None


# (Greedy text is the same for every seed, so 'auto' at T=0 learns from one text not to draft.)
@pytest.mark.parametrize(("gamma", "temperature"), [(3, 0.0), (3, 0.9), ("auto", 0.9)])
def test_lookup_drafting_takes_at_least_the_fewest_steps_the_ceiling_allows(gamma, temperature):
    """Over sd's own text, each step kept at most what a lookup draft from its position could keep,
    so its target calls are never fewer than the cheapest cover's steps with free rows."""
    sampling = SamplingConfig(temperature, 4, 0.95)
    target = FakeLM(salt=1, n_seq_max=9, sharpness=1.0)
    kept_any = False
    for seed in range(20):
        cfg = DecodeConfig("sd", 40, gamma=gamma, drafter="ngram", sampling=sampling, seed=seed)
        out, st = generate_tokens(target, None, REPEATS, cfg)
        _, fewest = cheapest_cover(keepable(REPEATS, out, cfg.max_gamma), lambda j: 1.0)
        assert st.target_calls >= fewest
        kept_any |= counted(st, "ngram", "accepted") > 0
    assert kept_any  # the bound was tested against steps that kept lookup tokens
