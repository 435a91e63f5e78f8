"""The reliability suite: what a hostile or careless client does, against a real server process and a
real redis-server on loopback, bounded in count and time. After every attack the same invariants hold:
no 5xx but the documented ones, the engine idle, every used KV block pinned (nothing leaked), the pinned
total equal to what the registry accounts for, and the server still answering."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import redis as redis_py
import requests

from tests.helpers.redis_server import RedisServer
from tests.helpers.server import ServerProcess, http

SYSTEM = "You are the reliability suite's system prompt; answer in one short line about caches. " * 3
ALLOWED_5XX = {"503", "507"}      # store down / draining; pin cap or registry full: the API's contract


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path, redis: RedisServer) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_llama_dir), "--max-model-len", "256", "--num-kv-blocks", "96", "--block-size", "8",
            "--redis-url", redis.url, "--keepalive-timeout", "1", "--body-timeout", "1", "--max-num-seqs", "32",
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
                assert r.status in (200, 201, 404, 409), r.status
        for name in ("leave-0", "leave-1", "churn"):
            http("DELETE", f"{srv.url}/v1/prefixes/{name}")
    attack(srv, lambda: asyncio.run(run()))


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
        assert listing["block_hashes"] is None and listing["fingerprint"] is None and listing["num_tokens"] > 16
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
