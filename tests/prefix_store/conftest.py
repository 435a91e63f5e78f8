"""Fixtures: a real redis-server per test, and pairs of store clients for the shared contract tests."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from prefix_store import MemoryPrefixStore, PrefixRecord, PrefixStore
from prefix_store.redis import connect
from tests.helpers.redis_server import RedisServer

FP = "a1" * 16  # the model fingerprint records get by default; tests repeat it


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[tuple[PrefixStore, PrefixStore]]:
    """Two clients of one registry, as two replicas see it (memory: one process, one store)."""
    if request.param == "memory":
        store = MemoryPrefixStore()
        yield store, store
        await store.aclose()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    a, b = await connect(server.url), await connect(server.url)
    yield a, b
    await a.aclose()
    await b.aclose()


RecordFactory = Callable[..., PrefixRecord]


@pytest.fixture
def make_record() -> RecordFactory:
    def make(name: str = "sys", tokens: list[int] | None = None, fingerprint: str = FP, **kw: Any) -> PrefixRecord:
        tokens = [1, 2, 3, 4, 5] if tokens is None else tokens
        kw.setdefault("source", {"prompt": f"prompt of {name}"})
        kw.setdefault("block_hashes", [f"{t:064x}" for t in tokens[:1]])
        kw.setdefault("tokenizer_version", "tok-1")
        return PrefixRecord(name=name, fingerprint=fingerprint, token_ids=tokens, **kw)

    return make
