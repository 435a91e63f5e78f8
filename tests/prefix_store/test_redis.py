"""RedisPrefixStore specifics against a real redis-server: outages, restarts, keys and bytes on the wire."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from prefix_store import PrefixEvent, PrefixRecord, RedisPrefixStore, ReplicaInfo, StoreUnavailable
from prefix_store.redis import connect
from tests.helpers.redis_server import RedisServer, free_port

FP = "a1" * 16
OTHER_FP = "b2" * 16


async def next_event(events: AsyncIterator[PrefixEvent], timeout_s: float = 5.0) -> PrefixEvent:
    return await asyncio.wait_for(anext(events), timeout_s)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisPrefixStore]:
    s = await connect(redis_server.url)
    yield s
    await s.aclose()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_keys_and_values_on_the_wire(store: RedisPrefixStore, raw: aioredis.Redis, make_record: Any) -> None:
    rec = make_record("sys", [5, 6, 7], source={"messages": [{"role": "system", "content": "hé"}]})
    await store.put(rec, origin="ra")
    await store.put(make_record("other", [1]), origin="ra")
    value = await raw.get(f"prefixserve:prefix:{FP}:sys")
    assert msgpack.unpackb(value) == rec.to_dict()
    assert await raw.smembers(f"prefixserve:prefixes:{FP}") == {b"sys", b"other"}
    assert await raw.smembers("prefixserve:fingerprints") == {FP.encode()}

    # The fingerprint leaves the set only with its last name.
    await store.delete(FP, "sys", origin="ra")
    assert await raw.smembers("prefixserve:fingerprints") == {FP.encode()}
    await store.delete(FP, "other", origin="ra")
    assert await raw.smembers("prefixserve:fingerprints") == set()
    assert await raw.keys("prefixserve:prefix*") == []

    await store.heartbeat(ReplicaInfo("r1", "h:1", fingerprint=FP), ttl_s=5)
    assert 0 < await raw.pttl("prefixserve:replica:r1") <= 5000
    assert msgpack.unpackb(await raw.get("prefixserve:replica:r1"))["address"] == "h:1"


async def test_announcements_are_msgpack_on_the_channel(
    store: RedisPrefixStore, raw: aioredis.Redis, make_record: Any
) -> None:
    pubsub = raw.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("prefixserve:events")
    await store.put(make_record("sys"), origin="ra")
    message = None
    deadline = time.monotonic() + 5
    while message is None and time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=1.0)
    assert message is not None
    assert msgpack.unpackb(message["data"]) == {"kind": "registered", "fingerprint": FP, "name": "sys", "origin": "ra"}
    await pubsub.aclose()


async def test_malformed_announcements_are_skipped(store: RedisPrefixStore, raw: aioredis.Redis) -> None:
    async with contextlib.aclosing(store.events()) as events:
        assert (await next_event(events)).kind == "resync"
        await raw.publish("prefixserve:events", b"\xc1 not msgpack")
        forged_resync = {"kind": "resync", "fingerprint": "", "name": "", "origin": "x"}
        await raw.publish("prefixserve:events", msgpack.packb(forged_resync))
        await raw.publish("prefixserve:events", msgpack.packb([1, 2]))
        good = PrefixEvent("deleted", FP, "sys", "rb")
        await raw.publish("prefixserve:events", msgpack.packb(good.to_dict()))
        assert await next_event(events) == good


async def test_namespaces_are_separate_registries(redis_server: RedisServer, make_record: Any) -> None:
    blue = RedisPrefixStore(aioredis.Redis.from_url(redis_server.url), namespace="blue")
    green = RedisPrefixStore(aioredis.Redis.from_url(redis_server.url), namespace="green")
    await blue.put(make_record("sys", [1]), origin="r")
    await green.put(make_record("sys", [2]), origin="r")  # no conflict across namespaces
    await blue.heartbeat(ReplicaInfo("r1", "h:1"), ttl_s=5)
    assert [r.token_ids for r in await blue.list()] == [[1]]
    assert [r.token_ids for r in await green.list()] == [[2]]
    assert await green.replicas() == []
    await blue.aclose()
    await green.aclose()


async def test_replica_pattern_is_glob_escaped(redis_server: RedisServer) -> None:
    odd = RedisPrefixStore(aioredis.Redis.from_url(redis_server.url), namespace="ns[*]")
    plain = RedisPrefixStore(aioredis.Redis.from_url(redis_server.url), namespace="nsa")
    await plain.heartbeat(ReplicaInfo("r-plain", "h:1"), ttl_s=5)
    await odd.heartbeat(ReplicaInfo("r-odd", "h:2"), ttl_s=5)
    assert [r.replica_id for r in await odd.replicas()] == ["r-odd"]
    await odd.aclose()
    await plain.aclose()


async def test_store_unavailable_while_redis_is_down_then_recovers(
    redis_server: RedisServer, store: RedisPrefixStore, make_record: Any
) -> None:
    await store.put(make_record("sys"), origin="ra")
    redis_server.stop()
    started = time.monotonic()
    calls = [
        store.put(make_record("new"), origin="ra"),
        store.get(FP, "sys"),
        store.list(),
        store.list(FP),
        store.delete(FP, "sys", origin="ra"),
        store.heartbeat(ReplicaInfo("r", "h:1"), ttl_s=1),
        store.replicas(),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable, match="unavailable"):
            await call
    assert await store.ping() is False
    assert time.monotonic() - started < 3.0  # refused connections fail fast, no long retry loop

    redis_server.start()  # empty: appendonly is off
    assert await store.ping()
    assert (await store.put(make_record("sys"), origin="ra"))[1]
    assert [r.name for r in await store.list()] == ["sys"]


async def test_events_resync_after_redis_restarts(redis_server: RedisServer, make_record: Any) -> None:
    a, b = await connect(redis_server.url), await connect(redis_server.url)
    async with contextlib.aclosing(b.events()) as events:
        assert (await next_event(events)).kind == "resync"
        pending = asyncio.ensure_future(anext(events))  # a consumer waiting through the outage
        redis_server.stop()
        await asyncio.sleep(0.5)
        assert not pending.done()  # down: the stream waits, it does not raise or end
        redis_server.start()
        assert (await asyncio.wait_for(pending, 5.0)).kind == "resync"
        await a.put(make_record("sys"), origin="ra")
        assert await next_event(events) == PrefixEvent("registered", FP, "sys", "ra")
    await a.aclose()
    await b.aclose()


async def test_registry_survives_a_crash_with_appendonly(make_record: Any) -> None:
    with RedisServer(appendonly=True) as server:
        store = await connect(server.url)
        rec = make_record("sys", [3, 1, 4, 1, 5])
        await store.put(rec, origin="ra")
        server.stop()  # SIGKILL
        server.start()
        assert await store.list() == [rec]
        await store.aclose()


async def test_connect_fails_fast_when_redis_is_down() -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        await connect(url)
    assert time.monotonic() - started < 3.0
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


async def test_a_decoding_client_is_refused(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        RedisPrefixStore(client)
    await client.aclose()


def test_record_survives_msgpack(make_record: Any) -> None:
    rec = make_record("chat", [0, 2**31, 50_000], source={"messages": [{"role": "user", "content": "x" * 10}]})
    assert PrefixRecord.from_dict(msgpack.unpackb(msgpack.packb(rec.to_dict()))) == rec


async def test_events_resync_after_a_dropped_connection(
    store: RedisPrefixStore, raw: aioredis.Redis, make_record: Any
) -> None:
    async with contextlib.aclosing(store.events()) as events:
        assert (await next_event(events)).kind == "resync"
        pending = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)
        assert await raw.client_kill_filter(_type="pubsub") == 1  # Redis stays up; our socket dies
        # Whether redis-py resubscribes by itself or our loop does, the consumer is told to resync.
        assert (await asyncio.wait_for(pending, 5.0)).kind == "resync"
        await store.put(make_record("sys"), origin="ra")
        assert await next_event(events) == PrefixEvent("registered", FP, "sys", "ra")
