"""The embeddable API: Engine / Response, on the fake backend and on the real pair."""

import codecs
import threading
import time

import pytest

from helpers import FakeLM, fake_engine, generate_tokens
from mtad_edge.engine import Engine, StopText
from mtad_edge.runtime.backend import common_prefix
from mtad_edge.runtime.config import DecodeConfig
from mtad_edge.runtime.decoding import Generation
from mtad_edge.runtime.errors import OptionError


class Utf8LM(FakeLM):
    """Each token is one byte of UTF-8 text, so multi-byte characters span several tokens."""

    TEXT = "é€😀 ok ".encode()

    def token_bytes(self, token: int) -> bytes:
        return self.TEXT[token % len(self.TEXT)].to_bytes(1, "big")


def test_stop_text_never_emits_part_of_a_stop_string():
    s = StopText(["</end>", "STOP"])
    out = [s.push(p) for p in ["hello </", "en", "d> more"]]
    assert out == [("hello ", False), ("", False), ("", True)]
    s = StopText(["STOP"])
    assert s.push("ST") == ("", False) and s.push("AR") == ("STAR", False) and s.flush() == ""
    assert StopText([]).push("abc") == ("abc", False)


def test_generate_streams_text_and_fills_tokens_and_stats():
    eng = fake_engine()
    r = eng.generate("abc", max_tokens=20, seed=1)
    chunks = list(r)
    assert "".join(chunks) == r.text() and len(r.tokens) == r.stats.generated == 20
    assert r.finish_reason == "length" and r.stats.method == "sd"  # auto: the fake pair's costs are not measured
    assert r.stats.auto is not None and "not measured" in r.stats.auto
    assert r.text() == "".join(chr(ord("a") + t) for t in r.tokens)


def test_same_seed_same_text_per_request():
    eng = fake_engine()
    a = eng.generate("abc", max_tokens=15, seed=3, method="mmtad").text()
    b = eng.generate("abc", max_tokens=15, seed=3, method="mmtad").text()
    c = eng.generate("abc", max_tokens=15, seed=4, method="mmtad").text()
    assert a == b != c


def test_stop_strings_end_the_response():
    eng = fake_engine()
    full = eng.generate("abc", max_tokens=40, seed=2, method="ar").text()
    stop = full[10:13]
    r = eng.generate("abc", max_tokens=40, seed=2, method="ar", stop=[stop])
    assert r.text() == full[: full.find(stop)] and r.finish_reason == "stop"


def test_streaming_never_splits_a_utf8_character():
    t = Utf8LM(vocab=len(Utf8LM.TEXT), salt=1, n_seq_max=5)
    eng = fake_engine(target=t, aux=Utf8LM(vocab=len(Utf8LM.TEXT), salt=2, n_seq_max=9))
    r = eng.generate("abc", max_tokens=80, seed=0, temperature=1.0, top_k=0, top_p=1.0)
    chunks = list(r)
    for c in chunks:
        c.encode("utf-8")  # a lone surrogate or split sequence would not round-trip
        assert "\ufffd" not in c or "\ufffd" in b"".join(t.token_bytes(x) for x in r.tokens).decode("utf-8", "replace")
    raw = b"".join(t.token_bytes(x) for x in r.tokens)
    assert "".join(chunks) == codecs.getincrementaldecoder("utf-8")("replace").decode(raw)  # no cut-off tail


def test_cancel_from_another_thread():
    eng = fake_engine()
    r = eng.generate("abc", max_tokens=200, method="ar", seed=0)
    got, reached, resume = [], threading.Event(), threading.Event()

    def consume():
        for chunk in r:
            got.append(chunk)
            if len(got) == 5:  # pause mid-answer until the other thread has cancelled
                reached.set()
                resume.wait(10)

    th = threading.Thread(target=consume)
    th.start()
    assert reached.wait(10)
    r.cancel()
    resume.set()
    th.join(timeout=10)
    assert not th.is_alive() and r.finish_reason == "cancelled"
    assert len(r.tokens) == 5  # the cancel takes effect at the next block
    assert eng.generate("abc", max_tokens=3, method="ar").text()  # the engine is free again


def test_requests_run_one_at_a_time():
    eng = fake_engine()
    active, peak, lock = [0], [0], threading.Lock()

    def worker(seed):
        for _ in eng.generate("abc", max_tokens=30, seed=seed):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.0005)
            with lock:
                active[0] -= 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert peak[0] == 1


