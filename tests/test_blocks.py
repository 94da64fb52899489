"""How each block of committed tokens came (``Response.watch_blocks``, the server's opt-in
``mtad_blocks`` stream field the chat page reads), and the page's files, on the fake backend."""

import http.client
import json

import pytest

from helpers import FakeLM, Served, fake_engine


class Utf8LM(FakeLM):
    """Each token is one byte of UTF-8 text, so multi-byte characters span several tokens."""

    TEXT = "é€😀 ok ".encode()

    def token_bytes(self, token: int) -> bytes:
        return self.TEXT[token % len(self.TEXT)].to_bytes(1, "big")


RUNS = [
    dict(method="ar"),
    dict(method="sd"),
    dict(method="mtad"),
    dict(method="mtad", gamma=3, beam_width=2),
    dict(method="mmtad"),
    dict(method="sd", drafter="ngram"),
    dict(method="mtad", drafter="ngram+aux", gamma="auto"),
    dict(method="beam", beam_width=2),
]
# Repeats for prompt lookup to find, a vocabulary of 5 so that drafts are often kept.
PROMPT = "abcdeabcdeabcdeabcde"


def watched(engine, prompt=PROMPT, **options):
    """A run's text chunks, with the block records taken after each, and its response."""
    r = engine.generate(prompt, **options)
    r.watch_blocks()
    chunks = [(piece, r.take_blocks()) for piece in r]
    return chunks, r.take_blocks(), r


@pytest.mark.parametrize("options", RUNS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_block_records_add_up_to_the_runs_stats(options):
    engine = fake_engine(target=FakeLM(salt=1, n_seq_max=5, eog=4), max_tokens=40)
    chunks, tail, r = watched(engine, seed=7, **options)
    records = [b for _, taken in chunks for b in taken] + tail
    st = r.stats
    total = {k: sum(b[k] for b in records) for k in ("tokens", "drafted", "accepted", "calls", "steps")}
    assert total == {
        "tokens": st.generated,
        "drafted": st.drafted,
        "accepted": st.accepted,
        "calls": st.target_calls,
        "steps": sum(st.gamma_hist.values()),
    }
    for name, counters in st.drafters.items():
        assert sum(b["drafted"] for b in records if b["source"] == name) == counters["drafted"]
    assert sum(b["seconds"] for b in records) <= st.wall_s - st.prefill_s + 1e-3
    for b in records:
        assert (b["source"] is None) == (b["drafted"] == 0) and b["gamma"] == b["drafted"]
        assert (b["width"] is None) == (b["drafted"] == 0)
        # A fake token is one character: the kept drafted ones first, then the target's own.
        kept = min(b["accepted"], b["tokens"])
        assert b["chars"] == [kept, b["tokens"] - kept]
    assert sum(sum(b["chars"]) for b in records) == len(r.text())
    if options["method"] == "ar":
        assert all(b["tokens"] == 1 and b["calls"] == 1 for b in records if b["tokens"])


def test_records_follow_the_text_through_split_characters_and_stop_strings():
    """A chunk holds back a partial character or the start of a stop string: the records of its
    blocks come with it or before, and their characters cover the text."""
    t = Utf8LM(vocab=len(Utf8LM.TEXT), salt=1, n_seq_max=5)
    engine = fake_engine(target=t, aux=Utf8LM(vocab=len(Utf8LM.TEXT), salt=2, n_seq_max=9))
    options = dict(max_tokens=60, seed=0, temperature=1.0, top_k=0, top_p=1.0)
    full = engine.generate("abc", **options).text()
    chunks, tail, r = watched(engine, "abc", **options)
    assert "".join(c for c, _ in chunks) == full
    seen, covered = 0, 0
    for piece, taken in chunks:
        covered += sum(sum(b["chars"]) for b in taken)
        seen += len(piece)
        assert covered >= seen  # no chunk brings text whose block has not come
    assert covered + sum(sum(b["chars"]) for b in tail) == len(full)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    chunks, tail, r = watched(engine, "abc", stop=[stop], **options)
    text = "".join(c for c, _ in chunks)
    assert text == full[: full.find(stop)] and r.finish_reason == "stop"
    records = [b for _, taken in chunks for b in taken] + tail
    assert sum(b["tokens"] for b in records) == r.stats.generated
    assert sum(sum(b["chars"]) for b in records) >= len(text) + len(stop)  # the cut text was decoded too


def test_an_unwatched_response_records_nothing():
    r = fake_engine(max_tokens=8).generate(PROMPT, seed=1)
    assert r.text() and r._meter is None and r.take_blocks() == []
    with pytest.raises(RuntimeError, match="before the response is iterated"):
        r.watch_blocks()


# -- the server: the field only when asked; mtad_stats at the end of every stream ------------------
def stream(served, body, path="/v1/chat/completions"):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200, raw
    return [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]


@pytest.fixture(scope="module")
def served():
    s = Served(fake_engine(target=FakeLM(salt=1, n_seq_max=5), max_tokens=24), api_key=None)
    yield s
    s.close()


def test_a_plain_stream_has_no_blocks_and_ends_with_mtad_stats(served):
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = stream(served, chat)
    assert not any("mtad_blocks" in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] and events[-1]["mtad_stats"]["generated"] == 24
    assert all("mtad_stats" not in e for e in events[:-1])
    events = stream(served, {**chat, "stream_options": {"include_usage": True}})
    assert (
        events[-1]["choices"] == []
        and events[-1]["mtad_stats"]["generated"] == events[-1]["usage"]["completion_tokens"]
    )
    assert all("mtad_stats" not in e for e in events[:-1])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_asked_for_every_chunk_carries_its_blocks_which_add_up(served, path):
    body = {"stream": True, "mtad_blocks": True, "method": "mtad", "stop": ["zz"]}
    body.update({"messages": [{"role": "user", "content": PROMPT}]} if "chat" in path else {"prompt": PROMPT})
    events = stream(served, body, path)
    assert all(isinstance(e["mtad_blocks"], list) for e in events)
    records = [b for e in events for b in e["mtad_blocks"]]
    stats = events[-1]["mtad_stats"]
    assert sum(b["tokens"] for b in records) == stats["generated"]
    assert sum(b["accepted"] for b in records) == stats["accepted"]
    assert sum(b["calls"] for b in records) == stats["target_calls"]


@pytest.mark.parametrize(
    "extra,needle",
    [({"mtad_blocks": True}, "needs 'stream': true"), ({"mtad_blocks": "yes", "stream": True}, "must be a boolean")],
)
def test_a_bad_mtad_blocks_is_a_400(served, extra, needle):
    status, body = served.post({"prompt": "x", **extra})
    assert status == 400 and needle in body["error"]["message"] and body["error"]["param"] == "mtad_blocks"


def test_the_page_needs_no_key_and_the_api_still_does():
    s = Served(fake_engine(), api_key="k")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        for path, media in (
            ("/", "text/html"),
            ("/static/chat.js", "text/javascript"),
            ("/static/chat.css", "text/css"),
        ):
            conn.request("GET", path)
            r = conn.getresponse()
            assert r.status == 200 and len(r.read()) > 500 and r.getheader("content-type").startswith(media), path
            assert "default-src 'none'" in r.getheader("content-security-policy")
        for method, path in (("GET", "/v1/models"), ("GET", "/static/other.js"), ("POST", "/")):
            conn.request(
                method, path, body=b"{}" if method == "POST" else None, headers={"Content-Type": "application/json"}
            )
            r = conn.getresponse()
            assert r.status == 401 and json.loads(r.read())["error"]["type"] == "authentication_error", path
    finally:
        s.close()
