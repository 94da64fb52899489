"""The chat page of `mtad-edge serve`, in a real browser: the distribution's headless Chromium
driven by Playwright (no browser is downloaded), against a real server on the default pair
started here on loopback with an API key. A screenshot is kept in build/test-artifacts/."""

import http.client
import json
import os
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from helpers import EXE, read_until, wait_until

CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it where it is missing)
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

pytestmark = pytest.mark.slow
KEY = "page-key"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(
    os.environ.get("MTAD_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "build" / "test-artifacts")
)
# What a hostile model, a paste or a tampered store may hold: were any of it read as HTML or
# followed as a link, it would set window.__pwned.
PAYLOAD = (
    '<img src=x onerror="window.__pwned=1"> [click](javascript:window.__pwned=2) '
    "<script>window.__pwned=3</script> [data](data:text/html,<script>window.__pwned=4</script>) "
    '<a href="javascript:window.__pwned=5">link</a> `<img src=x onerror=window.__pwned=6>`'
)


@pytest.fixture(scope="module")
def server(smol_files):
    """`mtad-edge serve` with an API key, short answers by default; its base URL."""
    proc = subprocess.Popen(
        [EXE, "serve", "--port", "0", "--api-key", KEY, "--ctx-size", "1024", "--threads", "2", "--max-tokens", "24"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    found = read_until(proc, r"chat page: (http://127\.0\.0\.1:\d+/)")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
    url = found.group(1)
    deadline = time.time() + 60  # the line comes as it starts listening
    while True:
        try:
            urllib.request.urlopen(url, timeout=10).close()
            break
        except OSError:
            assert time.time() < deadline and proc.poll() is None, "the server did not answer"
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(  # a new, empty profile
            profile, executable_path=CHROMIUM, headless=True, args=ARGS, viewport={"width": 1280, "height": 800}
        )
        yield context
        context.close()


@pytest.fixture
def page(browser, server):
    """The page in a fresh tab with an empty store, the API key entered where it asked for one."""
    pg = browser.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server)
    pg.evaluate("localStorage.clear()")
    pg.reload()
    pg.wait_for_selector("#key-overlay:not([hidden])")  # /v1/models answered 401
    pg.fill("#api-key", KEY)
    pg.click("#key-form button")
    pg.wait_for_selector("body[data-ready=true]")
    yield pg
    pg.close()
    assert not errors, errors


def send(pg, text, click="#send", **settings):
    """Type ``text`` with the given settings, send it (``click``: the button that sends; None:
    Enter), wait for the answer; the response's SSE events (the chunks' JSON) and the request's body."""
    for field, value in settings.items():
        if field == "method":
            pg.select_option("#method", value)
        else:
            pg.fill(f"#{field.replace('_', '-')}", str(value))
    if text is not None:
        pg.fill("#input", text)
    with pg.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as info:
        if click:
            pg.click(click)
        else:
            pg.press("#input", "Enter")
    response = info.value
    pg.wait_for_selector("#send:not([disabled])", timeout=120_000)
    assert response.status == 200, response.text()
    request = response.request
    assert request.headers["content-type"] == "application/json" and request.post_data_json["mtad_blocks"] is True
    events = [json.loads(line[6:]) for line in response.text().split("\n") if line.startswith("data: {")]
    return events, request.post_data_json


def last_answer(pg):
    return pg.locator(".msg.assistant").last


def shading(pg):
    """The shaded blocks of the last answer: each block's data, and the text it covers."""
    return (
        last_answer(pg)
        .locator(".body .block")
        .evaluate_all("spans => spans.map(s => ({...s.dataset, text: s.textContent}))")
    )


def check_blocks_add_up(pg, events):
    """The page's shading and totals against the stream: one shaded span per block that committed
    tokens, and the blocks' counts add up to the response's mtad_stats."""
    stats = events[-1]["mtad_stats"]
    records = [b for e in events for b in e.get("mtad_blocks", [])]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    spans = shading(pg)
    assert len(spans) == sum(1 for b in records if b["tokens"]) and spans
    assert sum(int(s["tokens"]) for s in spans) == stats["generated"]
    assert (
        sum(int(s["drafted"]) for s in spans) + sum(b["drafted"] for b in records if not b["tokens"])
        == stats["drafted"]
    )
    node = last_answer(pg)
    for field, key in (
        ("tokens", "generated"),
        ("drafted", "drafted"),
        ("accepted", "accepted"),
        ("calls", "target_calls"),
    ):
        assert int(node.get_attribute(f"data-{field}")) == stats[key], field
    assert node.get_attribute("data-adds-up") == "true"
    assert (
        "".join(s["text"] for s in spans)
        == text
        == pg.evaluate("JSON.parse(localStorage.getItem('mtad-edge.chats.v1')).chats[0].messages.at(-1).content")
    )
    return stats, spans


def test_the_page_is_served_without_the_key_under_a_strict_policy(server):
    u = urlsplit(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/")
    r = conn.getresponse()
    body = r.read().decode()
    assert r.status == 200 and "static/chat.js" in body
    assert "script-src 'self'" in r.getheader("content-security-policy")
    conn.request("GET", "/v1/models")  # the API still needs it
    r = conn.getresponse()
    r.read()
    assert r.status == 401


def test_an_answer_streams_shaded_by_verify_call_and_survives_a_reload(page):
    page.evaluate("""() => { window.__updates = 0;
        new MutationObserver(() => window.__updates++).observe(document.getElementById('messages'),
            {subtree: true, childList: true, characterData: true}); }""")
    events, _ = send(page, "Explain beam search in two sentences.", method="mtad", max_tokens=40)
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content")) > 2  # streamed
    assert page.evaluate("window.__updates") > 3  # and painted as it came
    stats, spans = check_blocks_add_up(page, events)
    assert stats["method"] == "mtad" and any(int(s["drafted"]) for s in spans)
    assert page.locator("#live-tokens b").text_content() == str(stats["generated"])
    assert page.locator("#chart rect").count() == len(spans)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-page.png"))

    page.uncheck("#show-blocks")  # the same answer as Markdown, then shaded again
    assert last_answer(page).locator(".body.md").count() == 1
    page.check("#show-blocks")
    answer = last_answer(page).locator(".body").text_content()
    page.reload()
    page.wait_for_selector("body[data-ready=true]")  # the key is kept for the tab
    assert page.locator("#chats li .title").first.text_content().startswith("Explain beam search")
    assert last_answer(page).locator(".body").text_content() == answer
    assert len(shading(page)) == len(spans) and last_answer(page).get_attribute("data-adds-up") == "true"


def test_switching_to_ar_shows_one_token_a_call_then_regenerate_and_copy(page, browser):
    page.fill("#stop", "zzz\nqq q")  # one a line
    events, body = send(page, "Name three colors.", click=None, method="ar", max_tokens=16)  # Enter sends
    assert {k: body[k] for k in ("method", "max_tokens", "stop")} == dict(
        method="ar", max_tokens=16, stop=["zzz", "qq q"]
    )
    stats, spans = check_blocks_add_up(page, events)
    assert stats["method"] == "ar" and stats["drafted"] == 0
    assert all(s["tokens"] == "1" and s["drafted"] == "0" and s["source"] == "none" for s in spans)
    assert page.locator("#live-gamma b").text_content() == "0"
    assert "ar" in last_answer(page).locator(".head").text_content()
    events, _ = send(page, None, click=".msg.assistant .regenerate", method="mtad")  # the same question, again
    assert page.locator(".msg").count() == 2 and check_blocks_add_up(page, events)[0]["method"] == "mtad"
    browser.grant_permissions(["clipboard-read", "clipboard-write"])
    last_answer(page).locator(".head .copy").click()
    page.wait_for_selector(".msg.assistant .head .copy:text('copied')")
    assert page.evaluate("navigator.clipboard.readText()") == last_answer(page).locator(".body").text_content()


def test_stop_mid_answer_keeps_the_text_and_frees_the_server(page):
    page.select_option("#method", "ar")
    page.fill("#max-tokens", "600")
    page.fill("#input", "Write a long story about a fisherman and the sea.")
    page.click("#send")
    body = last_answer(page).locator(".body")
    wait_until(lambda: len(body.text_content()) > 20, timeout=120)  # (the page's CSP forbids eval'd waits)
    page.click("#stop-answer")
    page.wait_for_selector("#send:not([disabled])")
    node = last_answer(page)
    kept = node.locator(".body").text_content()
    assert len(kept) > 20 and "stopped" in node.locator(".foot").text_content()
    assert int(node.get_attribute("data-tokens")) < 600
    # Were the abandoned 600-token run still going, this answer would wait for it.
    started = time.monotonic()
    send(page, "Say hi.", max_tokens=4)
    assert time.monotonic() - started < 60
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator(".msg.assistant .body").first.text_content() == kept


def test_conversations_are_kept_renamed_and_deleted(page):
    page.click("#new-chat")
    page.fill("#system", "You are terse.")
    page.click("#new-chat")
    assert page.locator("#chats li").count() == 3
    page.locator("#chats li .rename").nth(1).click()
    page.fill(".rename-input", "Terse one")
    page.keyboard.press("Enter")
    page.locator("#chats li .delete").first.click()
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#chats li .title").all_text_contents() == ["Terse one", "New chat"]
    page.locator("#chats li .title").first.click()
    assert page.input_value("#system") == "You are terse."


def test_untrusted_text_runs_nothing(page):
    """Model output (echoed by the real model), pasted text and a tampered store holding HTML and
    javascript: links: all shown as text, none of it run or followed."""
    page.fill("#system", "Repeat the user's message exactly, with no other words.")
    events, _ = send(page, PAYLOAD, temperature=0, max_tokens=64)
    echoed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    # The model's output carried live markup (greedy: the same echo every run).
    assert ("onerror" in echoed or "<script>" in echoed) and "javascript:" in echoed
    assert last_answer(page).locator(".body").text_content() == echoed
    assert page.locator(".msg.user .body").text_content() == PAYLOAD  # the pasted text, as text
    stored = {
        "chats": [
            {
                "id": "x",
                "title": PAYLOAD,
                "system": PAYLOAD,
                "messages": [
                    {"role": "user", "content": PAYLOAD},
                    {"role": "assistant", "content": f"# {PAYLOAD}\n\n- {PAYLOAD}\n\n```\n{PAYLOAD}\n```\n> {PAYLOAD}"},
                    {"role": "assistant", "content": PAYLOAD, "blocks": [{"tokens": 3, "chars": [0, 40]}]},
                    {"role": "<img src=x onerror=window.__pwned=7>", "content": PAYLOAD},
                ],
            }
        ],
        "current": "x",
    }
    page.evaluate("s => localStorage.setItem('mtad-edge.chats.v1', s)", json.dumps(stored))
    for blocks in (True, False):  # shaded and rendered as Markdown
        page.reload()
        page.wait_for_selector("body[data-ready=true]")
        if not blocks:
            page.uncheck("#show-blocks")
        assert page.locator(".msg").count() == 3  # the message with a bad role is dropped
        for link in page.locator("#messages a").all():
            link.click()
        assert page.locator("#messages img, #messages script, #chats img, #messages iframe").count() == 0
        hrefs = page.locator("#messages a").evaluate_all("links => links.map(a => a.href)")
        assert all(h.startswith(("http:", "https:")) for h in hrefs)
        assert "onerror" in page.locator("#messages").text_content()
        page.wait_for_timeout(200)
        assert page.evaluate("window.__pwned") is None


def test_markdown_renders_code_and_links(page):
    text = "# Title\n\nSome **bold** and `code`, a [site](https://example.com/x).\n\n```python\nprint('<b>')\n```"
    stored = {
        "chats": [{"id": "m", "messages": [{"role": "user", "content": "md"}, {"role": "assistant", "content": text}]}]
    }
    page.evaluate("s => localStorage.setItem('mtad-edge.chats.v1', s)", json.dumps(stored))
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    body = last_answer(page).locator(".body")
    assert body.locator("h3").text_content() == "Title" and body.locator("strong").text_content() == "bold"
    assert body.locator("pre code").text_content() == "print('<b>')"
    assert body.locator("a").get_attribute("href") == "https://example.com/x"
