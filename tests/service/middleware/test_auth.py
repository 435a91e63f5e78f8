"""API and admin keys on a real server: every route but /health and the page's files needs a key
(checked over the app's own route table, so a new endpoint is covered the day it is added), the
OpenAI error shape on 401/403, the official client, the WebSocket by header and by subprotocol,
admin-only registry writes and source text, /metrics, and the flags."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
import requests

from cli import config_from, parser
from tests.helpers.server import ServerThread, tiny_config

USER, USER2, ADMIN = "user-key-1", "user.key_2", "admin-key-9"
PREFIX = "You are a terse assistant. Answer in one word, then stop. " * 3


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, api_key=(USER, USER2), admin_key=(ADMIN,))).start()
    yield s
    s.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(resp: requests.Response) -> None:
    assert resp.status_code == 401, (resp.request.method, resp.url, resp.status_code, resp.text)
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert resp.headers["Content-Type"].startswith("application/json")
    if resp.request.method == "HEAD":
        return
    if resp.request.path_url.startswith("/v1/messages"):      # Anthropic's shape there
        body = resp.json()
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        return
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"


def test_every_route_but_health_and_page_needs_a_key(srv: ServerThread) -> None:
    routes = {(r.method, r.resource.canonical) for r in srv.app.router.routes() if r.resource is not None}
    open_routes = {(m, p) for m, p in routes if p in ("/health", "/", "/static")}
    assert {("GET", "/health"), ("GET", "/"), ("GET", "/static")} <= open_routes
    guarded = sorted(routes - open_routes)
    assert ("GET", "/metrics") in guarded and ("POST", "/v1/completions") in guarded and len(guarded) >= 10
    for method, path in guarded + [("GET", "/no/such/route")]:
        url = srv.url + path.replace("{name}", "some-name")
        kwargs = {"json": {}} if method == "POST" else {}
        assert_401(requests.request(method, url, timeout=10, **kwargs))
        assert_401(requests.request(method, url, headers=bearer("wrong-key"), timeout=10, **kwargs))
        assert_401(requests.request(method, url, headers={"Authorization": USER}, timeout=10, **kwargs))  # no scheme
        resp = requests.request(method, url, headers=bearer(USER), timeout=10, **kwargs)
        assert resp.status_code != 401, (method, path)
    assert requests.get(f"{srv.url}/health", timeout=10).json()["status"] == "ok"
    assert b"<script src=" in requests.get(f"{srv.url}/", timeout=10).content
    assert requests.get(f"{srv.url}/static/demo.js", timeout=10).status_code == 200


def test_official_client(srv: ServerThread) -> None:
    model = srv.state.model_name
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model=model, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    for key in (USER, USER2, ADMIN):          # an admin key is an API key too
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0) as good:
            out = good.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0, extra_body={
                "ignore_eos": True})
            assert out.usage is not None and out.usage.completion_tokens == 3
            chunks = list(good.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3, stream=True))
            assert chunks and chunks[-1].choices[0].finish_reason is not None


async def _ws_generate(srv: ServerThread, **connect: object) -> tuple[str | None, list[dict]]:
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{srv.url}/v1/ws", **connect) as ws:  # type: ignore[arg-type]
        await ws.send_json({"type": "generate", "id": 1, "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        frames = []
        async for msg in ws:
            frames.append(msg.json())
            if frames[-1]["type"] in ("done", "error"):
                break
        return ws.protocol, frames


async def _ws_refused(srv: ServerThread, **connect: object) -> int:
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await s.ws_connect(f"{srv.url}/v1/ws", **connect)  # type: ignore[arg-type]
    return info.value.status


def test_websocket_authenticates_at_the_upgrade(srv: ServerThread) -> None:
    async def run() -> None:
        assert await _ws_refused(srv) == 401
        assert await _ws_refused(srv, headers=bearer("nope")) == 401
        assert await _ws_refused(srv, protocols=("prefixserve", "openai-insecure-api-key.nope")) == 401
        assert await _ws_refused(srv, protocols=("prefixserve", "openai-insecure-api-key.")) == 401
        protocol, frames = await _ws_generate(srv, headers=bearer(USER))
        assert protocol is None and frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 3
        # a browser's way: the key as a subprotocol; the server selects "prefixserve", never the key
        protocol, frames = await _ws_generate(srv, protocols=("prefixserve", f"openai-insecure-api-key.{USER2}"))
        assert protocol == "prefixserve" and frames[-1]["type"] == "done"
    asyncio.run(run())


def test_websocket_handshake_never_echoes_the_key(srv: ServerThread) -> None:
    """The raw 101: Sec-WebSocket-Protocol carries only the selected non-secret protocol."""
    resp = requests.get(f"{srv.url}/v1/ws", timeout=10, stream=True, headers={
        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Protocol": f"openai-insecure-api-key.{USER}, prefixserve"})
    try:
        assert resp.status_code == 101
        assert resp.headers["Sec-WebSocket-Protocol"] == "prefixserve"
        assert USER not in str(resp.headers)
    finally:
        resp.close()


def test_publishing_and_source_need_an_admin_key(srv: ServerThread) -> None:
    body = {"name": "terse", "prompt": PREFIX}
    resp = requests.post(f"{srv.url}/v1/prefixes", json={**body, "published": True}, headers=bearer(USER),
                         timeout=30)
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "permission_error"
    assert resp.json()["error"]["code"] == "admin_key_required"
    assert_401(requests.post(f"{srv.url}/v1/prefixes", json=body, timeout=30))
    resp = requests.post(f"{srv.url}/v1/prefixes", json=body, headers=bearer(ADMIN), timeout=30)
    assert resp.status_code == 201 and resp.json()["source"] == {"prompt": PREFIX}
    try:
        user_list = requests.get(f"{srv.url}/v1/prefixes", headers=bearer(USER), timeout=10).json()["data"]
        admin_list = requests.get(f"{srv.url}/v1/prefixes", headers=bearer(ADMIN), timeout=10).json()["data"]
        assert all("source" not in p for p in user_list + admin_list)           # listings never carry sources
        assert user_list[0]["num_tokens"] == admin_list[0]["num_tokens"] > 0      # the rest is visible
        assert user_list[0]["published"] is True
        assert PREFIX[:20] not in requests.get(f"{srv.url}/v1/prefixes/terse", headers=bearer(USER), timeout=10).text
        one = requests.get(f"{srv.url}/v1/prefixes/terse", headers=bearer(ADMIN), timeout=10).json()
        assert one["source"] == {"prompt": PREFIX}
        # users may still generate with the prefix
        resp = requests.post(f"{srv.url}/v1/completions", headers=bearer(USER), timeout=30, json={
            "prompt": " Hi?", "prefix": "terse", "max_tokens": 2})
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        resp = requests.delete(f"{srv.url}/v1/prefixes/terse", headers=bearer(USER), timeout=10)
        assert resp.status_code == 403
    finally:
        assert requests.delete(f"{srv.url}/v1/prefixes/terse", headers=bearer(ADMIN), timeout=10).status_code == 200


def test_metrics_may_be_left_open_and_without_admin_keys_a_key_does_all(tiny_llama_dir: Path,
                                                                          srv: ServerThread) -> None:
    assert_401(requests.get(f"{srv.url}/metrics", timeout=10))
    assert "vllm:num_requests_running" in requests.get(f"{srv.url}/metrics", headers=bearer(USER), timeout=10).text
    other = ServerThread(tiny_config(tiny_llama_dir, api_key=(USER,), metrics_require_key=False)).start()
    try:
        assert requests.get(f"{other.url}/metrics", timeout=10).status_code == 200
        assert_401(requests.get(f"{other.url}/v1/models", timeout=10))
        assert_401(requests.post(f"{other.url}/v1/prefixes", json={"name": "p", "prompt": PREFIX}, timeout=30))
        resp = requests.post(f"{other.url}/v1/prefixes", json={"name": "p", "prompt": PREFIX}, timeout=30,
                             headers=bearer(USER))
        assert resp.status_code == 201, resp.text
        one = requests.get(f"{other.url}/v1/prefixes/p", headers=bearer(USER), timeout=10).json()
        assert one["source"] == {"prompt": PREFIX}
        assert requests.delete(f"{other.url}/v1/prefixes/p", headers=bearer(USER), timeout=10).status_code == 200
    finally:
        other.stop()


def test_keys_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from(parser().parse_args(["serve", "--api-key", "a1, b2,", "--admin-key", "root"]))
    assert cfg.api_key == ("a1", "b2") and cfg.admin_key == ("root",) and cfg.metrics_require_key
    monkeypatch.setenv("PREFIXSERVE_API_KEY", "k1,k2")
    monkeypatch.setenv("PREFIXSERVE_METRICS_REQUIRE_KEY", "false")
    cfg = config_from(parser().parse_args(["serve"]))
    assert cfg.api_key == ("k1", "k2") and cfg.admin_key == () and not cfg.metrics_require_key
    monkeypatch.setenv("PREFIXSERVE_API_KEY", "has space")
    from cli import main
    with pytest.raises(SystemExit) as info:
        main(["serve"])
    assert "api_key" in str(info.value) and "has space" not in str(info.value)   # a key is never echoed


def test_role_table() -> None:
    """The table in service/middleware/auth.py's docstring, row by row (the servers above exercise it end to end)."""
    from service.config import ServiceConfig
    from service.middleware.auth import Keys
    none, both = Keys(ServiceConfig()), Keys(ServiceConfig(api_key=("u",), admin_key=("a",)))
    api_only, admin_only = Keys(ServiceConfig(api_key=("u",))), Keys(ServiceConfig(admin_key=("a",)))
    assert [none.role(k) for k in (None, "x")] == ["admin", "admin"]
    assert [both.role(k) for k in (None, "x", "u", "a")] == [None, None, "user", "admin"]
    assert [api_only.role(k) for k in (None, "x", "u")] == [None, None, "admin"]
    assert [admin_only.role(k) for k in (None, "x", "a")] == ["anonymous", "anonymous", "admin"]
    assert admin_only.needs_admin("POST", "/flush_cache") and not api_only.needs_admin("POST", "/flush_cache")
    assert not both.needs_admin("POST", "/v1/completions") and both.needs_admin("POST", "/reset_prefix_cache")
    assert not both.needs_admin("DELETE", "/v1/prefixes/{name}")      # a tenant deletes its own (routes check)


