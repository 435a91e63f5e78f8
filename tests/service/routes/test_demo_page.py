"""Headless Chromium (Debian's, driven by Playwright) opens the demo page and watches text stream in."""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.helpers.server import ServerThread, tiny_config

CHROMIUM = shutil.which("chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

# Records every length the last assistant message goes through while it streams.
OBSERVE = """
window.__lengths = [];
new MutationObserver(() => {
  const msgs = document.querySelectorAll('.msg.assistant .body');
  if (msgs.length) window.__lengths.push(msgs[msgs.length - 1].textContent.length);
}).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def slow_server(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    """The tiny model at a human pace (20 ms per engine step), so tokens reach the page one by one
    instead of coalescing into a few TCP reads."""
    srv = ServerThread(tiny_config(tiny_llama_dir)).start()
    core = srv.state.engine._core
    step = core.step
    srv.step_delay = 0.02  # type: ignore[attr-defined]   # a test may slow it further

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(srv.step_delay)  # type: ignore[attr-defined]
        return step()

    core.step = slow_step
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (`make test` installs Debian's)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.mark.parametrize("transport", ["ws", "sse"])
def test_demo_page_streams(browser, slow_server: ServerThread, transport: str) -> None:
    server = slow_server
    page = browser.new_page(viewport={"width": 1000, "height": 820})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_function("() => document.getElementById('health').textContent === 'ok'", timeout=20_000)
    page.wait_for_function("() => document.getElementById('model').textContent.includes('ctx')", timeout=20_000)
    page.evaluate(OBSERVE)
    page.select_option("#transport", transport)
    page.fill("#max-tokens", "60")
    page.fill("#temperature", "0")
    page.fill("#prompt", "Tell me about caches")
    page.click("#send")
    page.wait_for_function("() => !document.getElementById('send').disabled && "
                           "document.getElementById('cached').textContent.includes('/')", timeout=30_000)
    answer = page.inner_text(".msg.assistant .body")
    lengths = page.evaluate("window.__lengths")
    assert answer.strip() and not page.query_selector(".msg.error")
    # token by token: the message grew through many intermediate lengths
    assert len(set(lengths)) >= 10 and lengths == sorted(lengths), lengths
    assert page.inner_text("#ttft").endswith(" ms")
    assert float(page.inner_text("#tps")) > 0
    assert int(page.inner_text("#ntok")) > 5
    cached, prompt = page.inner_text("#cached").split(" / ")
    assert 0 <= int(cached) <= int(prompt)
    assert page.is_hidden("#prefix-label")     # no prefix registered yet: GET /v1/prefixes lists none
    assert not errors
    if transport == "ws":
        page.fill("#system", "You are a helpful assistant.")
        page.fill("#prompt", "And a second question?")
        page.click("#send")
        page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length === 2 && "
                               "!document.getElementById('send').disabled", timeout=30_000)
        page.screenshot(path="/tmp/demo.png", full_page=True)
    page.close()


def test_demo_page_uses_a_registered_prefix(browser, slow_server: ServerThread) -> None:
    """Register over HTTP, reload: the dropdown lists it; chatting with it selected hits its pinned blocks."""
    server = slow_server
    system = "You are the prefixserve demo. Answer in one short line, and mention the KV cache. " * 2
    resp = requests.post(f"{server.url}/v1/prefixes", timeout=60, json={
        "name": "demo-system", "messages": [{"role": "system", "content": system}], "description": "the demo's"})
    assert resp.status_code in (200, 201), resp.text
    pinned_tokens = resp.json()["num_pinned_blocks"] * 16
    assert pinned_tokens > 0
    page = browser.new_page(viewport={"width": 1000, "height": 820})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.reload()
    page.wait_for_function("() => document.getElementById('health').textContent === 'ok'", timeout=20_000)
    page.wait_for_function("() => !document.getElementById('prefix-label').hidden", timeout=20_000)
    values = page.eval_on_selector_all("#prefix option", "opts => opts.map(o => o.value)")
    assert values == ["", "demo-system"]
    page.select_option("#prefix", "demo-system")
    page.select_option("#transport", "sse")
    page.fill("#max-tokens", "20")
    page.fill("#temperature", "0")
    page.fill("#prompt", "What does the cache keep?")
    page.click("#send")
    page.wait_for_function("() => !document.getElementById('send').disabled && "
                           "document.getElementById('cached').textContent.includes('/')", timeout=30_000)
    cached, prompt = page.inner_text("#cached").split(" / ")
    assert int(cached) >= pinned_tokens and int(prompt) > int(cached)      # the prefix's blocks, from the cache
    assert not page.query_selector(".msg.error") and not errors
    page.screenshot(path="/tmp/demo2.png", full_page=True)
    page.close()
    assert requests.delete(f"{server.url}/v1/prefixes/demo-system", timeout=30).status_code == 200


def _open(browser, url: str, width: int = 1000, height: int = 820):  # type: ignore[no-untyped-def]
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url + "/")
    page.wait_for_function("() => document.getElementById('health').textContent === 'ok'", timeout=60_000)
    page.wait_for_function("() => document.getElementById('model').textContent.includes('ctx')", timeout=20_000)
    return page, errors


def _ask(page, question: str, transport: str = "ws") -> str:  # type: ignore[no-untyped-def]
    page.select_option("#transport", transport)
    page.fill("#temperature", "0")
    page.fill("#prompt", question)
    page.click("#send")
    page.wait_for_function("() => !document.getElementById('send').disabled && "
                           "document.getElementById('cached').textContent.includes('/')", timeout=120_000)
    return str(page.inner_text(".msg.assistant:last-of-type .body"))


@pytest.mark.parametrize("transport", ["ws", "sse"])
def test_the_real_model_answers_on_the_page(browser, real_server: ServerThread, transport: str,
                                            tmp_path: Path) -> None:
    page, errors = _open(browser, real_server.url)
    assert "SmolLM2-135M-Instruct" in page.inner_text("#model")
    answer = _ask(page, "What is the capital of France?", transport)
    assert "Paris" in answer
    page.fill("#prompt", "And of Italy?")                   # a second turn reads the first as history
    page.click("#send")
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length === 2 && "
                           "!document.getElementById('send').disabled", timeout=120_000)
    assert "Rome" in page.inner_text(".msg.assistant:last-of-type .body")
    page.screenshot(path=str(tmp_path / f"demo-{transport}.png"), full_page=True)
    assert not errors, errors
    page.close()


def test_the_page_is_usable_at_390_px(browser, real_server: ServerThread, tmp_path: Path) -> None:
    page, errors = _open(browser, real_server.url, width=390, height=844)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page scrolls sideways: {width} px wide"
    for sel in ("#prompt", "#send", "#stop", "#system", "#temperature"):
        box = page.locator(sel).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, (sel, box)
    assert "Paris" in _ask(page, "What is the capital of France?")
    page.screenshot(path=str(tmp_path / "demo-390.png"), full_page=True)
    assert not errors, errors
    page.close()


@pytest.mark.parametrize("transport", ["ws", "sse"])
def test_stop_before_the_first_token_leaves_no_trace(browser, slow_server: ServerThread, transport: str) -> None:
    page, errors = _open(browser, slow_server.url)
    slow_server.step_delay = 1.0  # type: ignore[attr-defined]
    try:
        page.select_option("#transport", transport)
        page.fill("#prompt", "hello there")
        page.click("#send")
        page.click("#stop")                                  # well before the first token (a step takes 1 s)
        page.wait_for_function("() => !document.getElementById('send').disabled", timeout=30_000)
    finally:
        slow_server.step_delay = 0.02  # type: ignore[attr-defined]
    assert page.locator(".msg.assistant").count() == 0       # no empty bubble
    assert page.locator(".msg.streaming").count() == 0
    for stat in ("#ttft", "#tps", "#ntok", "#cached"):
        assert page.inner_text(stat) != "…", stat           # no stuck placeholder
    assert not errors, errors
    assert _ask(page, "and now?").strip()                    # the page goes on
    page.close()


def test_errors_cuts_prefixes_and_markdown(browser, slow_server: ServerThread) -> None:
    """Issue 26's demo-page faults: an error is an error (not an assistant turn, and its question is not sent
    again), an answer cut at max tokens says so, the prefix list holds only what chat can use and a chosen
    prefix turns the system field off, and markdown renders without letting the model's text become HTML."""
    server = slow_server
    chat_prefix = {"name": "demo-chat", "messages": [{"role": "system", "content": "Be brief. " * 8}]}
    prompt_prefix = {"name": "demo-prompt", "prompt": "Once upon a time " * 8}
    for body in (chat_prefix, prompt_prefix):
        assert requests.post(f"{server.url}/v1/prefixes", json=body, timeout=60).status_code in (200, 201)
    page, errors = _open(browser, server.url)
    try:
        page.wait_for_function("() => !document.getElementById('prefix-label').hidden", timeout=20_000)
        listed = page.eval_on_selector_all("#prefix option", "os => os.map(o => o.value)")
        assert "demo-chat" in listed and "demo-prompt" not in listed
        page.select_option("#prefix", "demo-chat")
        assert page.is_disabled("#system")
        page.select_option("#prefix", "")
        assert page.is_enabled("#system")
        page.select_option("#prefix", "demo-chat")
        requests.delete(f"{server.url}/v1/prefixes/demo-chat", timeout=30)   # gone under the page: a 404

        bodies: list[dict] = []
        page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
                if r.url.endswith("/v1/chat/completions") else None)
        page.select_option("#transport", "sse")
        page.fill("#prompt", "first question")
        page.click("#send")
        page.wait_for_function("() => document.querySelector('.msg.error') && "
                               "!document.getElementById('send').disabled", timeout=30_000)
        assert page.inner_text(".msg.error .who").lower() == "error"
        assert page.locator(".msg.assistant").count() == 0
        assert "failed" in (page.get_attribute(".msg.user", "class") or "")
        assert errors and all("404" in e for e in errors)     # the browser logs the failed fetch; nothing else
        errors.clear()
        page.select_option("#prefix", "")
        page.fill("#max-tokens", "3")
        page.fill("#temperature", "0")
        page.fill("#prompt", "second question")
        page.click("#send")
        page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length === 1 && "
                               "!document.getElementById('send').disabled", timeout=30_000)
        sent = [m["content"] for m in bodies[-1]["messages"]]
        assert sent == ["second question"]                   # the failed one was not sent again
        ntok = int(page.inner_text("#ntok"))
        assert (page.locator(".msg.assistant .cut").count() == 1) == (ntok == 3)   # cut at max tokens: said

        html = page.evaluate("markdownHTML('<img src=x onerror=alert(1)> **bold** and `code`\\n\\n- a\\n- b\\n"
                             "```\\n<script>x()</script>\\n```')")
        assert "<img" not in html and "<script>" not in html and "&lt;img" in html and "&lt;script&gt;" in html
        assert "<strong>bold</strong>" in html and "<code>code</code>" in html and "<li>a</li>" in html
        assert "<pre><code>" in html
        assert not errors, errors
    finally:
        page.close()
        for name in ("demo-chat", "demo-prompt"):
            requests.delete(f"{server.url}/v1/prefixes/{name}", timeout=30)
