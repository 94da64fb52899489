"""Issue 13, on fake backends: abandoned and stopped requests free the server, the server says
what it does not support, a seed means a fresh-engine answer, bad input is a ValueError naming
the parameter. (The same cases on the real models and through real processes: test_server.py,
test_signals.py.)"""

from __future__ import annotations

import codecs
import gc
import json
import socket
import threading

import numpy as np
import pytest

import mtad_edge.store as store
from helpers import FakeLM, Served, SlowLM, fake_engine, wait_until
from mtad_edge.engine import Engine
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.errors import OptionError
from mtad_edge.runtime.rules.sampling import log_softmax


def engine_over(target, aux=None, **defaults) -> Engine:
    """The fake engine over ``target`` with a slow aux (a long answer is still running when a test acts)."""
    return fake_engine(target, aux or SlowLM(salt=2, n_seq_max=9, n_ctx=target.n_ctx, vocab=target.n_vocab), **defaults)


@pytest.fixture
def served():
    target = SlowLM(salt=1, n_seq_max=5, n_ctx=4096)
    s = Served(engine_over(target))
    yield s
    s.close()


LONG = {"prompt": "abc", "max_tokens": 100000, "method": "mtad"}  # runs until the context is full
SHORT = {"prompt": "abc", "max_tokens": 4}


def statuses(served: Served, n: int, body) -> list[int]:
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(served.post(body)[0])) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(out)


def held(served: Served) -> list:
    """The responses of the requests the server holds (a place is taken before its response is built)."""
    return [t.response for t in list(served.runs.active) if t.response is not None]


def track_cancels(served: Served) -> dict:
    """For each response the server holds now: how many tokens it had when it was cancelled."""
    at_cancel: dict = {}
    for r in held(served):
        real = r.cancel

        def cancel(r=r, real=real):
            at_cancel.setdefault(r, len(r.tokens))
            real()

        r.cancel = cancel
    return at_cancel


def test_abandoned_non_stream_requests_are_cancelled_and_free_their_places(served):
    socks = [served.abandon_later(LONG) for _ in range(3)]  # 1 running + 2 waiting: the server is full
    wait_until(lambda: len(held(served)) == 3)
    responses = held(served)
    at_cancel = track_cancels(served)
    assert served.post(SHORT)[0] == 429
    for s in socks:
        s.close()  # the clients time out and go away
    wait_until(lambda: not served.runs.active)
    assert all(r.finish_reason == "cancelled" for r in responses)
    for r in responses:  # stopped within one decoding step of the cancel (gamma 4: at most 5 tokens a step)
        assert len(r.tokens) - at_cancel[r] <= 5
    assert statuses(served, 3, SHORT) == [200, 200, 200]


def test_a_client_gone_before_its_body_arrived_leaves_no_trace(served, caplog):
    sock = socket.create_connection(("127.0.0.1", served.port))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += b"Content-Type: application/json\r\nContent-Length: 999\r\n\r\n"
    sock.sendall(head + b'{"prompt": "ab')
    sock.close()
    assert served.post(SHORT)[0] == 200 and not served.runs.active
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_abandoned_stream_is_cancelled_too(served):
    sock = served.abandon_later({**LONG, "stream": True})
    assert sock.recv(100).startswith(b"HTTP/1.1 200")
    wait_until(lambda: len(held(served)) == 1)
    (r,) = held(served)
    sock.close()
    wait_until(lambda: not served.runs.active)
    assert r.finish_reason == "cancelled"


def test_stop_all_ends_running_and_waiting_requests_at_once(served):
    results: list[tuple[int, dict]] = []
    threads = [threading.Thread(target=lambda: results.append(served.post(LONG))) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: len(served.runs.active) == 3)
    served.runs.stop_all()  # what SIGINT/SIGTERM does in `mtad-edge serve`
    for t in threads:
        t.join(30)
    assert [s for s, _ in results] == [503, 503, 503]
    assert results[0][1]["error"]["message"] == "the server is shutting down"
    assert served.post(SHORT)[0] == 503