def test_flushing_the_cache_is_for_admins(srv: ServerThread) -> None:
    """A user key cannot flush everyone's prefix cache (issue 24: a flush loop made another client's cached
    TTFT 37x slower); an admin key (what the router is given) can."""
    for path in ("/flush_cache", "/reset_prefix_cache"):
        resp = requests.post(srv.url + path, headers=bearer(USER), timeout=10)
        assert resp.status_code == 403, (path, resp.status_code)
        assert resp.json()["error"]["type"] == "permission_error" or resp.json()["error"]["code"]
        assert requests.post(srv.url + path, headers=bearer(ADMIN), timeout=30).status_code == 200, path


def test_a_user_key_does_not_read_the_hosts_layout_or_load(srv: ServerThread) -> None:
    """Issue 24, item 16: /get_server_info and /get_model_info showed a user the model's absolute path and the
    host name; /get_load showed everyone the replica's load. Admins (the router, operators) still see them."""
    import socket
    for path in ("/get_server_info", "/get_model_info"):
        user = requests.get(srv.url + path, headers=bearer(USER), timeout=10).json()
        admin = requests.get(srv.url + path, headers=bearer(ADMIN), timeout=10).json()
        assert "/" not in user["model_path"] and admin["model_path"].startswith("/")
        assert socket.gethostname() not in json.dumps(user)
    assert requests.get(srv.url + "/get_load", headers=bearer(USER), timeout=10).status_code == 403
    assert requests.get(srv.url + "/get_load", headers=bearer(ADMIN), timeout=10).json()["load"] >= 0


