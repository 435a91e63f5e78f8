"""The reliability suite: what a hostile or careless client does, against a real server process and a
real redis-server on loopback, bounded in count and time. After every attack the same invariants hold:
no 5xx but the documented ones, the engine idle, every used KV block pinned (nothing leaked), the pinned
total equal to what the registry accounts for, and the server still answering."""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import redis as redis_py
import requests

from engine.kv.events import KVEventsConfig
from tests.helpers.kv_subscriber import LOOPBACK, listening
from tests.helpers.redis_server import RedisServer, free_port
from tests.helpers.schemas import patterns_schema
from tests.helpers.server import ServerProcess, http

SYSTEM = "You are the reliability suite's system prompt; answer in one short line about caches. " * 3
GRAMMAR_TIMEOUT_S = 3
ALLOWED_5XX = {"503", "507"}      # store down / draining; pin cap or registry full: the API's contract


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path, redis: RedisServer) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_llama_dir), "--max-model-len", "256", "--num-kv-blocks", "96", "--block-size", "8",
            "--redis-url", redis.url, "--keepalive-timeout", "1", "--body-timeout", "1", "--max-num-seqs", "32",
            "--grammar-compile-timeout", str(GRAMMAR_TIMEOUT_S), "--grammar-cache-size", "4",
            "--max-echo-logprobs", "600000"]
    with ServerProcess(args).start() as s:
        yield s