class SlowTokenizer(SlowLM):
    """Tokenizing a prompt that starts with 'slow' lasts until ``release`` is set (a huge prompt
    takes llama.cpp seconds)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.tokenizing, self.release = threading.Event(), threading.Event()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        if text.startswith("slow"):
            self.tokenizing.set()
            self.release.wait(30)
        return super().tokenize(text, add_special)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_tokenized_in_its_place_off_the_loop_and_cancelled_there(stream):
    """Tokenizing ran on the event loop before admission: every other client waited for it."""
    target = SlowTokenizer(salt=1, n_seq_max=5, n_ctx=4096)
    s = Served(engine_over(target))
    try:
        sock = s.abandon_later({**LONG, "prompt": "slow abc", "stream": stream})
        assert target.tokenizing.wait(10)
        assert s.get("/v1/models")[0] == 200  # the loop answers while it tokenizes
        (ticket,) = s.runs.active  # its place is taken
        sock.close()  # the client leaves while its prompt is tokenized
        wait_until(lambda: ticket.cancelled)
        target.release.set()
        wait_until(lambda: not s.runs.active)  # built, cancelled at once: it never ran
        assert ticket.response.finish_reason == "cancelled" and ticket.response.tokens == []
        results: list = []
        waiting = threading.Thread(target=lambda: results.append(s.post({**LONG, "prompt": "slow abc"})))
        target.release.clear()
        waiting.start()
        wait_until(lambda: len(s.runs.active) == 1)
        s.runs.stop_all()  # SIGTERM while a prompt is tokenized
        target.release.set()
        waiting.join(30)
        assert results[0][0] == 503, results
    finally:
        target.release.set()
        s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_its_refused_prompt_was_tokenized_leaves_no_trace(stream, caplog):
    target = SlowTokenizer(salt=1, n_seq_max=5, n_ctx=64)
    s = Served(engine_over(target))
    try:
        sock = s.abandon_later({**SHORT, "prompt": "slow" + "a" * 100, "stream": stream})  # too long for 64
        assert target.tokenizing.wait(10)
        sock.close()
        wait_until(lambda: all(t.cancelled for t in s.runs.active))
        target.release.set()
        wait_until(lambda: not s.runs.active)
        assert s.post(SHORT)[0] == 200
        gc.collect()  # an exception no one retrieved is logged when its future is collected
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        target.release.set()
        s.close()


def test_max_tokens_is_capped_by_the_context():
    s = Served(engine_over(SlowLM(salt=1, n_seq_max=5, n_ctx=64)))
    try:
        status, out = s.post({"prompt": "abc", "max_tokens": 1_000_000_000})
        assert status == 200 and out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] < 64 and out["mtad_stats"]["finish_reason"] == "context"
    finally:
        s.close()


@pytest.mark.parametrize(
    "extra,status,param",
    [
        ({"model": 5}, 400, "model"),
        ({"stream": "yes"}, 400, "stream"),
        ({"stream": 1}, 400, "stream"),
        ({"response_format": {"type": "yaml"}}, 400, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, 400, "tools"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty"),  # OpenAI's range is -2..2
        ({"frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"logit_bias": {"50": 100}}, 400, "logit_bias"),
        ({"no_such_field": 1}, 400, "no_such_field"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"logprobs": "yes"}, 400, "logprobs"),
        ({"logprobs": True, "stream": True}, 400, "logprobs"),
        ({"n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "a\udcffb"}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages"),
    ],
)
def test_the_server_refuses_what_it_does_not_do(served, extra, status, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    code, err = served.post(json.dumps(body).encode(), "/v1/chat/completions")
    assert code == status and err["error"]["param"] == param, err
    assert set(err["error"]) == {"message", "type", "param", "code"}


def test_neutral_values_of_unsupported_fields_are_accepted(served):
    """What clients send by default (penalties 0, no tools, text format) changes nothing."""
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "n": 1,
        "user": "someone",
        "stream": False,
        "logprobs": False,
        "seed": None,
    }
    code, out = served.post(body, "/v1/chat/completions")
    assert code == 200 and out["choices"][0]["message"]["content"], out
    assert served.post({"prompt": "abc", "max_tokens": 2, "echo": False, "best_of": 1, "suffix": ""})[0] == 200


def test_unknown_routes_are_openai_errors(served):
    code, err = served.get("/v1/nothing")
    assert code == 404 and "error" in err


def test_any_model_name_is_served_unless_strict_model():
    """Apps send a fixed model name: the one model answers it, as llama-server does; with
    strict_model (--strict-model) another name is OpenAI's 404."""
    import openai

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1}
    for strict in (False, True):
        s = Served(fake_engine(), strict_model=strict)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused", max_retries=0)
            ours = client.chat.completions.create(model="fake", **body)
            assert ours.model == "fake" and client.models.retrieve("fake").id == "fake"
            if strict:
                with pytest.raises(openai.NotFoundError) as e:
                    client.chat.completions.create(model="gpt-4o", **body)
                assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
                with pytest.raises(openai.NotFoundError):
                    client.models.retrieve("gpt-4o")
            else:
                other = client.chat.completions.create(model="gpt-4o", **body)
                assert other.model == "fake"  # the model that answered, as OpenAI names it
                assert other.choices[0].message.content == ours.choices[0].message.content  # the same seeded answer
                assert client.models.retrieve("gpt-4o").id == "fake"
        finally:
            s.close()


