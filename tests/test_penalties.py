"""llama.cpp's repeat penalty and OpenAI's presence and frequency penalties (runtime/rules/shape.py):
the formula, every method giving ar's penalised text greedily, sd lossless with respect to the
penalised target (each verify row penalised for the text it follows), and the surfaces."""

import http.client
import json

import numpy as np
import pytest

from helpers import TWO_TOKEN_RUN, FakeLM, Served, chi2_critical, chi2_stat, fake_engine, generate_tokens
from mtad_edge.runtime.config import DecodeConfig, SamplingConfig
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.rules.sampling import filtered_logprobs
from mtad_edge.runtime.rules.shape import Penalties

PROMPT = [1, 2, 3, 1, 2]


def test_the_penalties_are_llama_cpps_and_openais():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], dtype=np.float32)
    tail = [0, 0, 1, 3]  # token 0 twice, 1 and 3 once, 2 never
    out = Penalties(repeat=2.0, last_n=64, presence=0.25, frequency=0.5).apply(logits, [tail])[0]
    expect = [2.0 / 2 - 0.25 - 2 * 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0 / 2 - 0.25 - 0.5]
    assert np.allclose(out, expect) and logits[0, 0] == 2.0  # a new array
    assert Penalties.of(SamplingConfig()) is None  # the default asks for none: nothing is done
    assert Penalties.of(SamplingConfig(repeat_penalty=1.1, repeat_last_n=0)) is None


@pytest.mark.parametrize("method", ["sd", "mtad", "mmtad"])
def test_greedy_drafting_gives_ar_s_penalised_text(method):
    sampling = SamplingConfig(0.0, repeat_penalty=1.5, repeat_last_n=8, presence_penalty=0.3, frequency_penalty=0.2)
    target, aux = FakeLM(salt=1, n_seq_max=9, vocab=6), FakeLM(salt=2, n_seq_max=9, vocab=6)
    ar, _ = generate_tokens(target, None, PROMPT, DecodeConfig("ar", 50, sampling=sampling))
    plain, _ = generate_tokens(target, None, PROMPT, DecodeConfig("ar", 50, sampling=SamplingConfig(0.0)))
    assert ar != plain  # the penalties change the text
    for gamma in (1, 3):
        out, st = generate_tokens(target, aux, PROMPT, DecodeConfig(method, 50, gamma=gamma, sampling=sampling))
        assert out == ar and st.accepted > 0, gamma


@pytest.mark.parametrize("verify", ["block", "token"])
def test_sd_is_lossless_for_the_penalised_target(verify):
    """The first two tokens of sd are distributed as sampling from the penalised target alone:
    the second row is penalised for the first token too."""
    sampling = SamplingConfig(1.0, 0, 1.0, repeat_penalty=1.8, repeat_last_n=4, frequency_penalty=0.4)
    target, aux = FakeLM(salt=1, sharpness=1.0), FakeLM(salt=7, n_seq_max=3, sharpness=1.0)
    prompt, pen = [1, 2, 1, 2], Penalties.of(sampling)
    assert pen is not None

    def p(ctx):
        row = pen.apply(target.logits_for(ctx)[None], [ctx[-pen.last_n :]])
        return np.exp(filtered_logprobs(row, sampling)[0])

    v = target.n_vocab
    joint = np.zeros((v, v))
    p1 = p(prompt)
    for a in range(v):
        joint[a] = p1[a] * p([*prompt, a])
    counts = np.zeros(v * v)
    for seed in range(3000):
        cfg = DecodeConfig("sd", TWO_TOKEN_RUN, gamma=3, verify=verify, sampling=sampling, seed=seed)
        out, _ = generate_tokens(target, aux, prompt, cfg)
        counts[out[0] * v + out[1]] += 1
    stat, df = chi2_stat(counts, joint.ravel())
    assert stat < chi2_critical(df)


def test_the_engine_and_the_server_take_them_and_bound_them():
    engine = fake_engine()
    text = engine.generate("abc", max_tokens=8, seed=1, repeat_penalty=1.3, presence_penalty=0.5, min_p=0.05).text()
    assert isinstance(text, str)
    with pytest.raises(OptionError, match="presence_penalty must be a number in \\[-2, 2\\]"):
        engine.generate("abc", presence_penalty=3)
    s = Served(engine)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        body = {"prompt": "abc", "max_tokens": 4, "frequency_penalty": 0.5, "repeat_penalty": 1.2, "min_p": 0.1}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
        conn.request("POST", "/v1/completions", json.dumps({**body, "frequency_penalty": 9}),
                     {"Content-Type": "application/json"})  # fmt: skip
        r = conn.getresponse()
        assert r.status == 400 and json.loads(r.read())["error"]["param"] == "frequency_penalty"
    finally:
        s.close()
