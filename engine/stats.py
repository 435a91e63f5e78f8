"""EngineStats: what an engine reports of itself (EngineCore.stats): the KV cache's blocks, the queues, prefix
hits, the KV backend's and tier's own figures, structured output's grammar cache and the compute threads. The
service's /metrics and the offline LLM.stats() read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.backends.base import KVStat


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_pinned: int
    kv_blocks_cached: int
    kv_blocks_free: int
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    prefix_cache_queried_tokens_total: int
    prefix_cache_hit_tokens_total: int
    kv_backend: str = ""                          # the KV backend's name, and its own figures (KVStore.stats)
    kv_backend_stats: dict[str, KVStat] = field(default_factory=dict)
    kv_events_published: int | None = None       # KV event batches published, records dropped (None: events off)
    kv_events_dropped: int | None = None
    grammars_cached: int = 0                      # compiled grammars kept for reuse, and their bytes
    grammar_cache_bytes: int = 0
    kv_tier_stats: dict[str, KVStat] = field(default_factory=dict)   # the KV tier's figures ({}: no tier)
    torch_threads: int = 0                        # the compute threads now, and how often the governor moved them
    torch_thread_changes: int = 0


__all__ = ["EngineStats"]
