"""Security headers on the wire (CSP, framing, referrer on the page and its files; nosniff on every
answer, streams and upgrades included), and the demo page in a real browser under its own CSP with an
API key set: it asks for the key and streams over the WebSocket and SSE, with no CSP violation."""
from __future__ import annotations

import html.parser
import shutil
import socket
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
import requests

from tests.helpers.server import ServerThread, tiny_config

KEY = "page-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, api_key=(KEY,))).start()
    yield s
    s.stop()


def csp(header: str) -> dict[str, list[str]]:
    out = {}
    for directive in header.split(";"):
        name, *values = directive.split()
        out[name] = values
    return out


@pytest.mark.parametrize("path", ["/", "/static/demo.js", "/static/demo.css"])
def test_page_and_static_files_get_the_browser_headers(srv: ServerThread, path: str) -> None:
    resp = requests.get(srv.url + path, timeout=10)
    assert resp.status_code == 200
    host = srv.url.removeprefix("http://")
    policy = csp(resp.headers["Content-Security-Policy"])
    assert policy["script-src"] == ["'self'"] and policy["style-src"] == ["'self'"]
    assert policy["connect-src"] == ["'self'", f"ws://{host}", f"wss://{host}"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["object-src"] == ["'none'"]
    assert policy["base-uri"] == ["'none'"] and policy["default-src"] == ["'self'"]
    assert "unsafe" not in resp.headers["Content-Security-Policy"]
    assert resp.headers["X-Frame-Options"] == "DENY"
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert resp.headers["Referrer-Policy"] == "no-referrer"


def test_a_forged_host_header_never_reaches_the_policy(srv: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x;script-src *\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head = raw.split(b"\r\n\r\n", 1)[0].decode()
    (line,) = [h for h in head.split("\r\n") if h.lower().startswith("content-security-policy:")]
    assert "connect-src 'self';" in line and "*" not in line


def test_every_answer_is_nosniff(srv: ServerThread) -> None:
    answers = [
        requests.get(f"{srv.url}/health", timeout=10),
        requests.get(f"{srv.url}/v1/models", timeout=10),                       # 401
        requests.get(f"{srv.url}/v1/models", headers=AUTH, timeout=10),
        requests.get(f"{srv.url}/nope", headers=AUTH, timeout=10),              # 404
        requests.get(f"{srv.url}/static/nope.js", timeout=10),
        requests.get(f"{srv.url}/metrics", headers=AUTH, timeout=10),
        requests.post(f"{srv.url}/v1/completions", data=b"{}", headers=AUTH, timeout=10),   # 415
    ]
    for resp in answers:
        assert resp.headers["X-Content-Type-Options"] == "nosniff", (resp.url, resp.status_code)
        assert "Content-Security-Policy" not in resp.headers or resp.url.endswith(".js")
    with requests.post(f"{srv.url}/v1/completions", headers=AUTH, stream=True, timeout=30,
                       json={"prompt": "hi", "max_tokens": 2, "stream": True}) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        assert stream.headers["X-Content-Type-Options"] == "nosniff"
    upgrade = requests.get(f"{srv.url}/v1/ws", stream=True, timeout=10, headers={
        **AUTH, "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    try:
        assert upgrade.status_code == 101 and upgrade.headers["X-Content-Type-Options"] == "nosniff"
    finally:
        upgrade.close()


class _Scripts(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.inline: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {k for k, _ in attrs}
        if tag == "script" and "src" not in names:
            self.inline.append("<script> without src")
        self.inline += [f"{tag} {k}=" for k in names if k.startswith("on") or k == "style"]


def test_the_page_has_no_inline_script_or_style() -> None:
    parser = _Scripts()
    parser.feed((resources.files("service") / "static" / "index.html").read_text())
    assert parser.inline == []


def test_demo_page_with_a_key_under_its_csp(srv: ServerThread) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (`make test` installs Debian's)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text
                    else None)   # the first /v1/models is a 401 by design
            page.add_init_script("window.__csp = []; document.addEventListener('securitypolicyviolation', "
                                 "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));")
            page.goto(srv.url + "/")
            page.wait_for_function("() => document.getElementById('model').textContent === 'API key needed'",
                                   timeout=30_000)
            assert page.is_visible("#api-key")
            page.fill("#api-key", KEY)
            page.press("#api-key", "Enter")
            page.dispatch_event("#api-key", "change")
            page.wait_for_function("() => document.getElementById('model').textContent.includes('ctx')", timeout=20_000)
            assert page.evaluate("sessionStorage.getItem('prefixserve-api-key')") == KEY
            assert page.evaluate("localStorage.length") == 0
            for n, transport in enumerate(["ws", "sse"], start=1):
                page.select_option("#transport", transport)
                page.fill("#max-tokens", "8")
                page.fill("#prompt", f"question {n}")
                page.click("#send")
                page.wait_for_function(f"() => document.querySelectorAll('.msg.assistant').length === {n} && "
                                       "!document.getElementById('send').disabled", timeout=30_000)
                assert not page.query_selector(".msg.error"), page.inner_text("#log")
                assert int(page.inner_text("#ntok")) > 0
            assert page.evaluate("window.__csp") == [] and errors == []
        finally:
            browser.close()