def test_cached_prefix_is_reused_and_output_is_unchanged(fake_pair):
    target, aux = fake_pair
    cfg = DecodeConfig("mtad", 12, gamma=4, seed=5)
    first, _ = generate_tokens(target, aux, [1, 2, 3], cfg)
    again, _ = generate_tokens(target, aux, [1, 2, 3], cfg)  # on the caches the first run left
    assert again == first and target.held(0) and aux.held(0)
    follow_up = [1, 2, 3] + first + [4, 4]
    reused = common_prefix(target.held(0), follow_up[:-1])
    assert reused >= 3 + len(first) - 1
    before = target.evaluated
    gen2 = Generation(target, aux, follow_up, cfg)
    blocks = iter(gen2)
    out2 = next(blocks)  # prefill + one step: the pending token and gamma draft tokens
    assert target.evaluated - before == (len(follow_up) - 1 - reused) + 1 + cfg.gamma
    assert gen2.stats.cached_tokens == reused
    out2 += [t for b in blocks for t in b]
    fresh, _ = generate_tokens(FakeLM(salt=1, n_seq_max=5), FakeLM(salt=2, n_seq_max=9), follow_up, cfg)
    assert out2 == fresh  # reusing the cache changes nothing in the output


def test_bad_options_raise_value_errors():
    eng = fake_engine()
    with pytest.raises(ValueError, match="unknown option"):
        eng.generate("abc", temprature=1)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate("abc", top_p=0)
    with pytest.raises(ValueError, match="loaded for gamma <= 8"):  # the default gamma_max
        eng.generate("abc", gamma=9)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate("abc")


@pytest.mark.slow
def test_engine_on_the_default_pair(smol_files):
    with Engine.load(pair="smollm2-135m", n_ctx=512, threads=2) as eng:
        r = eng.chat([{"role": "user", "content": "Say hello in French and in Japanese."}], max_tokens=40, seed=1)
        text = "".join(r)
        assert text == r.text() and text.strip() and r.stats.generated == len(r.tokens) > 0
        greedy = dict(max_tokens=24, temperature=0.0)
        ar = eng.generate("The capital of France is", method="ar", **greedy).tokens
        for method in ("sd", "mtad", "mmtad"):
            assert eng.generate("The capital of France is", method=method, **greedy).tokens == ar


def test_a_response_read_from_two_threads_at_once_says_so():
    """The second thread got the generator's raw 'ValueError: generator already executing'."""
    from helpers import SlowLM

    eng = fake_engine(target=SlowLM(salt=1, n_seq_max=5))
    r = eng.generate("abc", max_tokens=400, method="ar", seed=0)
    errors, started = [], threading.Event()

    def consume():
        started.set()
        for _ in r:
            pass

    th = threading.Thread(target=consume)
    th.start()
    assert started.wait(10)
    deadline = time.time() + 10
    while not errors and time.time() < deadline and th.is_alive():
        try:
            next(r)
        except RuntimeError as e:
            errors.append(str(e))
        except StopIteration:
            break
    th.join(timeout=30)
    assert errors and errors[0] == "this response is being read by another thread: read a response from one thread"


def test_engine_load_arguments_of_the_wrong_type_are_option_errors_naming_them():
    """pair=123 or target=123 were TypeErrors ('expected str'), n_ctx='x' another, and
    method_names='ar' said 'unknown method a'."""
    from mtad_edge import Engine

    cases = [
        (dict(pair=123), "pair", "pair must be a name or a path, got 123"),
        (dict(target=123), "target", "target must be a name or a path, got 123"),
        (dict(aux=b"x.gguf"), "aux", "aux must be a name or a path"),
        (dict(n_ctx="x"), "n_ctx", "n_ctx must be a positive integer, got 'x'"),
        (dict(n_ctx=0), "n_ctx", "n_ctx must be a positive integer, got 0"),
        (dict(method_names="ar"), "method_names", "method_names must be a list of method names"),
        (dict(method_names=["ar", "nope"]), "method_names", "method_names must be a list of method names"),
        (dict(flash_attn="yes"), "flash_attn", "flash_attn must be True, False or None"),
        (dict(backend=3), "backend", "unknown backend 3"),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(OptionError) as e:
            Engine.load(**kwargs)
        assert e.value.param == param and str(e.value).startswith(message), (kwargs, str(e.value))
