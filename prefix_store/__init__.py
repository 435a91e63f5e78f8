"""Prefix registry metadata: named prefixes, replica heartbeats and change announcements.

`MemoryPrefixStore` is the embedded default (one process); `RedisPrefixStore` is shared by every
replica (build one with `prefix_store.redis.connect(url)`). No torch here.
"""
from prefix_store.base import (
    PrefixConflict,
    PrefixEvent,
    PrefixRecord,
    PrefixStore,
    PrefixStoreError,
    ReplicaInfo,
    StoreUnavailable,
)
from prefix_store.memory import MemoryPrefixStore
from prefix_store.redis import RedisPrefixStore

__all__ = [
    "MemoryPrefixStore",
    "PrefixConflict",
    "PrefixEvent",
    "PrefixRecord",
    "PrefixStore",
    "PrefixStoreError",
    "RedisPrefixStore",
    "ReplicaInfo",
    "StoreUnavailable",
]
