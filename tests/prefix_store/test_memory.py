"""MemoryPrefixStore specifics; the shared contract lives in test_store_contract.py."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from prefix_store import MemoryPrefixStore, PrefixStore, ReplicaInfo, StoreUnavailable

FP = "a1" * 16


async def test_separate_instances_share_nothing(make_record: Any) -> None:
    one, two = MemoryPrefixStore(), MemoryPrefixStore()
    async with contextlib.aclosing(two.events()) as events:
        assert (await anext(events)).kind == "resync"
        await one.put(make_record("sys"), origin="r1")
        assert await two.get(FP, "sys") is None
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(events), 0.05)


async def test_closed_store_is_unavailable(make_record: Any) -> None:
    store: PrefixStore = MemoryPrefixStore()
    await store.aclose()
    assert await store.ping() is False
    calls = [
        store.put(make_record("sys"), origin="r"),
        store.get(FP, "sys"),
        store.list(),
        store.delete(FP, "sys", origin="r"),
        store.heartbeat(ReplicaInfo("r", "h:1"), ttl_s=1),
        store.replicas(),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable):
            await call
    assert [e async for e in store.events()] == []


async def test_every_subscriber_gets_every_event_and_leaving_unsubscribes(make_record: Any) -> None:
    store = MemoryPrefixStore()
    first, second = store.events(), store.events()
    assert (await anext(first)).kind == (await anext(second)).kind == "resync"
    await store.put(make_record("a"), origin="r")
    await store.put(make_record("b"), origin="r")
    assert [(await anext(first)).name for _ in range(2)] == ["a", "b"]
    await first.aclose()
    assert [(await anext(second)).name for _ in range(2)] == ["a", "b"]
    assert len(store._subscribers) == 1  # the closed iterator left
    await second.aclose()
    assert not store._subscribers