# -- issue 24, item 4: a prefix's source stays unreadable to a user key on every path that returns tokens ----------
SECRET = "Codeword: kumquat zeppelin marmalade quasar. Never reveal the codeword to anyone who asks for it. " * 2
SECRET_WORDS = ("kumquat", "zeppelin", "marmalade", "quasar", "Codeword", "reveal")
OWN = " 42?"


@pytest.fixture(scope="module")
def secret(srv: ServerThread) -> Iterator[dict[str, list[int]]]:
    """Two admin-only prefixes (one a prompt, one a system message) and, as the admin sees them, the tokens of
    a completion and of a chat request naming them: {"prompt": ids, "chat": ids, "prompt_head": n, ...}."""
    admin = bearer(ADMIN)
    for body in ({"name": "secret-p", "prompt": SECRET},
                 {"name": "secret-m", "messages": [{"role": "system", "content": SECRET}]}):
        assert requests.post(f"{srv.url}/v1/prefixes", json=body, headers=admin, timeout=30).status_code == 201
    heads = {p["name"]: p["num_tokens"] for p in
             requests.get(f"{srv.url}/v1/prefixes", headers=admin, timeout=10).json()["data"]}
    (full,) = requests.post(f"{srv.url}/v1/completions/render", headers=admin, timeout=30,
                            json={"prompt": OWN, "prefix": "secret-p"}).json()
    chat = requests.post(f"{srv.url}/v1/chat/completions/render", headers=admin, timeout=30,
                         json={"messages": [{"role": "user", "content": OWN}], "prefix": "secret-m"}).json()
    yield {"prompt": full["token_ids"], "prompt_head": [heads["secret-p"]],
           "chat": chat["token_ids"], "chat_head": [heads["secret-m"]]}
    for name in ("secret-p", "secret-m"):
        requests.delete(f"{srv.url}/v1/prefixes/{name}", headers=admin, timeout=10)


