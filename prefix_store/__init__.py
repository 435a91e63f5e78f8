"""The named-prefix domain: registered prefixes, pinned on every replica, their metadata in a store.

    registry.py   PrefixRegistry: pin-then-record, resync from the store, heartbeats, the local view
                  requests resolve names in (snapshot), tenants' scopes, per-prefix counters
    leases.py     Leases: prefixes that end after their last hit, swept on every replica; prompt_cache_key
    local.py      what a replica holds: the engine's face (Pinner), LocalPrefix, PrefixSnapshot
    base.py       PrefixRecord, ReplicaInfo, PrefixEvent and the PrefixStore protocol
    memory.py     MemoryPrefixStore: the embedded default (one process, nothing to start)
    redis.py      RedisPrefixStore: shared by every replica (msgpack values, MULTI/EXEC, pub/sub)
    errors.py     RegistryError and its kinds (not found, full, invalid, conflict, store unavailable)

No torch and no HTTP here: the registry pins through the engine it is given (a `Pinner`, the
AsyncEngine), and service/routes/prefixes.py is its HTTP face.
"""
from prefix_store.base import PrefixEvent, PrefixRecord, PrefixStore, ReplicaInfo
from prefix_store.errors import (
    InvalidPrefix,
    PrefixConflict,
    PrefixForbidden,
    PrefixNotFound,
    RegistryError,
    RegistryFull,
    StoreUnavailable,
)
from prefix_store.memory import MemoryPrefixStore
from prefix_store.redis import RedisPrefixStore

__all__ = [
    "InvalidPrefix",
    "MemoryPrefixStore",
    "PrefixConflict",
    "PrefixEvent",
    "PrefixForbidden",
    "PrefixNotFound",
    "PrefixRecord",
    "PrefixStore",
    "RedisPrefixStore",
    "RegistryError",
    "RegistryFull",
    "ReplicaInfo",
    "StoreUnavailable",
]
