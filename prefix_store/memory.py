"""MemoryPrefixStore: the embedded registry for a single process, nothing to start.

Atomicity comes from the event loop: no method awaits between reading and writing its state, so
concurrent coroutines see each put or delete whole. Records are deep-copied in and out.
"""
from __future__ import annotations

import asyncio
import builtins
import copy
import time
from collections.abc import AsyncGenerator

from prefix_store.base import PrefixEvent, PrefixRecord, ReplicaInfo
from prefix_store.errors import PrefixConflict, StoreUnavailable


class MemoryPrefixStore:
    """`PrefixStore` held in this process; announcements go to this process's `events()` iterators."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, str], PrefixRecord] = {}            # (fingerprint, key) -> record
        self._replicas: dict[str, tuple[float, ReplicaInfo]] = {}          # id -> (monotonic deadline, info)
        # One unbounded queue per live `events()` iterator; None ends it. Announcements are rare
        # (registrations), so a slow consumer cannot grow a queue by much.
        self._subscribers: set[asyncio.Queue[PrefixEvent | None]] = set()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("the in-memory prefix store is closed")

    def _announce(self, event: PrefixEvent) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)

    async def put(self, record: PrefixRecord, origin: str) -> tuple[PrefixRecord, bool]:
        self._check_open()
        key = (record.fingerprint, record.key)
        existing = self._live(key)
        if existing is not None:
            if existing.same_content(record):
                return copy.deepcopy(existing), False
            raise PrefixConflict(copy.deepcopy(existing))
        self._records[key] = copy.deepcopy(record)
        self._announce(PrefixEvent("registered", record.fingerprint, record.key, origin))
        return copy.deepcopy(record), True

    def _live(self, key: tuple[str, str]) -> PrefixRecord | None:
        """The record at `key`; one whose lease has ended is dropped here (what Redis' key expiry does)."""
        record = self._records.get(key)
        if record is not None and record.expired(time.time()):
            del self._records[key]
            return None
        return record

    async def update(self, record: PrefixRecord, origin: str) -> bool:
        self._check_open()
        key = (record.fingerprint, record.key)
        if self._live(key) is None:
            return False
        self._records[key] = copy.deepcopy(record)
        self._announce(PrefixEvent("registered", record.fingerprint, record.key, origin))
        return True

    async def get(self, fingerprint: str, name: str) -> PrefixRecord | None:
        self._check_open()
        record = self._live((fingerprint, name))
        return copy.deepcopy(record) if record is not None else None

    async def list(self, fingerprint: str | None = None) -> builtins.list[PrefixRecord]:
        self._check_open()
        keys = sorted(k for k in list(self._records) if (fingerprint is None or k[0] == fingerprint)
                      and self._live(k) is not None)
        return [copy.deepcopy(self._records[k]) for k in keys]

    async def delete(self, fingerprint: str, name: str, origin: str) -> bool:
        self._check_open()
        if self._live((fingerprint, name)) is None:
            return False
        del self._records[(fingerprint, name)]
        self._announce(PrefixEvent("deleted", fingerprint, name, origin))
        return True

    async def heartbeat(self, info: ReplicaInfo, ttl_s: float) -> None:
        self._check_open()
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        stamped = copy.deepcopy(info)
        stamped.updated_at = time.time()
        self._replicas[info.replica_id] = (time.monotonic() + ttl_s, stamped)

    async def replicas(self, fingerprint: str | None = None) -> builtins.list[ReplicaInfo]:
        self._check_open()
        now = time.monotonic()
        for replica_id in [r for r, (deadline, _) in self._replicas.items() if deadline <= now]:
            del self._replicas[replica_id]
        infos = [info for _, info in self._replicas.values() if fingerprint is None or info.fingerprint == fingerprint]
        return [copy.deepcopy(info) for info in sorted(infos, key=lambda i: i.replica_id)]

    async def events(self) -> AsyncGenerator[PrefixEvent, None]:
        if self._closed:
            return
        queue: asyncio.Queue[PrefixEvent | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield PrefixEvent.resync()
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._subscribers.discard(queue)

    async def ping(self) -> bool:
        return not self._closed

    async def aclose(self) -> None:
        self._closed = True
        for queue in self._subscribers:
            queue.put_nowait(None)
