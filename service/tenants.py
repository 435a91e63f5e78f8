"""Tenants: who a request is, as the prefix cache and the prefix registry see it.

A tenant is an API key, or a named group of keys (`--tenant-keys NAME:KEY`). Without keys everyone is
one tenant and nothing is salted: today's single shared cache. With keys (and `--cache-isolation
tenant`, the default), every prompt's KV blocks are hashed with a salt the server derives from the
tenant, never from the request, so a prompt one tenant cached is a miss for every other: by hash, in the
engine, in the KV events and in any router that reads them (engine/kv/block_pool.CacheSalt). A client's
`cache_salt` (vLLM's field) narrows that further within its tenant; it cannot widen it.

Named prefixes are salted as their owner's prompts are, so a tenant's own prompts that start with its
prefix's text hit it. A prefix an admin publishes has a salt of its own: every tenant hits it by naming
it, and none by sending its text unnamed (its content cannot be probed). A request that names a prefix
with a salt other than its own is salted twice: the prefix's salt at block 0, its own from the first
block past the prefix, so what follows a published prefix is not shared between tenants either.

    tokens:  | prefix's full blocks  | the rest of the prompt, then the output ... |
    salt:    prefix.salt at block 0   caller's salt at block len(prefix) // block_size

A prompt_cache_key lease keeps the salt its request ran with (both parts, after a published prefix), and a
request that names such a lease goes on from where the lease's salt leaves off.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from aiohttp import web

from prefix_store.access import Reader
from prefix_store.base import Salt
from prefix_store.local import PrefixSnapshot

ANONYMOUS = "anonymous."        # callers without a key where none is needed (no group name ends with ".")


def key_tenant(key: str) -> str:
    """The tenant of a key in no named group: a digest, so neither logs nor listings show the key."""
    return "key." + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Caller:
    tenant: str | None          # None: no keys are configured, everyone is one tenant
    admin: bool
    isolated: bool = False      # its prompts are salted apart from other tenants'

    def salt(self, client_salt: str | None = None) -> str | None:
        """The salt of this caller's prompts (None: unsalted, the one shared cache)."""
        parts = [f"tenant:{self.tenant}"] if self.isolated and self.tenant is not None else []
        if client_salt:
            parts.append("client:" + hashlib.sha256(client_salt.encode()).hexdigest()[:32])
        return "|".join(parts) or None

    def prefix_salt(self, published_name: str | None) -> Salt:
        """The salt a prefix this caller registers is hashed with: its own prompts' salt, or for a
        published prefix one of its own (none where nothing is isolated)."""
        key = self.salt() if published_name is None else f"published:{published_name}" if self.isolated else None
        return ((0, key),) if key else ()

    @property
    def owner(self) -> str | None:
        """Whose prefixes it sees (besides the published ones): its tenant's."""
        return self.tenant

    @property
    def reader(self) -> Reader:
        """Its view of the prefix registry (prefix_store/access.py decides what that shows)."""
        return Reader(self.tenant, self.admin)


def cache_salt(caller: Caller, client_salt: str | None, prefix: PrefixSnapshot | None,
               block_size: int) -> tuple[tuple[int, str], ...]:
    """The engine's CacheSalt for a request (the module docstring's sketch): the prefix's own salt over its
    full blocks, then the caller's from the block where the prefix ends, unless the prefix's salt already
    ends with it."""
    mine = caller.salt(client_salt)
    if prefix is None:
        return ((0, mine),) if mine else ()
    switch = len(prefix.token_ids) // block_size
    salts = [(i, key) for i, key in prefix.salt if i < switch]     # a narrowed lease's later parts salt nothing
    if mine and (not salts or salts[-1][1] != mine):
        salts.append((switch, mine))
    return tuple(salts)


CALLER = web.RequestKey("caller", Caller)


def caller_of(request: web.Request) -> Caller:
    """The caller the auth middleware found (an admin of the one tenant where it did not run)."""
    return request.get(CALLER) or Caller(None, admin=True)
