"""Leases: prefixes that end `ttl_seconds` after their last hit or update, and the `prompt_cache_key` leases.

A lease's end is in its record (`expires_at`) and in the store (Redis drops the record then: key expiry).
Each replica sweeps its view every `sweep_interval` seconds for ended leases, re-reads them from the store
(another replica's hit may have moved them) and unpins those that ended, so their blocks are left to the
LRU. A hit moves the end in the background (`refresh`), writing the store at most once per tenth of the
lease: requests never wait for Redis.

A `prompt_cache_key` is a lease of kind "cache_key" on the common prefix of the prompts that sent it, in
their tenant (`cache_key`). It pins those tokens under the cache salt their requests ran with (so they
hit it), and records only what its tenant may read: after a published prefix the request named, the
tokens past that prefix (`PrefixRecord.hidden_tokens`: the prefix's are pinned, never shown).
A `cache_control` breakpoint (Anthropic's Messages API) and a pre-warm are leases of kind "cache_control"
on the prompt's tokens up to it (`content`): named by a digest of those tokens and their salt, so the same
prefix sent again is the same lease (its end moved), another prefix another lease; the same two rules
(the request's salt, only what its tenant may read) hold for them.

NOTE: a friend of PrefixRegistry: it runs under the registry's lock and through its local view, shielded
operations and caps, on the event loop like the registry. It sees the registry through `LeaseHost`, the
narrow face it needs, so it does not import the registry (which imports it).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from prefix_store.base import PrefixRecord, PrefixStore, Salt
from prefix_store.errors import StoreUnavailable
from prefix_store.local import LocalPrefix, Pinner, salt_of, tenant_of

log = logging.getLogger(__name__)
T = TypeVar("T")


class LeaseHost(Protocol):
    """What leases need of the registry (PrefixRegistry is the one): its store and engine, its local view and
    the lock that guards it, its shielded operations, its cap, and unpinning from its view."""

    store: PrefixStore
    engine: Pinner
    fingerprint: str
    replica_id: str
    local: dict[str, LocalPrefix]
    lock: asyncio.Lock

    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T: ...

    def check_room(self, owner: str | None) -> None: ...

    async def unpin_local(self, key: str, forget: bool = False) -> None: ...


class Leases:
    def __init__(self, registry: LeaseHost, sweep_interval: float = 1.0) -> None:
        self.registry = registry
        self.sweep_interval = sweep_interval
        self.spawned: set[asyncio.Task[Any]] = set()     # refreshes written in the background

    def refresh(self, entry: LocalPrefix) -> None:
        """Moves a lease's end to now + ttl (nothing for a prefix without one)."""
        record, ttl = entry.record, entry.record.ttl_seconds
        if ttl is None:
            return
        end = time.time() + ttl
        if record.expires_at is not None and end - record.expires_at < ttl / 10:
            return
        entry.record = dataclasses.replace(record, expires_at=end)
        reg = self.registry
        self._background(reg.store.update(entry.record, origin=reg.replica_id))

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.spawned.add(task)
        task.add_done_callback(self.spawned.discard)
        task.add_done_callback(_log_failure)

    async def sweep(self) -> None:
        """The sweep task: runs until cancelled."""
        while True:
            await asyncio.sleep(self.sweep_interval)
            now = time.time()
            for key in [k for k, e in self.registry.local.items() if e.record.expired(now)]:
                try:
                    await self._expire(key)
                except Exception:           # never let one lease stop the sweep
                    log.exception("expiring prefix %r failed", key)

    async def _expire(self, key: str) -> None:
        """A lease ended in this replica's view: unless the store has it later (another replica's hit),
        unpin it here and drop it from the store (its index; the others unpin on the announcement)."""
        reg = self.registry
        async with reg.lock:
            try:
                record = await reg.store.get(reg.fingerprint, key)
            except StoreUnavailable:
                record = None               # the store is down: our view's lease ended all the same
            entry = reg.local.get(key)
            if entry is None:
                return
            if record is not None and record.same_content(entry.record) and not record.expired(time.time()):
                entry.record = record
                return
            await reg.unpin_local(key)
            with contextlib.suppress(StoreUnavailable):
                await reg.store.delete(reg.fingerprint, key, origin=reg.replica_id)
        log.info("prefix %r: its lease ended, unpinned", key)

    async def cache_key(self, owner: str | None, salt: Salt, cache_key: str, token_ids: list[int],
                        ttl_seconds: float, hidden: int = 0) -> None:
        """A request with `prompt_cache_key` ended: keep the common prefix of the prompts that sent this key
        pinned (its full blocks), as a lease of `ttl_seconds`. The first prompt pins its own full blocks;
        a later one that shares fewer narrows the lease to what they share (one that shares no block, or
        ran with another salt, replaces it); one that shares it all moves the lease's end. `salt`: the
        request's cache salt; `hidden`: the prompt's leading tokens its tenant may not read (not recorded in
        the lease's source). Raises what registering raises."""
        reg = self.registry
        b = reg.engine.block_size
        usable = list(token_ids[:(len(token_ids) - 1) // b * b])     # the blocks a later prompt can hit
        name = "pck-" + hashlib.sha256(cache_key.encode()).hexdigest()[:32]
        key = name if owner is None else f"{owner}/{name}"
        entry = reg.local.get(key)
        tokens = usable
        if entry is not None and entry.record.salt == salt:
            old = entry.record.token_ids
            common = next((i for i, (x, y) in enumerate(zip(old, usable)) if x != y), min(len(old), len(usable)))
            common = common // b * b
            if common == len(old):
                self.refresh(entry)
                return
            tokens = usable[:common] if common >= b else usable
        if len(tokens) < b:
            return
        hidden = min(hidden, len(tokens))
        record = PrefixRecord(name=name, fingerprint=reg.fingerprint, token_ids=tokens,
                              source={"token_ids": tokens[hidden:]}, tokenizer_version=reg.engine.tokenizer_version,
                              owner=owner, salt=salt, kind="cache_key", ttl_seconds=ttl_seconds,
                              expires_at=time.time() + ttl_seconds, hidden_tokens=hidden)
        await reg.shielded(self._replace(record))

    async def content(self, owner: str | None, salt: Salt, token_ids: list[int], ttl_seconds: float,
                      hidden: int = 0) -> str | None:
        """Holds `token_ids`' full blocks pinned for `ttl_seconds` after their last use, as a lease of tenant
        `owner`; the same tokens (and salt) held already: the lease's end moves (to the longer of its TTL and
        this one). `salt` and `hidden` as for `cache_key`. Returns the lease's key, None for less than a block.
        Raises what registering raises."""
        reg = self.registry
        b = reg.engine.block_size
        tokens = list(token_ids[:len(token_ids) // b * b])
        if not tokens:
            return None
        digest = hashlib.sha256(f"{salt!r}|{','.join(map(str, tokens))}".encode()).hexdigest()[:32]
        name = "cc-" + digest
        key = name if owner is None else f"{owner}/{name}"
        entry = reg.local.get(key)
        if entry is not None and not entry.record.expired(time.time()):
            if (entry.record.ttl_seconds or 0) < ttl_seconds:
                entry.record = dataclasses.replace(entry.record, ttl_seconds=ttl_seconds, expires_at=None)
            self.refresh(entry)
            return key
        hidden = min(hidden, len(tokens))
        record = PrefixRecord(name=name, fingerprint=reg.fingerprint, token_ids=tokens,
                              source={"token_ids": tokens[hidden:]}, tokenizer_version=reg.engine.tokenizer_version,
                              owner=owner, salt=salt, kind="cache_control", ttl_seconds=ttl_seconds,
                              expires_at=time.time() + ttl_seconds, hidden_tokens=hidden)
        await reg.shielded(self._replace(record))
        return key

    async def _replace(self, record: PrefixRecord) -> None:
        """Pins `record`, stores it over whatever its key held, then unpins what that was."""
        reg = self.registry
        async with reg.lock:
            key = record.key
            if key not in reg.local:
                reg.check_room(record.owner)
            pinned = await reg.engine.pin_prefix(record.token_ids, salt_of(record), tenant_of(record))
            record.block_hashes = pinned.block_hashes
            try:
                if not await reg.store.update(record, origin=reg.replica_id):
                    await reg.store.put(record, origin=reg.replica_id)
            except BaseException:
                await reg.engine.unpin_prefix(record.token_ids, salt_of(record), tenant_of(record))
                raise
            await reg.unpin_local(key)
            reg.local[key] = LocalPrefix(record, pinned.num_pinned_blocks)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a lease refresh failed: %s", task.exception())
