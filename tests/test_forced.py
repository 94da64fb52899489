"""A grammar's forced spans drafted for free (runtime/drafting/forced.py): drafted with no model
call, continued by the aux in the same verify, kept by the target, and sd still lossless with
respect to the masked target where a span's bytes can be tokenised several ways."""

import json

import numpy as np
import pytest

from helpers import ASCII, FakeLM, PieceLM, chi2_critical, chi2_stat, counted, generate_tokens
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.drafting import Drafters
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.rules.sampling import filtered_logprobs
from mtad_edge.runtime.text import constraint as C
from mtad_edge.runtime.text.constraint import Grammar
from mtad_edge.textstream import detokenize

T1 = SamplingConfig(1.0, 0, 1.0)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def ascii_pair():
    return (
        FakeLM(salt=1, n_seq_max=9, alphabet=ASCII, sharpness=2.0),
        FakeLM(salt=2, n_seq_max=9, alphabet=ASCII, sharpness=2.0),
    )


def joined_steps(monkeypatch) -> list:
    """The offers of the steps that drafted a forced span and the aux's draft after it."""
    seen, real = [], Drafters.choose

    def choose(self, tokens, cap, step):
        offer = real(self, tokens, cap, step)
        if offer.then is not None:
            seen.append(offer)
        return offer

    monkeypatch.setattr(Drafters, "choose", choose)
    return seen


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
@pytest.mark.parametrize("sampling", [SamplingConfig(0.0), T1])
def test_forced_spans_are_drafted_free_kept_and_joined_with_the_aux(method, sampling, monkeypatch):
    t, a = ascii_pair()
    joined = joined_steps(monkeypatch)
    schema = C.compile(Grammar.json_schema(SCHEMA), t)
    prompt = t.tokenize("w:")
    for seed in range(3):
        cfg = DecodeConfig(method, 60, gamma=3, sampling=sampling, seed=seed)
        out, st = generate_tokens(t, a, prompt, cfg, constraint=schema)
        forced = st.drafters["forced"]
        # one byte a token: a forced byte is the one token the mask allows, so the target keeps it
        assert forced["drafted"] > 0 and forced["accepted"] == forced["drafted"]
        assert st.drafted == forced["drafted"] + st.drafters["aux"]["drafted"]
        if st.finish_reason == "stop":
            answer = json.loads(detokenize(t, [x for x in out if not t.is_eog(x)]))
            assert set(answer) == {"city", "unit"} and answer["unit"] in ("celsius", "fahrenheit")
    # a span and the aux's draft after it in one verify: the aux fed the span in its first call
    assert joined and all(o.then.after == tuple(int(x) for x in o.found) for o in joined)


def test_forced_spans_need_no_model_alone_the_target_verifies_them():
    """``--drafter forced``: the spans are the only drafts; no aux model is needed at all."""
    t, _ = ascii_pair()
    cfg = DecodeConfig("sd", 60, drafter="forced", sampling=SamplingConfig(0.0))
    out, st = generate_tokens(t, None, t.tokenize("w:"), cfg, constraint=Grammar.json_schema(SCHEMA))
    ar, _ = generate_tokens(
        t,
        None,
        t.tokenize("w:"),
        DecodeConfig("ar", 60, sampling=SamplingConfig(0.0)),
        constraint=Grammar.json_schema(SCHEMA),
    )
    assert out == ar and st.drafted == counted(st, "forced") > 0
    assert st.target_calls < len(out)  # the spans cost a verify row, not a step each


def test_drafter_forced_without_a_constraint_is_refused():
    t, _ = ascii_pair()
    with pytest.raises(OptionError, match="drafter forced drafts a grammar's forced spans"):
        generate_tokens(t, None, t.tokenize("w:"), DecodeConfig("sd", 10, drafter="forced"))


class Pieces(PieceLM):
    """Pieces with an end-of-generation token, tokenising as llguidance's tokenizer callback asks."""

    def tokenize(self, text, add_special=True, special=True):
        return super().tokenize(text, add_special)


# "abc" can be written as abc, ab+c, a+bc or a+b+c: the grammar forces its bytes; llguidance's mask
# then allows their canonical tokens alone (abc), so the target keeps them.
PIECES = [b"", b"a", b"b", b"c", b"ab", b"bc", b"abc", b"p", b"q"]


@pytest.mark.parametrize("verify", ["block", "token"])
def test_sd_with_forced_spans_keeps_the_masked_target_distribution(verify, monkeypatch):
    """The first two tokens of constrained sd with a forced span joined to the aux's draft (its q
    rows one-hot on the span, then the aux's) are distributed as constrained sampling from the
    target alone."""
    t = Pieces(PIECES, salt=1, sharpness=1.0, eog=0)
    aux = Pieces(PIECES, salt=7, n_seq_max=3, sharpness=1.0, eog=0)
    compiled = C.compile(Grammar.regex("abc[pq]{1,3}"), t)
    assert compiled.start().forced() == [6]  # the span's canonical token: abc
    m, prompt = compiled.start(), [7, 8]

    def p(ctx, path):
        return np.exp(filtered_logprobs(np.where(m.allowed(path), t.logits_for(ctx), -np.inf), T1))

    v = t.n_vocab
    joint = np.zeros((v, v))
    p1 = p(prompt, ())
    assert np.flatnonzero(p1).tolist() == [6]  # the mask allows the span's canonical tokens alone
    for x in np.flatnonzero(p1):
        joint[x] = p1[x] * p([*prompt, int(x)], (int(x),))
    counts = np.zeros(v * v)
    kept = drafted = 0
    joined = joined_steps(monkeypatch)
    for seed in range(1500):  # 4 tokens: room for the aux's draft after the span (its q rows stacked below)
        cfg = DecodeConfig("sd", 4, gamma=3, sampling=T1, verify=verify, seed=seed)
        out, st = generate_tokens(t, aux, prompt, cfg, constraint=compiled)
        counts[out[0] * v + out[1]] += 1
        drafted, kept = drafted + counted(st, "forced"), kept + counted(st, "forced", "accepted")
    stat, df = chi2_stat(counts, joint.ravel())
    assert drafted >= 1500 and kept == drafted and len(joined) >= 1500 and stat < chi2_critical(df)


@pytest.mark.slow
def test_the_default_pair_keeps_its_forced_spans(smol_models):
    """On the real vocabulary the forced bytes' canonical tokens are what the target writes: kept
    95 % of the time or more, and a share of the answer's tokens."""
    target, aux = smol_models.target, smol_models.aux
    ids = target.tokenize("<|im_start|>user\nThe weather in Paris as JSON.<|im_end|>\n<|im_start|>assistant\n")
    drafted = kept = generated = 0
    for method, temperature in (("mtad", 0.0), ("sd", 1.0)):
        cfg = DecodeConfig(method, 48, sampling=SamplingConfig(temperature, 10, 0.9), seed=2)
        out, st = generate_tokens(target, aux, ids, cfg, reuse=False, constraint=Grammar.json_schema(SCHEMA))
        drafted, kept = drafted + counted(st, "forced"), kept + counted(st, "forced", "accepted")
        generated += st.generated
        if st.finish_reason == "stop":
            json.loads(detokenize(target, [x for x in out if not target.is_eog(x)]))
    assert drafted and kept >= 0.95 * drafted and kept / generated > 0.2