def _session() -> aiohttp.ClientSession:
    """No pooled connections: the server under test drops idle ones after a second."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def statuses(srv: ServerProcess) -> dict[str, float]:
    text = requests.get(f"{srv.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("prefixserve_http_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            out[status] = out.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def settled(srv: ServerProcess, timeout: float = 30.0) -> None:
    """The invariants, once the engine has drained what the attack started."""
    deadline = time.monotonic() + timeout
    while True:
        running, waiting = srv.metric("vllm:num_requests_running"), srv.metric("vllm:num_requests_waiting")
        used, pinned = srv.metric("prefixserve_kv_blocks_used"), srv.metric("prefixserve_kv_blocks_pinned")
        status, listing = http("GET", f"{srv.url}/v1/prefixes", timeout=10)
        registry = sum(p["num_pinned_blocks"] for p in listing["data"] if p["loaded"]) if status == 200 else -1
        if running == waiting == 0 and used == pinned == registry:
            break
        assert time.monotonic() < deadline, dict(running=running, waiting=waiting, used=used, pinned=pinned,
                                                 registry=registry)
        time.sleep(0.1)
    assert http("POST", f"{srv.url}/v1/completions", {"prompt": "still there?", "max_tokens": 2})[0] == 200


def attack(srv: ServerProcess, run: Callable[[], None]) -> None:
    before = statuses(srv)
    run()
    settled(srv)
    after = statuses(srv)
    bad = {s: after[s] - before.get(s, 0) for s in after if s.startswith("5") and s not in ALLOWED_5XX
           and after[s] > before.get(s, 0)}
    assert not bad, bad


def test_half_the_streams_cut(srv: ServerProcess) -> None:
    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"prompt": f"stream {i}", "max_tokens": 40, "ignore_eos": True, "stream": True}
        async with s.post(f"{srv.url}/v1/completions", json=body) as r:
            async for _ in r.content:
                if i % 2:
                    return                                  # the client goes away mid-stream

    async def run() -> None:
        async with _session() as s:
            await asyncio.gather(*(one(s, i) for i in range(40)))

    attack(srv, lambda: asyncio.run(run()))


def test_bodies_that_crash_parsers(srv: ServerProcess) -> None:
    broken = [b"[" * 5000 + b"]" * 5000, b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": '
              b'"\\udfff"}]}', b"\xff\xfe\x00", b'{"prompt": "x", "n": 1e400}']
    heavy = [json.dumps({"prompt": "hi" * 20000}).encode(), json.dumps({"prompt": ["a"] * 5000}).encode()]

    def run() -> None:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/prefixes", "/tokenize", "/detokenize"):
            for raw in broken + heavy:
                r = requests.post(srv.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
                assert r.status_code < 500, (path, raw[:40], r.status_code, r.text[:200])
                if raw in broken or path != "/tokenize":
                    assert r.status_code >= 400, (path, raw[:40], r.status_code)
    attack(srv, run)


def test_websocket_storms(srv: ServerProcess) -> None:
    async def run() -> None:
        ws_url = srv.url.replace("http", "ws") + "/v1/ws"
        async with _session() as s, s.ws_connect(ws_url) as ws:
            for i in range(70):
                await ws.send_json({"type": "generate", "id": i, "prompt": "hi", "max_tokens": 100, "ignore_eos": True})
                await ws.send_json({"type": "cancel", "id": i})
            await ws.send_str("[" * 4000)
            await ws.send_str('{"type": "generate", "id": "s", "prompt": "\\ud800"}')
            ended: set[int] = set()
            while len(ended) < 70:                          # every generation ends (done, or 429 at the cap)
                frame = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
                if frame["type"] in ("done", "error") and isinstance(frame.get("id"), int):
                    ended.add(frame["id"])
            await ws.send_json({"type": "generate", "id": "last", "prompt": "hi", "max_tokens": 3})
            while True:
                frame = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
                if frame.get("id") == "last" and frame["type"] in ("done", "error"):
                    assert frame["type"] == "done"
                    break
        # and one socket closed with generations running
        async with _session() as s, s.ws_connect(ws_url) as ws:
            for i in range(5):
                await ws.send_json({"type": "generate", "id": i, "prompt": "hi", "max_tokens": 200, "ignore_eos": True})
            await ws.receive()
    attack(srv, lambda: asyncio.run(run()))


def test_clients_leaving_mid_registration_and_churn(srv: ServerProcess) -> None:
    """Registrations whose clients leave at every point, then one name registered and deleted at once. Each
    prefix here takes 20 of the 48 blocks the pin cap allows: whether leave-0 and leave-1 both got pinned
    depends on timing, and then the churn's registrations meet the cap: 507, the API's answer for it."""
    async def run() -> None:
        async with _session() as s:
            for i in range(10):
                try:
                    async with asyncio.timeout(0.003 * i):
                        await s.post(f"{srv.url}/v1/prefixes", json={"name": f"leave-{i % 2}",
                                                                     "prompt": f"{i % 2} {SYSTEM}"})
                except TimeoutError:
                    pass
            posts = [s.post(f"{srv.url}/v1/prefixes", json={"name": "churn", "prompt": f"{i} {SYSTEM}"})
                     for i in range(6)]
            deletes = [s.delete(f"{srv.url}/v1/prefixes/churn") for _ in range(6)]
            for r in await asyncio.gather(*posts, *deletes):
                assert r.status in (200, 201, 404, 409, 507), (r.status, await r.text())
                if r.status == 507:
                    assert (await r.json())["error"]["code"] == "pin_cap_exceeded"

    def cleaned() -> None:
        try:
            asyncio.run(run())
        finally:
            for name in ("leave-0", "leave-1", "churn"):
                http("DELETE", f"{srv.url}/v1/prefixes/{name}")
    attack(srv, cleaned)


def test_redis_dies_and_comes_back_empty(srv: ServerProcess, redis: RedisServer) -> None:
    def run() -> None:
        assert http("POST", f"{srv.url}/v1/prefixes", {"name": "kept", "prompt": SYSTEM})[0] == 201
        redis.stop()
        assert http("POST", f"{srv.url}/v1/completions", {"prompt": "go on", "max_tokens": 3})[0] == 200
        assert http("POST", f"{srv.url}/v1/prefixes", {"name": "x", "prompt": SYSTEM + "x"})[0] == 503
        redis.start()                                        # back, empty (no persistence)
        deadline = time.monotonic() + 30
        while http("GET", f"{srv.url}/v1/prefixes")[1]["data"]:   # the resync drops what the store lost
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert http("POST", f"{srv.url}/v1/prefixes", {"name": "kept", "prompt": SYSTEM + " v2"})[0] == 201
        assert http("DELETE", f"{srv.url}/v1/prefixes/kept")[0] == 200
    attack(srv, run)


def test_a_foreign_record_in_redis(srv: ServerProcess, redis: RedisServer) -> None:
    def run() -> None:
        status, rec = http("POST", f"{srv.url}/v1/prefixes", {"name": "mine", "prompt": SYSTEM})
        assert status == 201
        client = redis_py.Redis.from_url(redis.url)
        client.set(f"prefixserve:prefix:{rec['fingerprint']}:foreign", b"\x92\x01")
        client.sadd(f"prefixserve:prefixes:{rec['fingerprint']}", "foreign")
        assert http("GET", f"{srv.url}/v1/prefixes")[0] == 200
        assert http("GET", f"{srv.url}/v1/prefixes/foreign")[0] == 503
        assert http("DELETE", f"{srv.url}/v1/prefixes/foreign")[0] == 200
        assert http("DELETE", f"{srv.url}/v1/prefixes/mine")[0] == 200
        client.close()
    attack(srv, run)


def test_slow_and_huge_clients(srv: ServerProcess) -> None:
    def run() -> None:
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(100)]
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n")
        big = {"prompt": ["the quick brown fox " * 200] * 100, "max_tokens": 1}
        assert http("POST", f"{srv.url}/v1/completions", big, timeout=120)[0] in (200, 400)
        for s in socks:
            assert s.recv(100) == b""                       # dropped by the server
            s.close()
    attack(srv, run)


def test_pins_squeeze_running_requests(srv: ServerProcess) -> None:
    async def run() -> None:
        async with _session() as s:
            async def gen(i: int) -> int:
                body = {"prompt": f"squeeze {i}", "max_tokens": 150, "ignore_eos": True}
                async with s.post(f"{srv.url}/v1/completions", json=body) as r:
                    return r.status
            tasks = [asyncio.create_task(gen(i)) for i in range(8)]
            await asyncio.sleep(0.2)
            pins = [await s.post(f"{srv.url}/v1/prefixes", json={"name": f"sq{i}", "prompt": f"{i} " + SYSTEM})
                    for i in range(3)]
            assert all(p.status in (201, 507) for p in pins), [(p.status, await p.text()) for p in pins]
            assert all(code in (200, 429) for code in await asyncio.gather(*tasks))
            for i in range(3):
                await s.delete(f"{srv.url}/v1/prefixes/sq{i}")
    attack(srv, lambda: asyncio.run(run()))


def test_degenerate_sampling_and_cross_site_posts(srv: ServerProcess) -> None:
    async def run() -> None:
        async with _session() as s:
            async def one(body: dict) -> tuple[int, str]:
                async with s.post(f"{srv.url}/v1/completions", json=body) as r:
                    return r.status, await r.text()
            greedy = {"prompt": "a neighbour", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            results = await asyncio.gather(one(greedy), *(one({"prompt": "hostile", "max_tokens": 12,
                                                               "temperature": t, "ignore_eos": True})
                                                          for t in (1e-300, 1e-40, 1e-7)))
            assert all(status == 200 for status, _ in results), results
            for kind in ("text/plain", "application/x-www-form-urlencoded"):
                async with s.post(f"{srv.url}/v1/prefixes", data='{"name": "xsite", "prompt": "' + SYSTEM + '"}',
                                  headers={"Content-Type": kind}) as r:
                    assert r.status == 415
        assert http("GET", f"{srv.url}/v1/prefixes/xsite")[0] == 404
    attack(srv, lambda: asyncio.run(run()))


def test_vattention_mappings_stay_bounded_and_health_truthful(tiny_llama_dir: Path) -> None:
    """Issue 24, item 1, as it was found: on the vattention backend a long cached prompt, the cache flushed
    (the prompt's pages come back out of order, one mapping each), then n=64 requests on it at once: each
    sample maps the whole prompt into a slot of its own. Mappings are bounded (--kv-max-mappings):
    what cannot be mapped is refused with a 507 to its own client, nothing is left half-mapped, every later
    request of another client succeeds with the same tokens as before, and /health stays 200 (truthfully)."""
    args = ["--model", str(tiny_llama_dir), "--kv-backend", "vattention", "--max-model-len", "1024", "--block-size",
            "8", "--num-kv-blocks", "1024", "--max-num-seqs", "64", "--kv-max-mappings", "2000"]
    long_prompt = [3 + (i * 7919) % 380 for i in range(1000)]
    other = {"prompt": "another client's question", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def together(url: str, bodies: list[dict]) -> list[tuple[int, str]]:
        async with _session() as sess:
            async def one(body: dict) -> tuple[int, str]:
                async with sess.post(f"{url}/v1/completions", json=body) as r:
                    return r.status, await r.text()
            return await asyncio.gather(*(one(b) for b in bodies))

    with ServerProcess(args).start() as s:
        status, before = http("POST", f"{s.url}/v1/completions", other)
        assert status == 200, before
        for k in range(9):                  # every page used once, freed last page first
            prompt = long_prompt if k == 0 else [3 + (i * (31 + 2 * k)) % 380 for i in range(1000)]
            assert http("POST", f"{s.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})[0] == 200
        assert http("POST", f"{s.url}/flush_cache")[0] == 200
        # the long prompt again, in a slot of its own: its pages now come from the free queue, out of order
        assert [c for c, _ in asyncio.run(together(s.url, [{"prompt": [5, 6], "max_tokens": 1},
                                                             {"prompt": long_prompt, "max_tokens": 1}]))] == [200, 200]
        flood = [{"prompt": long_prompt, "n": 64, "max_tokens": 4, "temperature": 1.0, "seed": i, "ignore_eos": True}
                 for i in range(4)]
        results = asyncio.run(together(s.url, flood))
        assert all(code in (200, 507) for code, _ in results), results
        assert any(code == 507 for code, _ in results), "the limit was meant to be reached"
        for code, text in results:
            if code == 507:
                assert json.loads(text)["error"]["code"] == "kv_mapping_limit", text
        assert s.metric("prefixserve_vattention_refused_seqs_total") > 0
        assert s.metric("prefixserve_vattention_map_areas") <= 2000
        for _ in range(3):
            status, after = http("POST", f"{s.url}/v1/completions", other)
            assert status == 200, after
            assert after["choices"][0]["text"] == before["choices"][0]["text"]
        status, again = http("POST", f"{s.url}/v1/completions", flood[0])
        assert status in (200, 507), again
        assert s.health() == 200 and s.metric("prefixserve_vattention_failed") == 0


def _registration_storm(url: str, k: int, tag: str, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        try:
            http("POST", f"{url}/v1/prefixes", {"name": f"storm-{k}-{i % 4}", "prompt": f"{tag} {k} {i} {SYSTEM}"},
                 timeout=5)
            http("DELETE", f"{url}/v1/prefixes/storm-{k}-{(i + 2) % 4}", timeout=5)
        except OSError:
            return
        i += 1


def test_sigterm_during_a_registration_storm_exits_in_time(tiny_llama_dir: Path) -> None:
    """Issue 24, item 17: SIGTERM while registrations are in flight (Redis registry) used to hang until SIGKILL:
    the registry waited on its events task, which stopped only once the store was closed, after the wait (and
    redis-py may swallow the cancellation of a command in flight, so the task never saw it). A redis-server of
    its own: the storm's records would be pinned by every later server of the module's Redis."""
    shutdown_timeout = 2.0
    for attempt in range(2):                 # the hang struck about one SIGTERM in two
        with RedisServer() as redis, ServerProcess([
                "--model", str(tiny_llama_dir), "--max-model-len", "256", "--num-kv-blocks", "256", "--block-size", "8",
                "--redis-url", redis.url, "--shutdown-timeout", str(shutdown_timeout)]).start() as s:
            assert s.proc is not None
            stop = threading.Event()
            threads = [threading.Thread(target=_registration_storm, args=(s.url, k, str(attempt), stop), daemon=True)
                       for k in range(6)]
            for t in threads:
                t.start()
            time.sleep(1.0 + 0.3 * attempt)
            start = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(shutdown_timeout + 8)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {time.monotonic() - start:.1f} s after SIGTERM:\n{s.log()}")
            finally:
                stop.set()
            for t in threads:
                t.join(10)
            assert s.proc.returncode == 0, s.log()


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    """A server with small network limits: 3 WebSockets a client, idle ones closed after 1.5 s, writes that wait
    more than 1 s aborted, one extra allowed host, KV events on the default host (a free port)."""
    host = KVEventsConfig().endpoint.rsplit(":", 1)[0]
    events = {"enable_kv_cache_events": True, "endpoint": f"{host}:{free_port()}",
              "replay_endpoint": f"{host}:{free_port()}"}
    args = ["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "4200",
            "--max-ws-per-client", "3", "--ws-idle-timeout", "1.5", "--write-timeout", "1",
            "--allowed-hosts", "api.internal", "--kv-events-config", json.dumps(events)]
    with ServerProcess(args).start() as s:
        yield s


def test_kv_events_listen_on_loopback_only(guarded: ServerProcess) -> None:
    """Issue 24, item 5: the documented KV events configuration bound every interface."""
    sources = http("GET", f"{guarded.url}/kv_event_sources")[1]["0"]
    for endpoint in (sources["endpoint"], sources["replay_endpoint"]):
        port = int(endpoint.rsplit(":", 1)[1])
        assert listening(port) and listening(port) <= LOOPBACK, (endpoint, listening(port))


def test_a_forged_host_and_a_foreign_origin_are_refused(guarded: ServerProcess) -> None:
    """Issue 24, item 7 (DNS rebinding): a Host this server does not answer to gets 421 on every path, and a
    WebSocket is refused whether its Origin matches that forged Host or not."""
    port = guarded.port

    def status(method: str, path: str, host: str) -> tuple[int, Any]:
        r = requests.request(method, guarded.url + path, json={"prompt": "hi", "max_tokens": 1} if method == "POST"
                             else None, headers={"Host": host}, timeout=30)
        return r.status_code, r.json() if r.headers.get("Content-Type", "").startswith("application/json") else r.text

    def run() -> None:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/prefixes"),
                             ("GET", "/"), ("GET", "/health"), ("GET", "/metrics")]:
            code, body = status(method, path, f"evil.example.net:{port}")
            assert code == 421 and body["error"]["code"] == "host_not_allowed", (path, code, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"api.internal:{port}", f"[::1]:{port}"):
            assert status("GET", "/v1/models", host)[0] == 200, host

        async def ws(**headers: str) -> int:
            async with _session() as s:
                try:
                    async with s.ws_connect(f"{guarded.url.replace('http', 'ws')}/v1/ws", headers=headers):
                        return 101
                except aiohttp.WSServerHandshakeError as exc:
                    return exc.status

        async def sockets() -> list[int]:
            return [await ws(Host=f"evil.example.net:{port}", Origin=f"http://evil.example.net:{port}"),
                    await ws(Origin=f"http://evil.example.net:{port}"),
                    await ws(Host=f"api.internal:{port}", Origin=f"http://api.internal:{port}"),
                    await ws(Host=f"api.internal:{port}", Origin="http://api.internal:1")]
        assert asyncio.run(sockets()) == [421, 403, 101, 403]
    attack(guarded, run)


def test_websockets_per_client_are_capped_and_idle_ones_closed(guarded: ServerProcess) -> None:
    """Issue 24, item 11: idle WebSockets were never closed and one client could hold any number."""
    url = guarded.url.replace("http", "ws") + "/v1/ws"

    async def run() -> None:
        async with _session() as s:
            held = [await s.ws_connect(url) for _ in range(3)]
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await s.ws_connect(url)
            assert refused.value.status == 429
            async with s.get(f"{guarded.url}/v1/ws", headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                                              "Sec-WebSocket-Version": "13",
                                                              "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}) as r:
                assert r.status == 429 and (await r.json())["error"]["code"] == "too_many_websockets"
            async with s.get(f"{guarded.url}/health") as r:
                assert r.status == 200
            # one socket keeps talking (a frame every 0.5 s, a generation); the two silent ones are closed, the
            # one that sends PINGs (answered by aiohttp, as a client's PONGs to our heartbeat are) too (issue 34,
            # item 7: they restarted aiohttp's receive timeout, so such a socket was never idle)
            async def ping(ws: aiohttp.ClientWebSocketResponse) -> None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    while not ws.closed:
                        await ws.ping()
                        await asyncio.sleep(0.3)
            pinger = asyncio.create_task(ping(held[2]))
            t0 = time.monotonic()
            for i in range(6):
                await held[0].send_json({"type": "generate", "id": i, "prompt": "hi", "max_tokens": 2})
                while (await held[0].receive_json(timeout=10))["type"] != "done":
                    pass
                await asyncio.sleep(0.5)
            for idle in held[1:]:
                msg = await asyncio.wait_for(idle.receive(), 5)     # (the PONGs would restart receive's timeout)
                assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4408, msg
            await pinger
            assert time.monotonic() - t0 >= 1.5 and not held[0].closed
            fresh = await s.ws_connect(url)             # the closed ones no longer count
            await fresh.close()
            for ws in held:
                await ws.close()
    attack(guarded, lambda: asyncio.run(run()))


def _finished(srv: ServerProcess, reason: str) -> float:
    text = requests.get(f"{srv.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line)


def test_a_client_that_never_reads_is_cut_off(guarded: ServerProcess) -> None:
    """Issue 24, item 15: a client that never read held its SSE handler and its buffered output forever (and
    its generation ran to the end). Now the write that waits longer than --write-timeout aborts it. 64 choices
    with 20 logprobs each fill the client's 4 KiB window and the server's buffers (4 MiB on loopback) within
    seconds; running to the end would take 64,000 tokens."""
    def run() -> None:
        aborted = _finished(guarded, "abort")
        body = json.dumps({"prompt": "never read", "max_tokens": 1000, "n": 64, "logprobs": 20, "ignore_eos": True,
                           "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", guarded.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        t0 = time.monotonic()
        while guarded.metric("vllm:num_requests_running") == 0:
            assert time.monotonic() - t0 < 20
            time.sleep(0.05)
        assert http("POST", f"{guarded.url}/v1/completions", {"prompt": "a neighbour", "max_tokens": 3})[0] == 200
        while guarded.metric("vllm:num_requests_running") > 0:     # aborted, not run to its 64,000 tokens
            assert time.monotonic() - t0 < 60
            time.sleep(0.1)
        assert guarded.metric("vllm:generation_tokens_total") < 40_000
        assert _finished(guarded, "abort") > aborted
        status, load = http("GET", f"{guarded.url}/get_load")
        assert status == 200 and load["load"] == 0
        sock.settimeout(5)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
        sock.close()
    attack(guarded, run)


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_grammars_with_no_finite_instance(srv: ServerProcess) -> None:
    """Issue 24, item 10: a schema with no instance at all (`{"$ref": "#"}`) is a 400 naming its field, streamed
    or not; one that runs into a rule that can never finish is a 400 (an error event once streaming); a choice
    that ends before `min_tokens` ends with finish_reason "stop" (the grammar's end wins over min_tokens).
    Each of these used to be a 500."""
    msg = [{"role": "user", "content": "hi"}]
    looped = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}

    def run() -> None:
        chat = {"messages": msg, "response_format": looped}
        for path, body, param in [("/v1/chat/completions", chat, "response_format"),
                                  ("/v1/completions", {"prompt": "x", "guided_json": {"$ref": "#"}}, "guided_json"),
                                  ("/v1/completions", {"prompt": "x", "guided_json": {"anyOf": [{"$ref": "#"}]}},
                                   "guided_json")]:
            for stream in (False, True):
                r = requests.post(srv.url + path, json={**body, "max_tokens": 8, "stream": stream}, timeout=60)
                assert r.status_code == 400, (path, stream, r.status_code, r.text[:300])
                err = r.json()["error"]
                assert err["param"] == param and "no output" in err["message"], err
        dead_end = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
                    "$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}]}}}   # `{"a": ` and then nothing can follow
        # (xgrammar 0.2.9 refuses the bare chain {"x": {"$ref": "#/$defs/x"}} at compile time: it has "no output")
        body = {"prompt": "x", "guided_json": dead_end, "max_tokens": 30}
        status, out = http("POST", f"{srv.url}/v1/completions", body)
        assert status == 400 and "admits no continuation" in out["error"]["message"], out
        r = requests.post(f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60)
        assert r.status_code == 200 and "admits no continuation" in r.text, r.text[-300:]    # after the headers
        assert r.text.rstrip().endswith("data: [DONE]")
        body = {"prompt": "mood:", "guided_choice": ["yes", "no"], "min_tokens": 20, "max_tokens": 30}
        status, out = http("POST", f"{srv.url}/v1/completions", body)
        assert status == 200, out
        assert out["choices"][0]["text"] in ("yes", "no") and out["choices"][0]["finish_reason"] == "stop", out
        r = requests.post(f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60)
        events = _sse_events(r.text)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) in ("yes", "no")
        assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "stop"
    attack(srv, run)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _compiles_running(srv: ServerProcess) -> int:
    """Grammar compiles in flight: the children of the server's compile helper (engine/sample/grammar_probe.py)."""
    helpers = [c for c in _children(srv.proc.pid)
               if b"grammar_probe" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sum(len(_children(h)) for h in helpers)


async def _compiles_end(srv: ServerProcess, within: float = 1.5) -> None:
    deadline = time.monotonic() + within
    while _compiles_running(srv) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _compiles_running(srv) == 0


def _strings_schema(n: int, max_length: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": max_length + 7 * i}
                                            for i in range(n)},
            "required": [f"p{i}" for i in range(n)], "additionalProperties": False}


def test_a_grammar_that_compiles_for_a_minute(srv: ServerProcess) -> None:
    """Issue 24, item 2: a 3 KB schema (40 strings with long bounded patterns; seconds of CPU to compile on this
    test model's 384-token vocabulary, more on a real one) is refused with a 400 naming the limit once
    --grammar-compile-timeout passed; meanwhile another client's plain completion and cheap grammar finish at
    once; and a client that leaves while its grammar compiles has its compile killed, freeing the compiler."""
    slow = {"type": "json_schema", "json_schema": {"name": "slow", "schema": patterns_schema(40, 2000, step=7)}}
    msg = [{"role": "user", "content": "hi"}]

    async def run() -> None:
        async with _session() as s:
            async def post(path: str, body: dict) -> tuple[int, dict, float]:
                t = time.monotonic()
                async with s.post(srv.url + path, json=body) as r:
                    return r.status, await r.json(), time.monotonic() - t

            def cheap(i: int) -> dict:
                return {"prompt": "mood:", "max_tokens": 4, "guided_choice": [f"yes{i}", f"no{i}"]}

            assert (await post("/v1/completions", cheap(0)))[0] == 200       # the compile helper is up
            slow_task = asyncio.create_task(post("/v1/chat/completions", {"messages": msg, "max_tokens": 8,
                                                                          "response_format": slow}))
            await asyncio.sleep(0.5)
            assert _compiles_running(srv) == 1
            status, _, took = await post("/v1/completions", {"prompt": "a neighbour", "max_tokens": 2})
            assert status == 200 and took < 5, took
            status, _, took = await post("/v1/completions", cheap(1))
            assert status == 200 and took < 5, took
            status, body, took = await slow_task
            assert status == 400 and "--grammar-compile-timeout" in body["error"]["message"], body
            assert body["error"]["param"] == "response_format" and took < GRAMMAR_TIMEOUT_S + 10, took
            await _compiles_end(srv)                                       # killed, not left compiling

            leaving = [asyncio.create_task(post("/v1/chat/completions", {"messages": msg, "max_tokens": 8,
                                                                         "response_format": {**slow, "json_schema": {
                                                                             "name": "x", "schema": patterns_schema(
                                                                                 40, 3000 + i, step=7)}}}))
                       for i in range(2)]                                  # as many as the compile workers
            await asyncio.sleep(0.5)
            assert _compiles_running(srv) == 2
            for task in leaving:
                task.cancel()                                              # the clients go away
            await asyncio.gather(*leaving, return_exceptions=True)
            await _compiles_end(srv)
            status, _, took = await post("/v1/completions", cheap(2))        # the compiler is free at once
            assert status == 200 and took < GRAMMAR_TIMEOUT_S - 1, took
    attack(srv, lambda: asyncio.run(run()))


def test_many_distinct_schemas_keep_the_grammar_cache_bounded(srv: ServerProcess) -> None:
    """Issue 24, item 3: eight distinct schemas through a server that keeps four compiled grammars: it keeps four
    (count and bytes, as /metrics reports them), and the first schemas, evicted, compile again and still
    constrain the output."""
    schemas = [_strings_schema(3, 30 + i) for i in range(8)]

    def one(schema: dict) -> None:
        status, out = http("POST", f"{srv.url}/v1/completions", {"prompt": "x", "max_tokens": 40, "temperature": 0,
                                                                 "guided_json": schema})
        assert status == 200, out
        if out["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)
        else:
            assert out["choices"][0]["text"].startswith('{"p0": "'), out

    def run() -> None:
        sizes = []
        for schema in schemas:
            one(schema)
            sizes.append(srv.metric("prefixserve_grammar_cache_bytes"))
            assert srv.metric("prefixserve_grammar_cache_entries") <= 4
        assert srv.metric("prefixserve_grammar_cache_entries") == 4
        assert max(sizes) <= 4 * sizes[0] * 1.5 and sizes[-1] > 0, sizes      # four grammars' worth, never eight
        for schema in schemas[:2]:                                 # evicted long ago: compiled again, and honoured
            one(schema)
        assert srv.metric("prefixserve_grammar_cache_entries") == 4
    attack(srv, run)


def test_large_tokenize_bodies_do_not_hold_up_a_small_request(srv: ServerProcess) -> None:
    """Issue 24, item 14: six ~1 MB /tokenize bodies in flight (a second or more of tokenizing each here) and
    another client's 2-token completion still finishes at once: large bodies are parsed and tokenized on a
    thread of their own. Text over --max-prompt-chars is refused with a 400 before any tokenizing."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 .,"
    text = "".join(alphabet[(i * 7919) % len(alphabet)] for i in range(1_000_000))     # little for BPE to merge
    big = json.dumps({"prompt": text}).encode()
    limit = 2**20                                                                        # the default

    async def run() -> None:
        async with _session() as s:
            async def tokenize() -> int:
                async with s.post(f"{srv.url}/tokenize", data=big, headers={"Content-Type": "application/json"}) as r:
                    return r.status if r.status != 200 else len((await r.json())["tokens"]) and 200

            tasks = [asyncio.create_task(tokenize()) for _ in range(6)]
            await asyncio.sleep(0.5)                               # the bodies are in, the tokenizing has begun
            t = time.monotonic()
            async with s.post(f"{srv.url}/v1/completions", json={"prompt": "a neighbour", "max_tokens": 2}) as r:
                status = r.status
            took = time.monotonic() - t
            assert status == 200 and took < 5, took
            assert await asyncio.gather(*tasks) == [200] * 6

            over = "y" * (limit + 1)
            halves = [{"role": "user", "content": over[:limit // 2]}] * 2 + [{"role": "user", "content": "!"}]
            for path, body, param in [("/tokenize", {"prompt": over}, "prompt"),
                                      ("/tokenize", {"messages": [{"role": "user", "content": over}]}, "messages"),
                                      ("/v1/completions", {"prompt": ["hi", over], "max_tokens": 1}, "prompt"),
                                      ("/v1/chat/completions", {"messages": halves, "max_tokens": 1}, "messages")]:
                async with s.post(srv.url + path, json=body) as r:
                    err = (await r.json())["error"]
                    assert r.status == 400 and err["param"] == param and "--max-prompt-chars" in err["message"], err


def test_large_websocket_frames_do_not_hold_up_a_small_request(srv: ServerProcess) -> None:
    """Issue 34, item 8: a WebSocket frame took the small bodies' tokenizer lane whatever its size (1 MB prompts
    held another client's 2-token completion for seconds, as HTTP bodies did before they got a lane of their own).
    Now a frame goes by its size, like a body. The prompts are too long for the context: each gets an error frame
    once tokenized."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 .,"
    text = "".join(alphabet[(i * 7919) % len(alphabet)] for i in range(1_000_000))
    url = srv.url.replace("http", "ws") + "/v1/ws"

    async def run() -> None:
        async with _session() as s, s.ws_connect(url, max_msg_size=0) as ws:
            for i in range(6):
                await ws.send_json({"type": "generate", "id": i, "prompt": text, "max_tokens": 1})
            await asyncio.sleep(0.5)                              # the frames are in, the tokenizing has begun
            t = time.monotonic()
            async with s.post(f"{srv.url}/v1/completions", json={"prompt": "a neighbour", "max_tokens": 2}) as r:
                status = r.status
            took = time.monotonic() - t
            frames = [await ws.receive_json(timeout=120) for _ in range(6)]
            assert status == 200 and took < 3, took
            assert sorted(f["id"] for f in frames) == list(range(6))
            assert {(f["type"], f["error"]["param"]) for f in frames} == {("error", "prompt")}, frames
    attack(srv, lambda: asyncio.run(run()))


def _health_stall(srv: ServerProcess, during: Callable[[], None]) -> float:
    """The longest /health took while `during` ran (polled back to back from another thread)."""
    import threading
    worst, done = [0.0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            assert http("GET", f"{srv.url}/health", timeout=60)[0] == 200
            worst[0] = max(worst[0], time.monotonic() - t0)
            time.sleep(0.01)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        during()
    finally:
        done.set()
        poller.join()
    return worst[0]


def test_echo_logprobs_are_capped_and_formatted_off_the_loop(srv: ServerProcess) -> None:
    """Issue 24, item 12: echo + logprobs returned prompt tokens x alternatives without a cap (one 2 MB body:
    ~1.7 GiB held, the event loop stalled 17 s formatting them). Past --max-echo-logprobs (prompt tokens x n x
    (logprobs + 1), 600,000 here) a 400 names the field; a legal one (302,400 entries: formatted on the loop, and
    with the collector walking every object loading left, it stalled /health for 0.5 s) leaves /health answering."""
    prompt = [(7 * i) % 300 + 3 for i in range(240)]

    def run() -> None:
        status, err = http("POST", f"{srv.url}/v1/completions", {"prompt": [prompt] * 128, "echo": True,
                                                                  "logprobs": 20, "max_tokens": 0})
        assert status == 400 and err["error"]["param"] == "logprobs", err
        assert "max-echo-logprobs" in err["error"]["message"] and "645120" in err["error"]["message"]

        answer: list[requests.Response] = []         # parsed once the polling stopped (the client's own GIL)
        body = {"prompt": [prompt] * 60, "echo": True, "logprobs": 20, "max_tokens": 0}
        stall = _health_stall(srv, lambda: answer.append(requests.post(f"{srv.url}/v1/completions", json=body,
                                                                        timeout=300)))
        assert answer[0].status_code == 200, answer[0].text[:300]
        out = answer[0].json()
        assert len(out["choices"]) == 60 and len(out["choices"][59]["logprobs"]["tokens"]) == 240
        assert stall < 0.25, stall
    attack(srv, run)


def test_beam_width_over_max_num_seqs(srv: ServerProcess) -> None:
    """Issue 24, item 18: one HTTP request with more beams than --max-num-seqs (32 here) livelocked the engine for
    everyone. best_of, n and beam widths over it get a 400 naming the field; one at the cap completes."""
    def run() -> None:
        for body, param in (({"best_of": 33, "use_beam_search": True, "temperature": 0}, "best_of"),
                            ({"n": 33}, "n"), ({"n": 2, "best_of": 40}, "best_of")):
            status, err = http("POST", f"{srv.url}/v1/completions", {"prompt": "wide", "max_tokens": 4, **body})
            assert status == 400 and err["error"]["param"] == param and "max_num_seqs" in err["error"]["message"], err
        status, out = http("POST", f"{srv.url}/v1/completions", {"prompt": "wide", "max_tokens": 4, "best_of": 32,
                                                                  "use_beam_search": True, "temperature": 0})
        assert status == 200 and out["choices"][0]["finish_reason"] in ("length", "stop"), out
    attack(srv, run)


def test_a_user_key_reads_no_admin_only_prefix(tiny_llama_dir: Path) -> None:
    """Issue 24, item 4: a user key read an admin-only prefix source five ways (render then /detokenize, echo,
    return_token_ids, prompt logprobs with max_tokens 0, and the block hashes with the fingerprint as an
    offline oracle). Every one of them, as the attack scripts sent them, shows no word of it now.
    (tests/service/middleware/test_auth.py checks each path's tokens one by one.)"""
    secret = "The vault code is pomegranate-tangerine-nectarine. Never tell it to anyone at all. " * 2
    words = ("pomegranate", "tangerine", "nectarine", "code is")
    args = ["--model", str(tiny_llama_dir), "--max-model-len", "256", "--num-kv-blocks", "96", "--block-size", "8",
            "--api-key", "u1", "--admin-key", "a1"]
    user, admin = {"Authorization": "Bearer u1"}, {"Authorization": "Bearer a1"}
    with ServerProcess(args).start() as s:
        assert http("POST", f"{s.url}/v1/prefixes", {"name": "vault", "prompt": secret}, headers=admin)[0] == 201
        answers = []
        for path, body in (("/v1/completions/render", {"prompt": " hi", "prefix": "vault"}),
                           ("/v1/completions", {"prompt": " hi", "prefix": "vault", "echo": True, "max_tokens": 1}),
                           ("/v1/completions", {"prompt": " hi", "prefix": "vault", "return_token_ids": True,
                                                "max_tokens": 1}),
                           ("/v1/completions", {"prompt": " hi", "prefix": "vault", "echo": True, "logprobs": 5,
                                                "max_tokens": 0})):
            status, out = http("POST", s.url + path, body, headers=user)
            assert status == 200, (path, out)
            answers.append(out)
        ids = [t for t in answers[0][0]["token_ids"] + answers[2]["prompt_token_ids"][0]]
        answers.append(http("POST", f"{s.url}/detokenize", {"tokens": ids}, headers=user)[1])
        answers += [http("GET", f"{s.url}{p}", headers=user)[1] for p in ("/v1/prefixes", "/v1/prefixes/vault")]
        seen = json.dumps(answers)
        assert not any(w in seen for w in words), seen[:2000]
        listing = answers[-2]["data"][0]
        assert "block_hashes" not in listing and listing["fingerprint"] is None and listing["num_tokens"] > 16
        status, out = http("POST", f"{s.url}/v1/completions", {"prompt": " hi", "prefix": "vault", "echo": True,
                                                                "max_tokens": 1}, headers=admin)
        assert status == 200 and "pomegranate" in out["choices"][0]["text"]      # the admin reads it whole


def test_zero_completion_tokens_everywhere(srv: ServerProcess) -> None:
    """Issue 24, item 20 (f): chat `max_completion_tokens: 0` slipped past the check `max_tokens` had. Already
    refused since the one-pipeline change (49753e2); kept here against a regression, on every surface."""
    async def run() -> None:
        m = [{"role": "user", "content": "hi"}]
        cases = [("/v1/chat/completions", {"messages": m, "max_completion_tokens": 0}, "max_completion_tokens"),
                 ("/v1/chat/completions", {"messages": m, "max_tokens": 5, "max_completion_tokens": 0},
                  "max_completion_tokens"),
                 ("/v1/chat/completions", {"messages": m, "max_completion_tokens": 0, "stream": True},
                  "max_completion_tokens"),
                 ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens")]
        async with _session() as s:
            for path, body, param in cases:
                async with s.post(srv.url + path, json=body) as r:
                    err = await r.json()
                    assert r.status == 400 and err["error"]["param"] == param, (path, body, err)
            async with s.ws_connect(srv.url.replace("http", "ws") + "/v1/ws") as ws:
                await ws.send_json({"type": "generate", "id": 1, "messages": m, "max_completion_tokens": 0})
                frame = await ws.receive_json(timeout=30)
                assert frame["type"] == "error" and frame["error"]["param"] == "max_completion_tokens", frame
    attack(srv, lambda: asyncio.run(run()))
