"""Replicas on one real Redis: the registry is shared, pinned sets stay equal, restarts come back warm,
and Redis going down never stops generation."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefix_store import PrefixRecord
from prefix_store.redis import connect
from tests.helpers.redis_server import RedisServer
from tests.helpers.server import ServerProcess, http

PROMPT = "Shared system prompt: you answer questions about paged attention and KV caches. " * 3


def replica_args(model: Path, redis_url: str) -> list[str]:
    return ["--model", str(model), "--max-model-len", "512", "--num-kv-blocks", "128", "--redis-url", redis_url]


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def listed(srv: ServerProcess, name: str) -> dict | None:
    """The prefix as the listing shows it, as GET /v1/prefixes/{name} does when it is loaded (block hashes
    and sources are not in listings)."""
    status, body = http("GET", f"{srv.url}/v1/prefixes", timeout=10)
    assert status == 200, body
    entry = next((p for p in body["data"] if p["name"] == name), None)
    if entry is None or not entry["loaded"]:
        return entry                     # another model's: GET names this model's prefixes only
    status, one = http("GET", f"{srv.url}/v1/prefixes/{name}", timeout=10)
    assert status == 200, one
    return one


def cached(srv: ServerProcess, prompt: str = "?", prefix: str | None = None, model: str = "llama") -> int:
    body: dict = {"model": model, "prompt": prompt, "max_tokens": 1}
    if prefix:
        body["prefix"] = prefix
    status, out = http("POST", f"{srv.url}/v1/completions", body)
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True) as r:
        yield r


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path, redis: RedisServer) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    a = ServerProcess(replica_args(tiny_llama_dir, redis.url)).start(wait_ready=False)
    b = ServerProcess(replica_args(tiny_llama_dir, redis.url)).start(wait_ready=False)
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_register_on_a_use_on_b_delete_on_b(replicas: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = replicas
    status, rec = http("POST", f"{a.url}/v1/prefixes", {"name": "shared", "prompt": PROMPT})
    assert status == 201, rec
    wait_for(lambda: (listed(b, "shared") or {}).get("loaded") is True, what="B to pin the prefix")
    assert cached(b, "first use on B", prefix="shared") == rec["num_pinned_blocks"] * 16
    assert b.metric("prefixserve_kv_blocks_pinned") == rec["num_pinned_blocks"]
    assert http("DELETE", f"{b.url}/v1/prefixes/shared")[0] == 200
    wait_for(lambda: a.metric("prefixserve_kv_blocks_pinned") == 0, what="A to unpin")
    assert listed(a, "shared") is None


def test_concurrent_registrations_of_one_name_end_with_one_record(
        replicas: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = replicas
    bodies = [(a, {"name": "race", "prompt": PROMPT + " version A"}), (b, {"name": "race", "prompt": PROMPT + " B"})]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda sb: http("POST", f"{sb[0].url}/v1/prefixes", sb[1]), bodies))
    assert sorted(s for s, _ in results) == [201, 409], results
    winner = next(body for s, body in results if s == 201)
    for srv in (a, b):
        wait_for(lambda srv=srv: (listed(srv, "race") or {}).get("num_tokens") == winner["num_tokens"]
                 and listed(srv, "race")["loaded"], what="both replicas to hold the winner")
    assert a.metric("prefixserve_kv_blocks_pinned") == b.metric("prefixserve_kv_blocks_pinned")
    assert http("DELETE", f"{a.url}/v1/prefixes/race")[0] == 200


def test_records_of_another_model_are_listed_not_loaded(replicas: tuple[ServerProcess, ServerProcess],
                                                        redis: RedisServer) -> None:
    a, _ = replicas

    async def put_foreign() -> None:
        store = await connect(redis.url)
        rec = PrefixRecord(name="foreign", fingerprint="0" * 32, token_ids=[1, 2, 3], source={"prompt": "x"})
        await store.put(rec, origin="test")
        await store.aclose()

    asyncio.run(put_foreign())
    entry = listed(a, "foreign")
    assert entry is not None and entry["loaded"] is False and entry["fingerprint"] == "0" * 32
    assert http("POST", f"{a.url}/v1/completions", {"prompt": "x", "prefix": "foreign", "max_tokens": 1})[0] == 404


def test_redis_down_mid_run_then_back(replicas: tuple[ServerProcess, ServerProcess], redis: RedisServer) -> None:
    a, b = replicas
    req = urllib.request.Request(f"{a.url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "stream on", "max_tokens": 60, "ignore_eos": True,
                                                  "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        first = resp.readline()
        redis.stop()                                                    # Redis dies mid-stream
        rest = resp.read().decode()
    assert first.startswith(b"data: ") and rest.rstrip().endswith("data: [DONE]")
    assert rest.count('"finish_reason":"length"') + rest.count('"finish_reason": "length"') == 1
    status, err = http("POST", f"{a.url}/v1/prefixes", {"name": "while-down", "prompt": PROMPT}, timeout=30)
    assert status == 503 and err["error"]["code"] == "prefix_store_unavailable"
    assert http("GET", f"{a.url}/v1/prefixes")[0] == 200             # reads answer from the local view
    assert cached(a, "generation goes on") >= 0

    redis.start()                                                       # back: B registers, A resyncs
    wait_for(lambda: http("POST", f"{b.url}/v1/prefixes", {"name": "after", "prompt": PROMPT + " after"},
                          timeout=10)[0] in (200, 201), timeout=30, what="B to write again")
    wait_for(lambda: (listed(a, "after") or {}).get("loaded") is True, timeout=30, what="A to resync")
    assert http("DELETE", f"{a.url}/v1/prefixes/after")[0] == 200


def test_restart_comes_back_warm(tiny_llama_dir: Path, redis: RedisServer) -> None:
    first = ServerProcess(replica_args(tiny_llama_dir, redis.url)).start()
    try:
        status, rec = http("POST", f"{first.url}/v1/prefixes", {"name": "durable", "prompt": PROMPT + " durable"})
        assert status == 201, rec
    finally:
        first.stop()
    second = ServerProcess(replica_args(tiny_llama_dir, redis.url)).start()    # ready == warm
    try:
        assert second.metric("prefixserve_kv_blocks_pinned") == rec["num_pinned_blocks"]
        entry = listed(second, "durable")
        assert entry is not None and entry["loaded"] and entry["block_hashes"] == rec["block_hashes"]
        assert cached(second, "first use after restart", prefix="durable") == rec["num_pinned_blocks"] * 16
        assert http("DELETE", f"{second.url}/v1/prefixes/durable")[0] == 200
    finally:
        second.stop()


def test_replicas_heartbeat_with_ttl(replicas: tuple[ServerProcess, ServerProcess], redis: RedisServer) -> None:
    a, b = replicas
    assert http("POST", f"{a.url}/v1/prefixes", {"name": "beat", "prompt": PROMPT + " beat"})[0] == 201

    async def replicas_seen() -> list:
        store = await connect(redis.url)
        try:
            return await store.replicas(None)
        finally:
            await store.aclose()

    def both_pin_beat() -> bool:
        infos = asyncio.run(replicas_seen())
        mine = [r for r in infos if r.address.endswith((f":{a.port}", f":{b.port}"))]
        return len(mine) == 2 and all("beat" in r.pinned and "running" in r.load for r in mine)

    wait_for(both_pin_beat, timeout=30, what="both replicas' heartbeats to list the prefix")
    import redis as redis_py
    client = redis_py.Redis.from_url(redis.url)
    ttls = [client.pttl(k) for k in client.keys("prefixserve:replica:*")]
    client.close()
    assert ttls and all(0 < t <= 10_000 for t in ttls)                  # liveness keys expire
    assert http("DELETE", f"{a.url}/v1/prefixes/beat")[0] == 200


def pinned_matches_registry(srv: ServerProcess) -> bool:
    status, body = http("GET", f"{srv.url}/v1/prefixes", timeout=10)
    assert status == 200, body
    return srv.metric("prefixserve_kv_blocks_pinned") == sum(p["num_pinned_blocks"] for p in body["data"]
                                                             if p["loaded"])


def test_reregistering_after_redis_came_back_empty_repins(replicas: tuple[ServerProcess, ServerProcess],
                                                          redis: RedisServer) -> None:
    """The local view still holds content A when Redis restarts empty; registering the name with content
    B unpins A and pins B (it used to keep A pinned forever and never pin B)."""
    a, b = replicas
    assert http("POST", f"{a.url}/v1/prefixes", {"name": "again", "prompt": PROMPT + " A"})[0] == 201
    wait_for(lambda: (listed(b, "again") or {}).get("loaded") is True, what="B to pin A")
    import redis as redis_py
    client = redis_py.Redis.from_url(redis.url)
    client.flushall()                                   # the store comes back empty
    client.close()
    status, rec = http("POST", f"{a.url}/v1/prefixes", {"name": "again", "prompt": PROMPT + " and B, longer"})
    assert status == 201, rec
    for srv in (a, b):
        wait_for(lambda srv=srv: (listed(srv, "again") or {}).get("num_tokens") == rec["num_tokens"],
                 what="both replicas to hold B")
        wait_for(lambda srv=srv: pinned_matches_registry(srv), what="pins to equal the registry")
    assert http("DELETE", f"{b.url}/v1/prefixes/again")[0] == 200
    for srv in (a, b):
        wait_for(lambda srv=srv: srv.metric("prefixserve_kv_blocks_pinned") == 0, what="everything unpinned")


def test_delete_racing_a_new_registration_leaves_no_orphans(replicas: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = replicas
    for i in range(12):
        assert http("POST", f"{a.url}/v1/prefixes", {"name": "flip", "prompt": PROMPT + f" v{i}"})[0] in (200, 201)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            deleted = pool.submit(http, "DELETE", f"{a.url}/v1/prefixes/flip")
            created = pool.submit(http, "POST", f"{b.url}/v1/prefixes", {"name": "flip", "prompt": PROMPT + f" w{i}"})
            assert deleted.result()[0] in (200, 404) and created.result()[0] in (200, 201, 409)
        for srv in (a, b):
            wait_for(lambda srv=srv: pinned_matches_registry(srv), what=f"round {i}: pins to equal the registry")
        http("DELETE", f"{a.url}/v1/prefixes/flip")
    for srv in (a, b):
        wait_for(lambda srv=srv: srv.metric("prefixserve_kv_blocks_pinned") == 0, what="everything unpinned")


def test_an_undecodable_record_is_skipped_and_never_blocks_warming(tiny_llama_dir: Path,
                                                                   redis: RedisServer) -> None:
    first = ServerProcess(replica_args(tiny_llama_dir, redis.url)).start()
    try:
        status, rec = http("POST", f"{first.url}/v1/prefixes", {"name": "good", "prompt": PROMPT + " good"})
        assert status == 201
        import redis as redis_py
        client = redis_py.Redis.from_url(redis.url)
        fp = rec["fingerprint"]
        client.set(f"prefixserve:prefix:{fp}:bad", b"\xc1 not msgpack")     # a foreign writer
        client.sadd(f"prefixserve:prefixes:{fp}", "bad")
        status, listing = http("GET", f"{first.url}/v1/prefixes")
        assert status == 200 and [p["name"] for p in listing["data"] if p["name"] in ("good", "bad")] == ["good"]
        assert http("GET", f"{first.url}/v1/prefixes/bad")[0] == 503
        assert http("POST", f"{first.url}/v1/prefixes", {"name": "bad", "prompt": PROMPT})[0] == 503
    finally:
        first.stop()
    second = ServerProcess(replica_args(tiny_llama_dir, redis.url)).start()    # ready, warm with "good"
    try:
        assert (listed(second, "good") or {}).get("loaded") is True
        assert http("DELETE", f"{second.url}/v1/prefixes/bad")[0] == 200
        assert http("DELETE", f"{second.url}/v1/prefixes/good")[0] == 200
        client.close()
    finally:
        second.stop()


def test_tenants_and_leases_across_replicas(tiny_llama_dir: Path, redis: RedisServer) -> None:
    """Two replicas with two tenant keys on one Redis: a tenant's prefix registered on one is its own on the
    other too (a miss for the other tenant, whose prompts are salted apart on both), and a lease ends on both."""
    keys = ["--api-key", "ta,tb", "--no-metrics-require-key"]
    a = ServerProcess(replica_args(tiny_llama_dir, redis.url) + keys).start(wait_ready=False)
    b = ServerProcess(replica_args(tiny_llama_dir, redis.url) + keys).start(wait_ready=False)

    def call(srv: ServerProcess, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body else None
        req = urllib.request.Request(f"{srv.url}{path}", method=method, data=data,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        a.wait_ready()
        b.wait_ready()
        base = b.metric("prefixserve_kv_blocks_pinned")
        status, rec = call(a, "POST", "/v1/prefixes", "ta", {"name": "lease", "prompt": PROMPT + " leased",
                                                             "ttl_seconds": 3, "published": False})
        assert status == 201 and rec["published"] is False, rec
        wait_for(lambda: b.metric("prefixserve_kv_blocks_pinned") == base + rec["num_pinned_blocks"], what="pin on b")
        body = {"model": "llama", "prompt": " Hi?", "max_tokens": 1, "prefix": "lease"}
        status, out = call(b, "POST", "/v1/completions", "ta", body)
        assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert call(b, "POST", "/v1/completions", "tb", body)[0] == 404
        unnamed = {"model": "llama", "prompt": PROMPT + " leased Hi?", "max_tokens": 1}
        other = call(b, "POST", "/v1/completions", "tb", unnamed)[1]
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the lease ends on both replicas: unpinned, and gone from the store
        wait_for(lambda: a.metric("prefixserve_kv_blocks_pinned") == base
                 and b.metric("prefixserve_kv_blocks_pinned") == base, timeout=20, what="the lease to end")
        assert call(a, "GET", "/v1/prefixes/lease", "ta")[0] == call(b, "GET", "/v1/prefixes/lease", "ta")[0] == 404
    finally:
        a.stop()
        b.stop()
