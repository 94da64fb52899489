"""What apps expect of the server, over a fake engine (fast): /health, one log line per request,
and a stopped answer's finish reason. Any model name: test_robust.py; the real server: test_server.py."""

from __future__ import annotations

import http.client
import logging
import re

import pytest

from helpers import Served, fake_engine, wait_until

openai = pytest.importorskip("openai")

LOGGER = "mtad_edge.server.requests"


def get(port: int, path: str, key: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def test_health_answers_as_llama_server_does_without_a_key():
    s = Served(fake_engine(), api_key="k")
    try:
        for path in ("/health", "/v1/health"):
            assert get(s.port, path) == (200, b'{"status":"ok"}')
        assert get(s.port, "/v1/models")[0] == 401 and get(s.port, "/v1/models", "k")[0] == 200  # the rest needs it
        s.runs.stop_all()  # the server is stopping: not ready any more
        code, body = get(s.port, "/health")
        assert code == 503 and b"shutting down" in body
    finally:
        s.close()


def test_one_log_line_per_request_with_its_tokens_speed_and_status(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = Served(fake_engine(max_tokens=6))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="any", messages=msgs, seed=1)
        pieces = list(client.chat.completions.create(model="any", messages=msgs, seed=1, stream=True))
        assert pieces[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="any", messages=msgs, temperature=5)
        get(s.port, "/health")  # polled by load balancers: no line
        get(s.port, "/v1/models")
        get(s.port, "/v1/%1b[31mred")  # the path is the client's text (ESC, decoded): escaped, one line

        def lines():
            return [r.getMessage() for r in caplog.records if r.name == LOGGER]

        wait_until(lambda: len(lines()) >= 5)  # a stream's line comes once it ended: maybe after the next request's
        said = sorted(lines())
    finally:
        s.close()
    assert len(said) == 5, said
    generated = r"sd, prompt \d+ \(\d+ cached\), 6 tokens, [\d.]+ tok/s, length"  # auto: sd on the fake pair
    assert re.fullmatch(r"127\.0\.0\.1 GET /v1/\\x1b\[31mred 404 [\d.]+ s", said[0]), said[0]
    assert re.fullmatch(r"127\.0\.0\.1 GET /v1/models 200 [\d.]+ s", said[1]), said[1]
    for line in said[2:4]:  # the plain answer and the stream
        assert re.fullmatch(r"127\.0\.0\.1 POST /v1/chat/completions 200 [\d.]+ s: " + generated, line), line
    assert re.fullmatch(r"127\.0\.0\.1 POST /v1/chat/completions 400 [\d.]+ s", said[4]), said[4]


def test_quiet_silences_the_request_log(capsys):
    """`serve` prints the lines on stderr; --quiet none (the handler `serve` installs)."""
    from mtad_edge.cli.serve import _log_requests
    from mtad_edge.server.app import log

    saved = log.handlers[:], log.level, log.propagate
    try:
        for quiet in (False, True):
            _log_requests(log, quiet)
            log.info("a request")
            assert capsys.readouterr().err == ("" if quiet else "a request\n")
    finally:
        log.handlers[:], log.level, log.propagate = saved