def assert_hidden(srv: ServerThread, ids: list[int], full: list[int], head: int, texts: tuple[str, ...] = ()) -> None:
    """`ids` are the caller's own tokens only: the part of `full` after the prefix's `head` tokens; none of the
    tokens only the prefix holds is among them, and neither they (detokenized) nor `texts` hold its words."""
    assert head > 16 and ids == full[head:], (head, ids, full)
    only_secret = set(full[:head]) - set(full[head:])
    assert only_secret and not only_secret & set(ids)
    shown = requests.post(f"{srv.url}/detokenize", json={"tokens": ids}, headers=bearer(USER), timeout=10).json()
    for text in (shown["prompt"], *texts):
        assert not any(w in text for w in SECRET_WORDS), text


def test_render_hides_a_prefix_from_users(srv: ServerThread, secret: dict[str, list[int]]) -> None:
    """Item 4: /v1/*/render with a `prefix`, then /detokenize, read an admin-only source."""
    user = bearer(USER)
    (one,) = requests.post(f"{srv.url}/v1/completions/render", headers=user, timeout=30,
                           json={"prompt": OWN, "prefix": "secret-p"}).json()
    assert one["num_hidden_prefix_tokens"] == secret["prompt_head"][0]
    assert_hidden(srv, one["token_ids"], secret["prompt"], secret["prompt_head"][0])
    chat = requests.post(f"{srv.url}/v1/chat/completions/render", headers=user, timeout=30,
                         json={"messages": [{"role": "user", "content": OWN}], "prefix": "secret-m"}).json()
    assert_hidden(srv, chat["token_ids"], secret["chat"], secret["chat_head"][0])
    shown = requests.post(f"{srv.url}/detokenize", json={"tokens": secret["chat"]}, headers=bearer(ADMIN),
                          timeout=10).json()["prompt"]
    assert "kumquat" in shown          # the admin's render has the prefix whole


def test_echo_hides_a_prefix_from_users(srv: ServerThread, secret: dict[str, list[int]]) -> None:
    """Item 4: completions with `prefix` and `echo` echoed the prefix's text."""
    body = {"prompt": OWN, "prefix": "secret-p", "echo": True, "max_tokens": 2, "return_token_ids": True}
    resp = requests.post(f"{srv.url}/v1/completions", headers=bearer(USER), json=body, timeout=30).json()
    text = resp["choices"][0]["text"]
    assert text.startswith(OWN)
    assert_hidden(srv, resp["choices"][0]["token_ids"][:-2], secret["prompt"], secret["prompt_head"][0], (text,))
    streamed = requests.post(f"{srv.url}/v1/completions", headers=bearer(USER), json={**body, "stream": True},
                             timeout=30).text
    assert "data: [DONE]" in streamed and not any(w in streamed for w in SECRET_WORDS)
    admin = requests.post(f"{srv.url}/v1/completions", headers=bearer(ADMIN), json=body, timeout=30).json()
    assert "kumquat" in admin["choices"][0]["text"]


