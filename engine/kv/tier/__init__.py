"""The KV tier: a second tier below the engine's KV cache, on disk, that outlives the process.

    format.py   one block as a file: header (namespace, hash, parent, token ids, checksum) + K|V bytes
    disk.py     DiskBackend: a directory of block files, bounded in bytes, LRU, 0700/0600; local or shared
    io.py       TierIO: the writer thread (encode, checksum, write) and the loader thread (read, verify)
    tier.py     KVTier: what the engine calls, on its thread: evicted and pinned blocks captured for the
                writer, prompts' blocks requested from the loader, installed into the pool as cached blocks

The shape is LMCache's (the ecosystem's KV tier, vLLM's connector): content-addressed chunks, asynchronous
store and retrieve, a chain of storage backends tried in order. The chunk is our KV block, its key our
chained block hash (model fingerprint and tenant salt included), so a block of the tier is found by the
same lookup as a block of the cache. README ("The KV tier on disk") says why LMCache itself is not used.

The backends, in the order they are read: the local directory (`kv_tier_dir`), then the shared one
(`kv_tier_shared_dir`); every block is written to each.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from engine.kv.backends.base import KVStore
    from engine.kv.block_pool import BlockHash
    from engine.kv.tier.tier import KVTier


def create_tier(config: EngineConfig, kv: KVStore, block_shape: tuple[int, ...], dtype: torch.dtype,
                root: BlockHash, description: str, max_load_blocks: int) -> KVTier | None:
    """The tier `config` asks for (None when neither directory is set). `description`: everything that makes
    KV bytes reusable between processes (the namespace)."""
    if config.kv_tier_dir is None and config.kv_tier_shared_dir is None:
        return None
    from engine.kv.tier.disk import DiskBackend
    from engine.kv.tier.tier import KVTier, namespace
    ns = namespace(description)
    backends = []
    if config.kv_tier_dir is not None:
        backends.append(DiskBackend(Path(config.kv_tier_dir).expanduser(), ns, config.kv_tier_bytes, name="local"))
    if config.kv_tier_shared_dir is not None:
        backends.append(DiskBackend(Path(config.kv_tier_shared_dir).expanduser(), ns, config.kv_tier_shared_bytes,
                                    shared=True, name="shared"))
    return KVTier(backends, kv, block_shape, dtype, root, ns, load_timeout=config.kv_tier_load_timeout,
                  max_load_blocks=max_load_blocks)


__all__ = ["create_tier"]
