"""PrefixRegistry: named prefixes, pinned in this replica's KV cache, their metadata in a PrefixStore.

Pin then record: a registration pins the prefix's blocks through the engine first and writes the
record only once they are pinned (a failed write unpins), so the store never names a prefix no replica
could pin; a caller that goes away does not cut the two apart (the work is shielded).

The store (Redis, or the embedded one) is the source of truth; every replica keeps a local view of the
records for its model fingerprint and pins exactly those. Announcements on the store's channel and a
full resync (at start, and whenever the channel reconnects) keep the pinned set equal on every replica.

Redis is never on the per-token path: requests resolve names in the local view. With the store down,
reads answer from the local view and writes answer 503; when it comes back, the replica resyncs.

Tenants: a prefix a tenant registers is its own (`owner`; its key `<owner>/<name>`), one an admin
publishes is everyone's (key: its name). Which record a name means to a caller, and what of it the caller
may read, is prefix_store/access.py's one rule; every method here that takes a name or returns a record
goes through it (another tenant's prefix is PrefixNotFound, exactly as a name nobody registered). Leases
(prefixes with a `ttl_seconds`, and `prompt_cache_key`s) are prefix_store/leases.py's.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from prefix_store.access import Reader, hidden_tokens, keys_for
from prefix_store.base import PrefixKind, PrefixRecord, PrefixStore, ReplicaInfo, Salt
from prefix_store.errors import (
    InvalidPrefix,
    PrefixConflict,
    PrefixForbidden,
    PrefixNotFound,
    RegistryFull,
    StoreUnavailable,
)
from prefix_store.leases import Leases
from prefix_store.local import LocalPrefix, Pinner, PrefixSnapshot, salt_of, tenant_of

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_TIMEOUT_S = 5.0       # what close() waits for in-flight operations and the background tasks


def _log_orphan(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a registry operation whose caller left ended with: %s", task.exception())


class PrefixRegistry:
    def __init__(self, store: PrefixStore, engine: Pinner, address: str = "",
                 heartbeat_interval: float = 2.0, max_prefixes: int = 1024,
                 max_prefixes_per_tenant: int | None = None, lease_sweep_interval: float = 1.0) -> None:
        self.store = store
        self.engine = engine
        self.fingerprint = engine.fingerprint
        self.replica_id = uuid.uuid4().hex[:12]
        self.address = address
        self.heartbeat_interval = heartbeat_interval
        self.max_prefixes = max_prefixes
        self.max_prefixes_per_tenant = max_prefixes_per_tenant
        self.leases = Leases(self, lease_sweep_interval)
        self.local: dict[str, LocalPrefix] = {}     # by PrefixRecord.key
        self.ready = asyncio.Event()                # set once the first resync has warmed every prefix
        self.store_ok = True
        self.lock = asyncio.Lock()                 # one registry mutation at a time (pins are not atomic)
        self._tasks: list[asyncio.Task] = []
        self._ops: set[asyncio.Task] = set()        # registrations and deletions in flight (shielded)
        self._closing = False

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow_events(), name="prefix-events"),
                       asyncio.create_task(self._heartbeat(), name="prefix-heartbeat"),
                       asyncio.create_task(self.leases.sweep(), name="prefix-leases")]
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
        tasks = [*self._ops, *self._tasks, *self.leases.spawned]
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
        async with self.lock:
            wanted = {r.key: r for r in records}
            now = time.time()
            for name in [n for n in self.local if n not in wanted or
                         not wanted[n].same_content(self.local[n].record)]:
                # gone from the store while its lease still ran: deleted (its blocks leave the KV tier too)
                await self.unpin_local(name, forget=name not in wanted and not self.local[name].record.expired(now))
            for name, record in wanted.items():
                if self._closing:
                    return
                if name not in self.local:
                    await self._pin_local(record)

    async def _apply(self, kind: str, name: str) -> None:
        async with self.lock:
            if kind == "deleted":
                # deleted by its owner (forgotten: its blocks leave the KV tier too), or its lease ended (kept)
                entry = self.local.get(name)
                await self.unpin_local(name, forget=entry is not None and not entry.record.expired(time.time()))
                return
            try:
                record = await self.store.get(self.fingerprint, name)
            except StoreUnavailable:
                return
            entry = self.local.get(name)
            if record is None or entry is None or not entry.record.same_content(record):
                await self.unpin_local(name)           # gone, or replaced by other content
                if record is not None:
                    await self._pin_local(record)
            else:
                entry.record = record                   # same blocks, new metadata (a lease moved)

    async def _pin_local(self, record: PrefixRecord) -> None:
        try:
            pinned = await self.engine.pin_prefix(record.token_ids, salt_of(record), tenant_of(record))
        except asyncio.CancelledError:
            raise
        except Exception as exc:            # the engine's refusal (the pin cap): serve without it, say why
            log.error("cannot pin registered prefix %r here: %s", record.name, exc)
            return
        self.local[record.key] = LocalPrefix(record, pinned.num_pinned_blocks)

    async def unpin_local(self, key: str, forget: bool = False) -> None:
        """Unpins a prefix of the local view; `forget` when it was deleted: the engine then also drops its blocks
        from the KV tier (an ended lease's may stay)."""
        entry = self.local.pop(key, None)
        if entry is not None:
            await self.engine.unpin_prefix(entry.record.token_ids, salt_of(entry.record), tenant_of(entry.record),
                                           forget=forget)

    # -- API operations -----------------------------------------------------------------------
    async def register(self, name: str, token_ids: list[int], source: dict[str, Any], description: str | None,
                       owner: str | None = None, salt: Salt = (), ttl_seconds: float | None = None,
                       kind: PrefixKind = "named") -> tuple[PrefixRecord, bool]:
        """Pins then records. Returns (record, created). Raises InvalidPrefix, PrefixConflict, RegistryFull,
        StoreUnavailable or the engine's PinCapExceeded. `owner`: the tenant it is registered for (None:
        published), `salt`: its blocks' cache salt, `ttl_seconds`: a lease.

        The work runs as its own task: a caller that goes away (a cancelled HTTP handler) does not cut
        it between the pin and the record, so the pinned set and the store never disagree for it."""
        block_size = self.engine.block_size
        if len(token_ids) < block_size:
            raise InvalidPrefix(f"the prefix has {len(token_ids)} tokens, less than one KV block ({block_size}): it "
                                "would pin nothing; registered prefixes are for long shared prompts", param="prompt")
        if len(token_ids) >= self.engine.max_model_len:
            raise InvalidPrefix(f"the prefix has {len(token_ids)} tokens; the model's maximum context length is "
                                f"{self.engine.max_model_len}", param="prompt")
        record = PrefixRecord(name=name, fingerprint=self.fingerprint, token_ids=list(token_ids), source=source,
                              tokenizer_version=self.engine.tokenizer_version, description=description,
                              owner=owner, salt=salt, kind=kind, ttl_seconds=ttl_seconds,
                              expires_at=None if ttl_seconds is None else time.time() + ttl_seconds)
        return await self.shielded(self._register(record))

    async def _register(self, record: PrefixRecord) -> tuple[PrefixRecord, bool]:
        key = record.key
        async with self.lock:
            existing = await self.store.get(self.fingerprint, key)
            if existing is not None and not existing.same_content(record):
                raise PrefixConflict(existing)
            if existing is None and key not in self.local:
                self.check_room(record.owner)
            entry = self.local.get(key)
            stale = entry is not None and not entry.record.same_content(record)   # a view the store no longer has
            pinned = None
            if entry is None or stale:
                # ours from here
                pinned = await self.engine.pin_prefix(record.token_ids, salt_of(record), tenant_of(record))
            record.block_hashes = pinned.block_hashes if pinned else entry.record.block_hashes  # type: ignore[union-attr]
            try:
                stored, created = await self.store.put(record, origin=self.replica_id)
            except BaseException:
                if pinned is not None:
                    await self.engine.unpin_prefix(record.token_ids, salt_of(record), tenant_of(record))
                raise
            if pinned is not None:
                if stale:
                    await self.unpin_local(key)
                self.local[key] = LocalPrefix(stored, pinned.num_pinned_blocks)
            else:
                self.local[key].record = stored
            return stored, created

    def check_room(self, owner: str | None) -> None:
        """RegistryFull when the server, or this tenant, keeps as many prefixes as it may (leases count; one
        that ended does not, though the sweep may not have unpinned it yet)."""
        now = time.time()
        live = [e.record for e in self.local.values() if not e.record.expired(now)]
        if len(live) >= self.max_prefixes:
            raise RegistryFull(f"{len(live)} prefixes are registered, the most this server keeps "
                               f"(--max-prefixes {self.max_prefixes}); delete one first", param="name")
        cap = self.max_prefixes_per_tenant
        if owner is not None and cap is not None and sum(1 for r in live if r.owner == owner) >= cap:
            raise RegistryFull(f"this tenant has {cap} prefixes registered (prompt_cache_key leases included), "
                               f"the most one tenant keeps (--max-prefixes-per-tenant {cap}); delete one first",
                               param="name")

    async def _find(self, name: str, reader: Reader, tenant: str | None = None) -> PrefixRecord:
        """The record `name` means to `reader` (access.keys_for): the local view first, then the store
        (PrefixNotFound, StoreUnavailable)."""
        keys = keys_for(name, reader, tenant)
        now = time.time()
        found = next((self.local[k].record for k in keys if k in self.local and not self.local[k].record.expired(now)),
                     None)
        for key in keys if found is None else ():
            found = await self.store.get(self.fingerprint, key)
            if found is not None:
                break
        if found is None or hidden_tokens(found, reader) is None:
            raise _not_found(name, "name")
        return found

    @staticmethod
    def _may_change(record: PrefixRecord, reader: Reader) -> None:
        """Only a published prefix can be visible and not the caller's own (access.py)."""
        if not reader.admin and record.owner != reader.owner:
            raise PrefixForbidden(f"prefix {record.name!r} is published to every tenant; only an admin key may "
                                  "change or delete it", param="name")

    async def delete(self, name: str, reader: Reader, tenant: str | None = None) -> None:
        """Raises PrefixNotFound, PrefixForbidden or StoreUnavailable. A record the store cannot decode (a
        foreign writer) is deleted by key: the first of the caller's keys for the name that holds one."""
        try:
            record = await self._find(name, reader, tenant)
        except StoreUnavailable:
            keys = keys_for(name, reader, tenant)
            for key in keys if reader.admin else keys[:1] if reader.owner is not None else []:
                with contextlib.suppress(PrefixNotFound):
                    return await self.shielded(self._delete(key, name))
            raise
        self._may_change(record, reader)
        await self.shielded(self._delete(record.key, name))

    async def _delete(self, key: str, name: str) -> None:
        async with self.lock:
            deleted = await self.store.delete(self.fingerprint, key, origin=self.replica_id)
            present = key in self.local
            await self.unpin_local(key, forget=True)
        if not deleted and not present:
            raise _not_found(name, "name")

    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:
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

    async def update(self, name: str, reader: Reader, tenant: str | None = None, **changes: Any) -> dict[str, Any]:
        """PATCH: a new `ttl_seconds` (None: no lease any more; the lease restarts now) and/or `description`.
        Raises PrefixNotFound, PrefixForbidden or StoreUnavailable."""
        record = await self._find(name, reader, tenant)
        self._may_change(record, reader)
        if "ttl_seconds" in changes:
            ttl = changes["ttl_seconds"]
            record = dataclasses.replace(record, ttl_seconds=ttl, expires_at=None if ttl is None else time.time() + ttl)
        if "description" in changes:
            record = dataclasses.replace(record, description=changes["description"])
        async with self.lock:
            if not await self.store.update(record, origin=self.replica_id):
                raise _not_found(name, "name")
            entry = self.local.get(record.key)
            if entry is not None:
                entry.record = record
        return self.describe(entry, record, reader)

    def snapshot(self, name: str, reader: Reader) -> PrefixSnapshot:
        """The named prefix as a request of `reader` uses it (its own, else the published one); PrefixNotFound
        if it is not pinned here. Names resolve in this replica's local view, never in the store: the store
        is not on the per-request path."""
        now = time.time()     # a lease that ended is gone for requests at once, before the sweep unpins it
        entry = next((self.local[k] for k in keys_for(name, reader)
                      if k in self.local and not self.local[k].record.expired(now)), None)
        hidden = None if entry is None else hidden_tokens(entry.record, reader)
        foreign = None if entry is None else hidden_tokens(entry.record, reader.tenant_view)
        if entry is None or hidden is None or foreign is None:
            raise _not_found(name, "prefix")
        record = entry.record
        messages = record.source.get("messages")
        return PrefixSnapshot(name, tuple(record.token_ids),
                              tuple(dict(m) for m in messages) if isinstance(messages, list) else None,
                              record.key, record.salt, hidden, foreign)

    def record_use(self, key: str, cached_tokens: int) -> tuple[int, int]:
        """Counts a request that named the prefix (by its key); a hit moves its lease. Returns (hit 0/1,
        tokens saved) for the metrics."""
        entry = self.local.get(key)
        if entry is None:
            return 0, 0
        saved = min(cached_tokens, len(entry.record.token_ids))
        hit = int(saved > 0)
        entry.hit_requests += hit
        entry.tokens_saved += saved
        if hit:
            self.leases.refresh(entry)
        return hit, saved

    # -- reading ------------------------------------------------------------------------------
    def describe(self, entry: LocalPrefix | None, record: PrefixRecord, reader: Reader) -> dict[str, Any]:
        """A prefix as `reader` may see it (access.hidden_tokens): where some of its tokens are not the
        reader's to read, neither is its source (a published prefix's; a lease's holds only the tokens after
        its head), nor its block hashes and the model fingerprint that seeds them (with both, a guessed block
        of tokens could be checked offline)."""
        hidden = hidden_tokens(record, reader)
        if hidden is None:
            raise _not_found(record.name, "name")
        source = None if record.owner is None and hidden else record.source
        hashes, fingerprint = (None, None) if hidden else (record.block_hashes, record.fingerprint)
        loaded = entry is not None
        return {
            "name": record.name, "object": "prefix", "num_tokens": len(record.token_ids),
            "num_pinned_blocks": entry.pinned_blocks if entry else 0, "block_hashes": hashes,
            "model": self.engine.model_name, "fingerprint": fingerprint, "created_at": int(record.created_at),
            "description": record.description, "source": source, "loaded": loaded,
            # what it was registered from (not secret: the source itself is admin-only): chat can only name a
            # prefix registered with messages
            "kind": "messages" if record.source.get("messages") is not None else "prompt",
            "type": {"cache_key": "prompt_cache_key", "cache_control": "cache_control"}.get(record.kind, "named"),
            "published": record.owner is None, "owner": record.owner,
            "ttl_seconds": record.ttl_seconds,
            "expires_at": None if record.expires_at is None else int(record.expires_at),
            "hit_requests": entry.hit_requests if entry else 0, "tokens_saved": entry.tokens_saved if entry else 0,
        }

    async def list(self, reader: Reader) -> list[tuple[PrefixRecord, dict[str, Any]]]:
        """Every record in the store `reader` may see (an admin: all; a tenant: its own and the published
        ones) with its description, sorted by key, other models' listed as not loaded; the local view if the
        store is down."""
        try:
            records = await self.store.list(None)
        except StoreUnavailable:
            records = [e.record for e in self.local.values()]
        out = []
        for r in sorted(records, key=lambda r: (r.fingerprint != self.fingerprint, r.key)):
            if hidden_tokens(r, reader) is None:
                continue
            entry = self.local.get(r.key) if r.fingerprint == self.fingerprint else None
            out.append((r, self.describe(entry, r, reader)))
        return out

    async def get(self, name: str, reader: Reader, tenant: str | None = None) -> dict[str, Any]:
        record = await self._find(name, reader, tenant)
        return self.describe(self.local.get(record.key), record, reader)


def _not_found(name: str, param: str) -> PrefixNotFound:
    """The one answer for a name this caller cannot see, whether nobody registered it or another tenant did."""
    return PrefixNotFound(f"prefix {name!r} is not registered", param=param)