def test_logprobs_are_the_targets_raw_distribution(served):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "seed": 3}
    code, plain = served.post(body, "/v1/chat/completions")
    code, out = served.post({**body, "logprobs": True, "top_logprobs": 3}, "/v1/chat/completions")
    assert code == 200
    choice = out["choices"][0]
    assert choice["message"]["content"] == plain["choices"][0]["message"]["content"]  # asking changes nothing
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 12
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and c["logprob"] <= tops[0] + 1e-12
    code, text = served.post({"prompt": "abc", "max_tokens": 6, "seed": 1, "logprobs": 2})
    lp = text["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 6
    assert lp["text_offset"] == list(range(6)) and all(len(t) <= 3 for t in lp["top_logprobs"])


def test_logprobs_values_equal_the_fake_models_log_softmax():
    t = FakeLM(salt=1, n_seq_max=5)
    eng = engine_over(t, FakeLM(salt=2, n_seq_max=9))
    r = eng.generate("abc", max_tokens=8, seed=2, logprobs=2)
    r.text()
    ctx = t.tokenize("abc")
    for tok, e in zip(r.tokens, r.logprobs):
        row = log_softmax(t.logits_for(ctx))
        assert e.token == tok and e.logprob == pytest.approx(row[tok])
        assert [a[0] for a in e.top] == list(np.argsort(-row, kind="stable")[:2])
        ctx = ctx + [tok]
    assert t.held(0) == t.tokenize("abc") + r.tokens[:-1]  # the cache is left as a run leaves it


# -- the Python API ---------------------------------------------------------------------------------
def test_two_responses_iterated_alternately_in_one_thread_raise_instead_of_deadlocking():
    eng = fake_engine()
    a = iter(eng.generate("abc", max_tokens=10, seed=1))
    next(a)
    b = eng.generate("abd", max_tokens=10, seed=1)
    with pytest.raises(RuntimeError, match="being iterated in this thread"):
        next(iter(b))
    assert "".join(a)  # the first one is unharmed
    assert eng.generate("abd", max_tokens=3, seed=1).text()


def test_without_a_seed_each_request_draws_one_and_reports_it():
    eng = fake_engine()
    runs = [eng.generate("abc", max_tokens=30, method="ar") for _ in range(2)]
    texts = [r.text() for r in runs]
    seeds = [r.stats.seed for r in runs]
    assert seeds[0] != seeds[1] and texts[0] != texts[1]
    again = eng.generate("abc", max_tokens=30, method="ar", seed=seeds[0]).text()
    assert again == texts[0]  # the reported seed reproduces the answer


def test_a_seeded_request_starts_from_a_fresh_cache_and_an_unseeded_one_reuses_it():
    eng = fake_engine()
    eng.generate("abcabc", max_tokens=4, seed=1).text()
    seeded = eng.generate("abcabc", max_tokens=4, seed=1)
    seeded.text()
    unseeded = eng.generate("abcabc", max_tokens=4)
    unseeded.text()
    assert seeded.stats.cached_tokens == 0 and unseeded.stats.cached_tokens > 0
    defaults = fake_engine(seed=0)  # an engine-wide seed makes every request seeded
    defaults.generate("abcabc", max_tokens=4).text()
    r = defaults.generate("abcabc", max_tokens=4)
    r.text()
    assert r.stats.cached_tokens == 0


class ShapeLM(FakeLM):
    """A FakeLM whose logits also depend on the size of the batch each cached token was evaluated
    in, as llama.cpp's do (slightly): a prefix reused from another request's cache gives other
    logits than a fresh prefill of the same prompt."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.shapes: dict[int, list[int]] = {}

    def decode(self, batch):
        self.calls += 1
        rows = []
        for tok, pos, seq_ids, want in zip(batch.tokens, batch.pos, batch.seq_ids, batch.logits):
            for s in seq_ids:
                self.seqs.setdefault(s, []).append(tok)
                self.shapes.setdefault(s, []).append(len(batch))
                assert len(self.seqs[s]) == pos + 1
            if want:
                rows.append(self.logits_for(self.seqs[seq_ids[0]] + [-n for n in self.shapes[seq_ids[0]]]))
        return np.array(rows, dtype=np.float32).reshape(len(rows), self.n_vocab)

    def copy_seq(self, src, dst, p0=-1, p1=-1):
        super().copy_seq(src, dst, p0, p1)
        s, d = self.shapes.get(src, []), self.shapes.setdefault(dst, [])
        lo, hi = max(p0, 0), (len(s) if p1 < 0 else p1)
        d[lo:hi] = s[lo:hi]

    def rollback(self, seq, n_keep):
        super().rollback(seq, n_keep)
        del self.shapes.setdefault(seq, [])[n_keep:]

    def clear(self):
        super().clear()
        self.shapes.clear()


def shape_engine() -> Engine:
    return engine_over(ShapeLM(salt=1, n_seq_max=5), ShapeLM(salt=2, n_seq_max=9))


@pytest.mark.parametrize("method", ["ar", "sd", "mtad", "mmtad"])
def test_a_seed_gives_what_a_fresh_engine_gives_whatever_ran_before(method):
    """The probe: A twice, then B (sharing A's first tokens), then A again, all with seed 1."""
    a, b = "abcabcab", "abcbbbbbba"
    fresh = shape_engine().generate(a, max_tokens=24, seed=1, method=method).text()
    eng = shape_engine()
    got = [eng.generate(a, max_tokens=24, seed=1, method=method).text() for _ in range(2)]
    eng.generate(b, max_tokens=24, seed=1, method=method).text()
    eng.generate(b, max_tokens=24, method=method).text()  # unseeded: may reuse the cache
    got.append(eng.generate(a, max_tokens=24, seed=1, method=method).text())
    assert got == [fresh] * 3


def test_on_such_a_backend_reusing_the_cache_would_change_the_answer():
    """What the rule above prevents (the engine reused the cache for every request before)."""
    from mtad_edge.runtime.decoding import Generation

    t, a = ShapeLM(salt=1, n_seq_max=5), ShapeLM(salt=2, n_seq_max=9)
    cfg = DecodeConfig("ar", 24, seed=1)

    def run(prompt, reuse):
        return [x for block in Generation(t, a, t.tokenize(prompt), cfg, reuse=reuse) for x in block]

    fresh = run("abcabcab", False)
    run("abcbbbbbba", True)
    assert run("abcabcab", True) != fresh and run("abcabcab", False) == fresh


@pytest.mark.parametrize("prompt", ["abc\udcff\udcfedef", "x\ud800"])
def test_text_that_is_not_utf8_is_a_value_error_naming_the_parameter(prompt):
    eng = fake_engine()
    with pytest.raises(OptionError, match="not valid UTF-8") as e:
        eng.generate(prompt)
    assert e.value.param == "prompt" and isinstance(e.value, ValueError)
    with pytest.raises(OptionError, match="not valid UTF-8") as e:
        eng.chat([{"role": "user", "content": prompt}])
    assert e.value.param == "messages"
    with pytest.raises(OptionError, match="must be a string") as e:
        eng.chat([{"role": "user", "content": 5}])


class Utf8LM(FakeLM):
    """Token 0 is the first byte of "é" (2 bytes), token 1 its second byte, others ASCII."""

    def token_bytes(self, token: int) -> bytes:
        return [b"\xc3", b"\xa9", b"a", b"b", b"c"][token]


def test_max_tokens_inside_a_character_drops_the_incomplete_tail():
    t = Utf8LM(salt=1, n_seq_max=5)
    eng = engine_over(t, Utf8LM(salt=2, n_seq_max=9))
    cut = 0
    for seed in range(100):
        r = eng.generate("abc", max_tokens=6, seed=seed, method="ar", top_k=0, top_p=1.0)
        text = r.text()
        raw = b"".join(t.token_bytes(x) for x in r.tokens)
        complete = codecs.getincrementaldecoder("utf-8")("replace").decode(raw)  # the incomplete tail held back
        assert text == complete
        cut += complete != raw.decode("utf-8", "replace")  # where a U+FFFD used to end the text
    assert cut > 0


def test_a_model_cache_that_cannot_be_written_is_one_error_naming_it(tmp_path, monkeypatch):
    """(A read-only file system, through the console script: test_signals.py.)"""
    import mtad_edge.pairs as pairs
    from mtad_edge.runtime.errors import MtadEdgeError

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("MTAD_EDGE_HOME", str(blocked))
    with pytest.raises(MtadEdgeError, match=f"cannot write the model cache {blocked / 'smollm2-135m'}: "):
        pairs.prepare(pairs.load_manifest("smollm2-135m"))


@pytest.mark.slow
def test_models_prepare_verifies_the_sha256_and_derives_a_changed_file_again(tmp_path, monkeypatch):
    """A file corrupted in place with its size and mtime kept passes the quick check every command
    makes; `models prepare` hashes it and derives it again."""
    import os

    from click.testing import CliRunner

    import mtad_edge.pairs as pairs
    from mtad_edge.cli import cli

    monkeypatch.setenv("MTAD_EDGE_HOME", str(tmp_path))
    m = pairs.load_manifest("smollm2-135m")
    p = pairs.prepare(m)
    st = p.aux.stat()
    with p.aux.open("r+b") as f:  # flip bytes in the middle, keep the size and the mtime
        f.seek(st.st_size // 2)
        f.write(b"\xff" * 64)
    os.utime(p.aux, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pairs.prepare(m) == p and store.sha256_file(p.aux) != m.data["aux"]["sha256"]  # quick: not seen
    r = CliRunner().invoke(cli, ["models", "prepare", "smollm2-135m"])
    assert r.exit_code == 0 and "changed since it was written" in r.stderr and "sha256 verified" in r.stdout
    assert store.sha256_file(p.aux) == m.data["aux"]["sha256"]
