"""Cross-site policy on real servers: CORS preflight and response headers for listed origins only,
the WebSocket Origin check, JSON-only bodies (415), and a real browser on another origin that tries
to register a prefix, generate and open the WebSocket, and cannot."""
from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from service.config import ServiceConfig
from service.middleware.cross_site import Origins
from tests.helpers.server import ServerThread, tiny_config

APP = "https://app.example.com"
EVIL = "https://evil.example.net"
KEY = "cors-key"
PREFIX_TEXT = "You are a pirate. Answer like a pirate would, with many arrs and ahoys. " * 3


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    """No key (a developer's local server: the classic cross-site target), one allowed origin."""
    s = ServerThread(tiny_config(tiny_llama_dir, allowed_origins=(APP + "/",))).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, allowed_origins=(APP,), api_key=(KEY,))).start()
    yield s
    s.stop()


def preflight(url: str, origin: str) -> requests.Response:
    return requests.options(url, timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_preflight_answers_listed_origins_only_and_needs_no_key(keyed: ServerThread) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/prefixes", "/v1/prefixes/x"):
        resp = preflight(keyed.url + path, APP)
        assert resp.status_code == 204, resp.text
        h = resp.headers
        assert h["Access-Control-Allow-Origin"] == APP and "Origin" in h["Vary"]
        assert {"GET", "POST", "DELETE"} <= {m.strip() for m in h["Access-Control-Allow-Methods"].split(",")}
        allowed = {x.strip().lower() for x in h["Access-Control-Allow-Headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        assert int(h["Access-Control-Max-Age"]) > 0
        assert "Access-Control-Allow-Credentials" not in h
        resp = preflight(keyed.url + path, EVIL)
        assert resp.status_code == 403 and "Access-Control-Allow-Origin" not in resp.headers
        assert resp.json()["error"]["code"] == "origin_not_allowed"
    # the OpenAI JS client's own headers are granted to a listed origin; malformed names are not
    resp = requests.options(keyed.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-lang,bad header"})
    allowed = [x.strip().lower() for x in resp.headers["Access-Control-Allow-Headers"].split(",")]
    assert allowed == ["authorization", "content-type", "x-request-id", "x-stainless-os", "x-stainless-lang"]
    # no Origin: not a preflight, so no CORS answer (the route has no OPTIONS)
    assert requests.options(keyed.url + "/v1/completions", timeout=10).status_code in (401, 405)


def test_actual_responses_carry_cors_headers_for_listed_origins(keyed: ServerThread) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    resp = requests.post(f"{keyed.url}/v1/completions", json=body, headers={"Origin": APP}, timeout=30)
    assert resp.status_code == 401 and resp.headers["Access-Control-Allow-Origin"] == APP   # the page can read why
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = requests.post(f"{keyed.url}/v1/completions", json=body, headers={"Origin": APP, **auth}, timeout=30)
    assert resp.status_code == 200 and resp.headers["Access-Control-Allow-Origin"] == APP
    assert "X-Request-Id" in resp.headers["Access-Control-Expose-Headers"] and "Origin" in resp.headers["Vary"]
    with requests.post(f"{keyed.url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=30,
                       headers={"Origin": APP, **auth}) as stream:     # headers of an SSE stream are sent early
        assert stream.headers["Access-Control-Allow-Origin"] == APP
        assert stream.content.endswith(b"data: [DONE]\n\n")
    resp = requests.post(f"{keyed.url}/v1/completions", json=body, headers={"Origin": EVIL, **auth}, timeout=30)
    assert resp.status_code == 200 and "Access-Control-Allow-Origin" not in resp.headers
    assert "Origin" in resp.headers["Vary"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/prefixes"])
def test_json_endpoints_refuse_other_content_types(srv: ServerThread, path: str) -> None:
    body = json.dumps({"/v1/completions": {"prompt": "hi", "max_tokens": 1},
                       "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                       "/v1/prefixes": {"name": "pirate", "prompt": PREFIX_TEXT}}[path])
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": ctype} if ctype else {}
        resp = requests.post(srv.url + path, data=body.encode(), headers=headers, timeout=30)
        assert resp.status_code == 415, (ctype, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "unsupported_media_type"
    assert requests.get(f"{srv.url}/v1/prefixes", timeout=10).json()["data"] == []
    if path == "/v1/completions":   # what the OpenAI clients and `curl --json` send
        resp = requests.post(srv.url + path, data=body.encode(), timeout=30,
                             headers={"Content-Type": "application/json; charset=utf-8"})
        assert resp.status_code == 200, resp.text


async def _ws_status(url: str, **headers: str) -> int:
    async with aiohttp.ClientSession() as s:
        try:
            async with s.ws_connect(f"{url}/v1/ws", headers=headers) as ws:
                await ws.send_json({"type": "generate", "id": 1, "prompt": "hi", "max_tokens": 1})
                assert (await ws.receive_json())["type"] in ("delta", "done")
                return 101
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status


def test_websocket_origin_check(srv: ServerThread) -> None:
    async def run() -> dict[str, int]:
        host = srv.url.removeprefix("http://")
        return {
            "none": await _ws_status(srv.url),                             # not a browser
            "same": await _ws_status(srv.url, Origin=f"http://{host}"),    # the demo page
            "listed": await _ws_status(srv.url, Origin=APP),
            "evil": await _ws_status(srv.url, Origin=EVIL),
            "other port": await _ws_status(srv.url, Origin=f"http://{host.split(':')[0]}:1"),
            "null": await _ws_status(srv.url, Origin="null"),
        }
    assert asyncio.run(run()) == {"none": 101, "same": 101, "listed": 101, "evil": 403, "other port": 403,
                                  "null": 403}


def test_websocket_origin_is_checked_against_the_host_allow_list_not_the_host_header(srv: ServerThread) -> None:
    """Issue 24, item 7: Origin == Host passed, so a rebound page (Origin and Host both its own name) opened
    the socket; now its Host is refused (421) and its Origin would be too (not an allowed host)."""
    async def run() -> dict[str, int]:
        port = srv.port
        return {
            "rebound": await _ws_status(srv.url, Origin=f"http://evil.example.net:{port}",
                                        Host=f"evil.example.net:{port}"),
            "foreign origin": await _ws_status(srv.url, Origin=f"http://evil.example.net:{port}"),
            "localhost": await _ws_status(srv.url, Origin=f"http://localhost:{port}", Host=f"localhost:{port}"),
        }
    assert asyncio.run(run()) == {"rebound": 421, "foreign origin": 403, "localhost": 101}


def test_host_allow_list() -> None:
    from service.middleware.cross_site import Hosts, host_name

    def allowed(hosts: Hosts, *headers: str) -> list[bool]:
        return [hosts.allowed(host_name(h)) for h in headers]

    default = Hosts(ServiceConfig())
    assert allowed(default, "localhost:8000", "LocalHost.", "127.0.0.1:8000", "[::1]:8000", "10.1.2.3") == [True] * 5
    assert allowed(default, "evil.example.net", "127.0.0.1.nip.io:8000", "localhost.evil.net") == [False] * 3
    assert allowed(Hosts(ServiceConfig(host="api.internal")), "api.internal:8000", "other.internal") == [True, False]
    assert allowed(Hosts(ServiceConfig(host="0.0.0.0")), "my-laptop:8000", "10.1.2.3:8000") == [False, True]
    listed = Hosts(ServiceConfig(allowed_hosts=("prefixserve-engine-*", "*.Example.com.")))
    assert allowed(listed, "prefixserve-engine-12:8000", "api.example.com", "prefixserve-engine-1.evil.net",
                   "a.b.example.com", "example.com") == [True, True, False, False, False]
    assert allowed(Hosts(ServiceConfig(allowed_hosts=("*",))), "anything.at.all") == [True]
    for bad in ("http://x", "a b", "x/y", "a:80"):
        with pytest.raises(ValueError, match="allowed_hosts"):
            ServiceConfig(allowed_hosts=(bad,))


def test_any_origin_when_configured() -> None:
    any_origin = Origins(ServiceConfig(allowed_origins=("*",)))
    listed = Origins(ServiceConfig(allowed_origins=("HTTPS://App.Example.com/",)))
    assert any_origin.allowed(EVIL) and listed.allowed(APP) and not listed.allowed(EVIL)
    with pytest.raises(ValueError, match="not an origin"):
        ServiceConfig(allowed_origins=("app.example.com",))
    with pytest.raises(ValueError, match="not an origin"):
        ServiceConfig(allowed_origins=("https://app.example.com/path",))


# The attacker's page, served from another origin (another port). It tries what a hostile page can.
ATTACK = """<!doctype html><meta charset=utf-8><title>attack</title><script>
const T = "%(target)s", R = window.results = {};
const prefix = JSON.stringify({name: "evil", prompt: %(prompt)s});
const gen = JSON.stringify({prompt: "hi", max_tokens: 1});
const outcome = (p) => p.then((r) => r.type + ":" + r.status, (e) => e.name);
(async () => {
  R.textPlain = await outcome(fetch(T + "/v1/prefixes", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain"}, body: prefix}));
  R.blob = await outcome(fetch(T + "/v1/prefixes", {method: "POST", mode: "no-cors", body: new Blob([prefix])}));
  R.form = await outcome(fetch(T + "/v1/completions", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "application/x-www-form-urlencoded"}, body: gen}));
  R.json = await outcome(fetch(T + "/v1/prefixes", {method: "POST",
    headers: {"Content-Type": "application/json"}, body: prefix}));
  R.read = await outcome(fetch(T + "/v1/models"));
  R.ws = await new Promise((resolve) => {
    const ws = new WebSocket(T.replace("http", "ws") + "/v1/ws");
    ws.onopen = () => resolve("open");
    ws.onclose = (e) => resolve("closed " + e.code);
  });
  R.done = true;
})();
</script>"""


@pytest.fixture(scope="module")
def attacker(srv: ServerThread) -> Iterator[str]:
    page = (ATTACK % {"target": srv.url, "prompt": json.dumps(PREFIX_TEXT)}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    thread.join(5)


def test_a_hostile_page_in_a_real_browser_gets_nothing(srv: ServerThread, attacker: str) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (`make test` installs Debian's)")

    def count(status: str, route: str) -> float:
        text = requests.get(f"{srv.url}/metrics", timeout=10).text
        line = f'prefixserve_http_requests_total{{route="{route}",status="{status}"}} '
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

    before = {k: count(*k) for k in [("415", "/v1/prefixes"), ("415", "/v1/completions"), ("403", "/v1/ws")]}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page()
            page.goto(attacker)
            page.wait_for_function("window.results && window.results.done", timeout=60_000)
            results = page.evaluate("window.results")
        finally:
            browser.close()
    # the browser sent the simple requests (opaque answers); the server refused them all with 415
    assert results["textPlain"] == results["blob"] == results["form"] == "opaque:0", results
    # JSON needs a preflight, which this origin fails: the POST never leaves the browser; reads are blocked
    assert results["json"] == "TypeError" and results["read"] == "TypeError", results
    assert results["ws"] == "closed 1006", results
    assert count("415", "/v1/prefixes") - before[("415", "/v1/prefixes")] == 2
    assert count("415", "/v1/completions") - before[("415", "/v1/completions")] == 1
    assert count("403", "/v1/ws") - before[("403", "/v1/ws")] == 1
    assert requests.get(f"{srv.url}/v1/prefixes", timeout=10).json()["data"] == []


def test_dns_rebinding_in_a_real_browser_gets_421(srv: ServerThread) -> None:
    """The browser resolves evil.test to 127.0.0.1 (what a rebinding attacker's DNS does once the page has
    loaded), so a page on http://evil.test:<port> is same-origin with this server for the browser: no CORS,
    no preflight. Only the Host header gives it away, and every request and the WebSocket get 421."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on PATH (`make test` installs Debian's)")
    origin = f"http://evil.test:{srv.port}"
    script = """async () => {
      const R = {};
      const post = (path, body) => fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
                                                body: JSON.stringify(body)});
      R.register = (await post("/v1/prefixes", {name: "rebound", prompt: PROMPT})).status;
      R.generate = (await post("/v1/completions", {prompt: "hi", max_tokens: 1})).status;
      R.models = (await fetch("/v1/models")).status;
      R.error = (await (await fetch("/v1/models")).json()).error.code;
      R.ws = await new Promise((resolve) => {
        const ws = new WebSocket("ws://" + location.host + "/v1/ws");
        ws.onopen = () => resolve("open");
        ws.onclose = (e) => resolve("closed " + e.code);
      });
      return R;
    }""".replace("PROMPT", json.dumps(PREFIX_TEXT))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run",
                                          "--host-resolver-rules=MAP evil.test 127.0.0.1"])
        try:
            page = browser.new_page()
            first = page.goto(origin + "/")
            assert first is not None and first.status == 421
            results = page.evaluate(script)
        finally:
            browser.close()
    assert results == {"register": 421, "generate": 421, "models": 421, "error": "host_not_allowed",
                       "ws": "closed 1006"}, results
    assert requests.get(f"{srv.url}/v1/prefixes", timeout=10).json()["data"] == []
