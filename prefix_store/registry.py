"""PrefixRegistry: named prefixes, pinned in this replica's KV cache, their metadata in a PrefixStore.

Pin then record: a registration pins the prefix's blocks through the engine first and writes the
record only once they are pinned (a failed write unpins), so the store never names a prefix no replica
could pin; a caller that goes away does not cut the two apart (the work is shielded).

The store (Redis, or the embedded one) is the source of truth; every replica keeps a local view of the
records for its model fingerprint and pins exactly those. Announcements on the store's channel and a
full resync (at start, and whenever the channel reconnects) keep the pinned set equal on every replica.

Redis is never on the per-token path: requests resolve names in the local view. With the store down,
reads answer from the local view and writes answer 503; when it comes back, the replica resyncs.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from prefix_store.base import PrefixRecord, PrefixStore, ReplicaInfo
from prefix_store.errors import InvalidPrefix, PrefixConflict, PrefixNotFound, RegistryFull, StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_TIMEOUT_S = 5.0       # what close() waits for in-flight operations and the background tasks


def _log_orphan(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a registry operation whose caller left ended with: %s", task.exception())


class Pinned(Protocol):
    @property
    def num_pinned_blocks(self) -> int: ...

    @property
    def block_hashes(self) -> list[str]: ...


class Load(Protocol):
    @property
    def requests_running(self) -> int: ...

    @property
    def requests_waiting(self) -> int: ...


class Pinner(Protocol):
    """What the registry needs of the engine (the AsyncEngine is one): pins, and what it serves."""

    fingerprint: str
    tokenizer_version: str
    block_size: int
    max_model_len: int
    model_name: str

    async def pin_prefix(self, token_ids: list[int]) -> Pinned: ...

    async def unpin_prefix(self, token_ids: list[int]) -> int: ...

    def stats(self) -> Load: ...


@dataclass(frozen=True)
class PrefixSnapshot:
    """What a request needs of a registered prefix, copied out of the local view (on the event loop) for
    the tokenizer thread: immutable, so the registry may change meanwhile."""

    name: str
    token_ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...] | None      # its source, when it was registered with messages


@dataclass
class LocalPrefix:
    record: PrefixRecord
    pinned_blocks: int = 0
    hit_requests: int = 0
    tokens_saved: int = 0


class PrefixRegistry:
    def __init__(self, store: PrefixStore, engine: Pinner, address: str = "",
                 heartbeat_interval: float = 2.0, max_prefixes: int = 1024) -> None:
        self.store = store
        self.engine = engine
        self.fingerprint = engine.fingerprint
        self.replica_id = uuid.uuid4().hex[:12]
        self.address = address
        self.heartbeat_interval = heartbeat_interval
        self.max_prefixes = max_prefixes
        self.local: dict[str, LocalPrefix] = {}
        self.ready = asyncio.Event()                # set once the first resync has warmed every prefix
        self.store_ok = True
        self._lock = asyncio.Lock()                 # one registry mutation at a time (pins are not atomic)
        self._tasks: list[asyncio.Task] = []
        self._ops: set[asyncio.Task] = set()        # registrations and deletions in flight (shielded)
        self._closing = False

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow_events(), name="prefix-events"),
                       asyncio.create_task(self._heartbeat(), name="prefix-heartbeat")]
        # The events stream yields "resync" once subscribed; warm-up happens there. If the store is
        # down, the first resync fails fast and the replica is ready with what it has (nothing).

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops within about `timeout` seconds whatever is in flight: new operations are refused, those
        in flight and the background tasks are cancelled, the store is closed (which ends its events
        stream), then they get `timeout` seconds to unwind; a task still running after that is left
        behind with a warning.

        NOTE: the store is closed before the wait, not after it. A Redis client may swallow a
        cancellation (redis-py 8 returns the reply of a GET cancelled in flight), so a cancelled task
        can go on looping; the events stream and the heartbeat stop on their own once the store is
        closed and `_closing` is set, whatever became of the cancellation."""
        self._closing = True
        tasks = [*self._ops, *self._tasks]
        for t in tasks:
            t.cancel()
        try:
            await self.store.aclose()
        finally:
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=timeout)
                for t in pending:
                    log.warning("prefix registry: %s still running %.0f s after close; left behind", t.get_name(),
                                timeout)

    async def _follow_events(self) -> None:
        events = self.store.events()
        first = True
        try:
            async for ev in events:
                if self._closing:
                    break
                try:
                    if ev.kind == "resync":
                        await self.resync()
                    elif ev.fingerprint == self.fingerprint:
                        await self._apply(ev.kind, ev.name)
                except StoreUnavailable as exc:     # the next announcement or resync catches up
                    self.store_ok = False
                    log.warning("prefix event %s %r not applied: %s", ev.kind, ev.name, exc)
                except Exception:                   # never let one bad event stop following the store
                    log.exception("prefix event %s %r failed", ev.kind, ev.name)
                if first:
                    first = False
                    self.ready.set()
        finally:
            await events.aclose()

    async def _heartbeat(self) -> None:
        while not self._closing:
            if not self.ready.is_set() and not self.store_ok:
                self.ready.set()        # store down at start: serve without the registry's prefixes
            stats = self.engine.stats()
            info = ReplicaInfo(self.replica_id, self.address, sorted(self.local),
                               {"running": stats.requests_running, "waiting": stats.requests_waiting},
                               self.fingerprint)
            try:
                await self.store.heartbeat(info, ttl_s=self.heartbeat_interval * 5)
                self.store_ok = True
            except StoreUnavailable:
                self.store_ok = False
            await asyncio.sleep(self.heartbeat_interval)

    # -- keeping the pinned set equal to the store --------------------------------------------
    async def resync(self) -> None:
        try:
            records = await self.store.list(self.fingerprint)
        except StoreUnavailable as exc:
            log.warning("prefix resync skipped, store unavailable: %s", exc)
            self.store_ok = False
            return
        self.store_ok = True
        async with self._lock:
            wanted = {r.name: r for r in records}
            for name in [n for n in self.local if n not in wanted or
                         not wanted[n].same_content(self.local[n].record)]:
                await self._unpin_local(name)
            for name, record in wanted.items():
                if self._closing:
                    return
                if name not in self.local:
                    await self._pin_local(record)

    async def _apply(self, kind: str, name: str) -> None:
        async with self._lock:
            if kind == "deleted":
                await self._unpin_local(name)
                return
            try:
                record = await self.store.get(self.fingerprint, name)
            except StoreUnavailable:
                return
            entry = self.local.get(name)
            if record is None or entry is None or not entry.record.same_content(record):
                await self._unpin_local(name)           # gone, or replaced by other content
                if record is not None:
                    await self._pin_local(record)

    async def _pin_local(self, record: PrefixRecord) -> None:
        try:
            pinned = await self.engine.pin_prefix(record.token_ids)
        except asyncio.CancelledError:
            raise
        except Exception as exc:            # the engine's refusal (the pin cap): serve without it, say why
            log.error("cannot pin registered prefix %r here: %s", record.name, exc)
            return
        self.local[record.name] = LocalPrefix(record, pinned.num_pinned_blocks)

    async def _unpin_local(self, name: str) -> None:
        entry = self.local.pop(name, None)
        if entry is not None:
            await self.engine.unpin_prefix(entry.record.token_ids)

    # -- API operations -----------------------------------------------------------------------
    async def register(self, name: str, token_ids: list[int], source: dict[str, Any],
                       description: str | None) -> tuple[PrefixRecord, bool]:
        """Pins then records. Returns (record, created). Raises InvalidPrefix, PrefixConflict,
        StoreUnavailable or the engine's PinCapExceeded.

        The work runs as its own task: a caller that goes away (a cancelled HTTP handler) does not cut
        it between the pin and the record, so the pinned set and the store never disagree for it."""
        block_size = self.engine.block_size
        if len(token_ids) < block_size:
            raise InvalidPrefix(f"the prefix has {len(token_ids)} tokens, less than one KV block ({block_size}): it "
                                "would pin nothing; registered prefixes are for long shared prompts", param="prompt")
        if len(token_ids) >= self.engine.max_model_len:
            raise InvalidPrefix(f"the prefix has {len(token_ids)} tokens; the model's maximum context length is "
                                f"{self.engine.max_model_len}", param="prompt")
        return await self._shielded(self._register(name, list(token_ids), source, description))

    async def _register(self, name: str, token_ids: list[int], source: dict[str, Any],
                        description: str | None) -> tuple[PrefixRecord, bool]:
        async with self._lock:
            existing = await self.store.get(self.fingerprint, name)
            if existing is not None and existing.token_ids != token_ids:
                raise PrefixConflict(existing)
            if existing is None and name not in self.local and len(self.local) >= self.max_prefixes:
                raise RegistryFull(f"{len(self.local)} prefixes are registered, the most this server keeps "
                                   f"(--max-prefixes {self.max_prefixes}); delete one first", param="name")
            entry = self.local.get(name)
            stale = entry is not None and entry.record.token_ids != token_ids   # a view the store no longer has
            pinned = None
            if entry is None or stale:
                pinned = await self.engine.pin_prefix(token_ids)                 # the pins are ours from here
            record = PrefixRecord(name=name, fingerprint=self.fingerprint, token_ids=token_ids, source=source,
                                  block_hashes=pinned.block_hashes if pinned else entry.record.block_hashes,  # type: ignore[union-attr]
                                  tokenizer_version=self.engine.tokenizer_version, description=description,
                                  created_at=time.time())
            try:
                stored, created = await self.store.put(record, origin=self.replica_id)
            except BaseException:
                if pinned is not None:
                    await self.engine.unpin_prefix(token_ids)
                raise
            if pinned is not None:
                if stale:
                    await self._unpin_local(name)
                self.local[name] = LocalPrefix(stored, pinned.num_pinned_blocks)
            else:
                self.local[name].record = stored
            return stored, created

    async def delete(self, name: str) -> None:
        """Raises PrefixNotFound or StoreUnavailable."""
        await self._shielded(self._delete(name))

    async def _delete(self, name: str) -> None:
        async with self._lock:
            deleted = await self.store.delete(self.fingerprint, name, origin=self.replica_id)
            present = name in self.local
            await self._unpin_local(name)
        if not deleted and not present:
            raise PrefixNotFound(f"prefix {name!r} is not registered", param="name")

    async def _shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` to its end even if the caller is cancelled (its outcome is then only logged); only
        close() cancels it. Refused with StoreUnavailable once the registry is closing."""
        if self._closing:
            coro.close()
            raise StoreUnavailable("the server is shutting down")
        task = asyncio.create_task(coro)
        self._ops.add(task)
        task.add_done_callback(self._ops.discard)
        task.add_done_callback(_log_orphan)
        return await asyncio.shield(task)

    def snapshot(self, name: str) -> PrefixSnapshot:
        """The named prefix as a request uses it; PrefixNotFound if it is not pinned here. Names resolve in
        this replica's local view, never in the store: the store is not on the per-request path."""
        entry = self.local.get(name)
        if entry is None:
            raise PrefixNotFound(f"prefix {name!r} is not registered", param="prefix")
        messages = entry.record.source.get("messages")
        return PrefixSnapshot(name, tuple(entry.record.token_ids),
                              tuple(dict(m) for m in messages) if isinstance(messages, list) else None)

    def record_use(self, name: str, cached_tokens: int) -> tuple[int, int]:
        """Counts a request that named the prefix; returns (hit 0/1, tokens saved) for the metrics."""
        entry = self.local.get(name)
        if entry is None:
            return 0, 0
        saved = min(cached_tokens, len(entry.record.token_ids))
        hit = int(saved > 0)
        entry.hit_requests += hit
        entry.tokens_saved += saved
        return hit, saved

    def describe(self, entry: LocalPrefix | None, record: PrefixRecord, loaded: bool) -> dict[str, Any]:
        return {
            "name": record.name, "object": "prefix", "num_tokens": len(record.token_ids),
            "num_pinned_blocks": entry.pinned_blocks if entry else 0, "block_hashes": record.block_hashes,
            "model": self.engine.model_name, "fingerprint": record.fingerprint, "created_at": int(record.created_at),
            "description": record.description, "source": record.source, "loaded": loaded,
            # what it was registered from (not secret: the source itself is admin-only): chat can only name a
            # prefix registered with messages
            "kind": "messages" if record.source.get("messages") is not None else "prompt",
            "hit_requests": entry.hit_requests if entry else 0, "tokens_saved": entry.tokens_saved if entry else 0,
        }

    async def list(self) -> list[dict[str, Any]]:
        """Every record in the store (other models' listed as not loaded); the local view if it is down."""
        try:
            records = await self.store.list(None)
        except StoreUnavailable:
            records = [e.record for e in self.local.values()]
        out = []
        for r in records:
            mine = r.fingerprint == self.fingerprint
            entry = self.local.get(r.name) if mine else None
            out.append(self.describe(entry, r, loaded=entry is not None))
        return out

    async def get(self, name: str) -> dict[str, Any]:
        entry = self.local.get(name)
        record: PrefixRecord | None = entry.record if entry else None
        if record is None:     # not here: only the store can say (StoreUnavailable if it cannot)
            record = await self.store.get(self.fingerprint, name)
        if record is None:
            raise PrefixNotFound(f"prefix {name!r} is not registered", param="name")
        return self.describe(entry, record, loaded=entry is not None)