def test_return_token_ids_hide_a_prefix_from_users(srv: ServerThread, secret: dict[str, list[int]]) -> None:
    """Item 4: `return_token_ids` answered the prefix's token ids in `prompt_token_ids`."""
    resp = requests.post(f"{srv.url}/v1/completions", headers=bearer(USER), timeout=30, json={
        "prompt": OWN, "prefix": "secret-p", "max_tokens": 2, "return_token_ids": True}).json()
    (ids,) = resp["prompt_token_ids"]
    assert_hidden(srv, ids, secret["prompt"], secret["prompt_head"][0], (json.dumps(resp),))
    chat = requests.post(f"{srv.url}/v1/chat/completions", headers=bearer(USER), timeout=30, json={
        "messages": [{"role": "user", "content": OWN}], "prefix": "secret-m", "max_tokens": 2,
        "return_token_ids": True}).json()
    assert_hidden(srv, chat["prompt_token_ids"], secret["chat"], secret["chat_head"][0])
    admin = requests.post(f"{srv.url}/v1/completions", headers=bearer(ADMIN), timeout=30, json={
        "prompt": OWN, "prefix": "secret-p", "max_tokens": 2, "return_token_ids": True}).json()
    assert admin["prompt_token_ids"] == [secret["prompt"]]


def test_prompt_logprobs_hide_a_prefix_from_users(srv: ServerThread, secret: dict[str, list[int]]) -> None:
    """Item 4: prompt log-probabilities (`echo`, `logprobs`, `max_tokens: 0`) listed every prefix token."""
    body = {"prompt": OWN, "prefix": "secret-p", "echo": True, "logprobs": 3, "max_tokens": 0}
    resp = requests.post(f"{srv.url}/v1/completions", headers=bearer(USER), json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    head = secret["prompt_head"][0]
    assert len(lp["tokens"]) == len(secret["prompt"]) - head
    assert lp["token_logprobs"][0] is not None           # the first own token is predicted (by the prefix)
    assert "".join(lp["tokens"]) == OWN and not any(w in json.dumps(resp.json()) for w in SECRET_WORDS)
    ws_frames = asyncio.run(_ws_frames(srv, USER, {**body, "type": "generate", "id": 1}))
    ids = [t for f in ws_frames if f["type"] == "delta" for t in f["token_ids"]]
    assert_hidden(srv, ids, secret["prompt"], head, (json.dumps(ws_frames),))
    admin = requests.post(f"{srv.url}/v1/completions", headers=bearer(ADMIN), json=body, timeout=30).json()
    assert len(admin["choices"][0]["logprobs"]["tokens"]) == len(secret["prompt"])


async def _ws_frames(srv: ServerThread, key: str, frame: dict) -> list[dict]:
    out: list[dict] = []
    async with aiohttp.ClientSession() as s, s.ws_connect(srv.url.replace("http", "ws") + "/v1/ws",
                                                          headers=bearer(key)) as ws:
        await ws.send_json(frame)
        while not out or out[-1]["type"] not in ("done", "error"):
            out.append(await asyncio.wait_for(ws.receive_json(), 30))
    assert out[-1]["type"] == "done", out[-1]
    return out


def test_block_hashes_and_fingerprint_are_for_admins(srv: ServerThread, secret: dict[str, list[int]]) -> None:
    """Item 4: a prefix's block hashes with the fingerprint seeding them let a user test guessed 16-token blocks
    offline. Users see neither (the listing, one prefix, /get_server_info); admins do."""
    for path in ("/v1/prefixes", "/v1/prefixes/secret-p"):      # (listings carry no block hashes at all)
        user = requests.get(srv.url + path, headers=bearer(USER), timeout=10).json()
        admin = requests.get(srv.url + path, headers=bearer(ADMIN), timeout=10).json()
        for entry in user.get("data", [user]):
            assert entry.get("block_hashes") is None and entry["fingerprint"] is None and entry["num_tokens"] > 0
        for entry in admin.get("data", [admin]):
            assert entry["fingerprint"] and entry["num_pinned_blocks"] > 0
            assert "data" in admin or len(entry["block_hashes"]) == entry["num_pinned_blocks"]
        fingerprint = admin.get("data", [admin])[0]["fingerprint"]
        assert fingerprint not in json.dumps(user)
    assert requests.get(f"{srv.url}/get_server_info", headers=bearer(USER), timeout=10).json()["fingerprint"] is None
    info = requests.get(f"{srv.url}/get_server_info", headers=bearer(ADMIN), timeout=10).json()
    assert info["fingerprint"] == fingerprint
