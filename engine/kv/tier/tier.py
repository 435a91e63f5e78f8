"""KVTier: the engine's second KV tier, between its cache and the backends that hold blocks on disk.

    engine thread (this module)             writer thread (io.py)        loader thread (io.py)
    ─────────────                           ─────────────                ─────────────
    pool evicts a cached block ─► evicted() records it
    before the next forward pass:
      capture() copies recorded blocks ───► encode, checksum, write
    a prefix is pinned ─► persist()         to every backend (LRU)
    a prompt's next block is not cached
      but the tier has it ─► request() ─────────────────────────────────► read, verify, fill a
      (the request waits; others run)                                     host buffer; done
    install_finished(): pool blocks, ◄──────────────────────────────────────────────┘
      bytes copied in, hashes given: ordinary cached blocks the prompt then hits

Keys are the engine's own block hashes (block_pool.hash_block): chained from a root seeded by the model
fingerprint, with the tenant's salt mixed in, so the same tokens of the same tenant give the same key in
every process, replica and restart, and one tenant's blocks are never another's hit. What else makes KV
bytes reusable (the KV dtype, the weights' quantization, the kernels, the block size and shape) goes into
the namespace (`namespace()`), a folder of its own in each backend.

A block is used only if it is the block asked for: the file's namespace, hash, size and checksum (format.py,
disk.py), then its parent hash and token ids equal those of the prompt that asked (the prompt's own chain).
Anything else is a miss, counted as a fault; the prompt computes what it did not get.

Bounded: the bytes waiting to be written (io.WRITE_QUEUE_BYTES; beyond it a block is not written, counted
as dropped), the blocks being loaded (`max_load_blocks`), the time a request waits for a load
(`load_timeout`; then it computes), the bytes on disk (each backend's bound).

NOTE: who owns what. Everything here runs on the engine thread (the pool's owner): `evicted`, `capture`,
`persist`, `request`, `install_finished`, `discard`, `stats`. The loader fills a job's buffer and then sets
its `done` event; the engine reads the buffer only after that. The write queue's accounting is io.py's,
under its lock; the backends' indexes take their own.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence

import torch

from engine.kv.backends.base import KVStat, KVStore
from engine.kv.block_pool import Block, BlockHash, BlockPool
from engine.kv.tier.disk import DiskBackend
from engine.kv.tier.io import LoadJob, Record, TierIO

log = logging.getLogger(__name__)


def namespace(description: str) -> bytes:
    """The backends' folder for KV bytes made under `description` (model fingerprint, KV dtype, weights,
    kernels, block shape): 16 bytes of its blake2b."""
    return hashlib.blake2b(description.encode(), digest_size=16).digest()


class KVTier:
    def __init__(self, backends: Sequence[DiskBackend], kv: KVStore, block_shape: tuple[int, ...],
                 dtype: torch.dtype, root: BlockHash, namespace: bytes, *, load_timeout: float = 5.0,
                 max_load_blocks: int = 1024) -> None:
        assert backends, "a KV tier needs at least one backend"
        self.backends = list(backends)
        self.kv = kv
        self.block_size = block_shape[2]                   # block_shape: [2, layers, block_size, kv_heads, head_dim]
        self.root = root
        self.load_timeout = load_timeout
        self.max_load_blocks = max_load_blocks
        self.io = TierIO(self.backends, namespace, block_shape, dtype)
        self._evicted: list[Record] = []
        self._deferred: list[tuple[Block, BlockHash]] = []   # pinned blocks waiting for room in the write queue
        self._loading: dict[BlockHash, LoadJob] = {}
        self._jobs: list[LoadJob] = []
        self._loading_blocks = 0
        self.hit_blocks = self.miss_blocks = self.loads = self.timeouts = self.dropped_writes = 0
        self.dropped_loads = 0
        self.load_seconds = 0.0

    # -- writing ------------------------------------------------------------------------------
    def has(self, block_hash: BlockHash) -> bool:
        """In a backend, or on its way there (a load waits for the write)."""
        return self.io.queued(block_hash) or self.io.stored(block_hash)

    def evicted(self, block: Block) -> None:
        """The pool's Spill sink: a cached block is evicted; it is written unless the tier has it already."""
        assert block.block_hash is not None
        if not self._record(block, block.block_hash):
            self.dropped_writes += 1

    def _record(self, block: Block, block_hash: BlockHash) -> bool:
        """Queues a block for `capture`; False when the write queue has no room."""
        if self.io.queued(block_hash):
            return True
        if self.io.stored(block_hash):
            self.io.touch(block_hash)
            return True
        if not self.io.reserve(block_hash):
            return False
        self._evicted.append(Record(block.block_id, block_hash, block.parent or self.root, block.token_ids))
        return True

    def capture(self) -> None:
        """Copies the recorded blocks' bytes to the host and hands them to the writer. Called before anything
        may write into an evicted block (the forward pass, an install); pinned blocks that found no room earlier
        are retried here."""
        if self._deferred:
            still = []
            for block, h in self._deferred:
                if block.block_hash == h and not self._record(block, h):
                    still.append((block, h))
            self._deferred = still
        if not self._evicted:
            return
        records, self._evicted = self._evicted, []
        self.io.write(records, self.kv.read_blocks([r.block_id for r in records]))

    def persist(self, blocks: Sequence[Block]) -> None:
        """Pinned blocks are written now (not at eviction: they are never evicted while pinned, and a restart
        must find them); those that do not fit the write queue are retried at each step."""
        for block in blocks:
            h = block.block_hash
            if h is not None and not self._record(block, h):
                self._deferred.append((block, h))
        self.capture()

    def discard(self, hashes: Sequence[BlockHash]) -> None:
        """Removes blocks from every backend (a deleted prefix's)."""
        gone = set(hashes)
        self._deferred = [(b, h) for b, h in self._deferred if h not in gone]
        self.io.delete(list(hashes))

    # -- loading ------------------------------------------------------------------------------
    def request(self, hashes: Sequence[BlockHash], token_ids: Sequence[int], first: int, limit: int,
                keep: Sequence[Block] = ()) -> LoadJob | None:
        """Blocks first..limit-1 of a prompt (`hashes`: its chained block hashes, `token_ids`: its tokens) are not
        in the cache: the load that brings the leading ones the tier has (one already running for the same block
        is shared), or None when the tier has not block `first` (those blocks are counted as misses). `keep`: the
        prompt's blocks before `first`, cached now: the install does not evict them to make room."""
        job = self._loading.get(hashes[first])
        if job is not None:
            return job
        room = self.max_load_blocks - self._loading_blocks
        n = 0
        while first + n < limit and n < room and hashes[first + n] not in self._loading and self.has(hashes[first + n]):
            n += 1
        self.miss_blocks += limit - first - n          # past the run the tier has: computed
        if n == 0:
            return None
        b = self.block_size
        job = LoadJob(list(hashes[first:first + n]), hashes[first - 1] if first else self.root,
                      [tuple(token_ids[i * b:(i + 1) * b]) for i in range(first, first + n)],
                      [(blk, blk.block_hash) for blk in keep if blk.block_hash is not None])
        for h in job.hashes:
            self._loading[h] = job
        self._loading_blocks += n
        self._jobs.append(job)
        self.io.load(job)
        return job

    def waiting_too_long(self, job: LoadJob) -> bool:
        """The load has taken more than `load_timeout`: the request stops waiting (and computes the blocks)."""
        if job.installed or time.monotonic() - job.started <= self.load_timeout:
            return False
        if not job.cancelled:
            job.cancelled = True
            self.timeouts += 1
            log.warning("KV tier: a load of %d blocks took more than %.1f s; computing them instead",
                        len(job.hashes), self.load_timeout)
        return True

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def drain(self, timeout: float = 10.0) -> bool:
        """Waits until every queued block is written (tests, benchmarks); False if `timeout` passed first."""
        self.capture()
        return self.io.drain(timeout)

    def wait(self, timeout: float) -> None:
        """Blocks the engine thread until a load finishes or `timeout` passes: for a step with nothing to run
        while requests wait for their blocks."""
        self.io.progress.wait(timeout)

    def install_finished(self, pool: BlockPool, keep_free: int = 0) -> int:
        """Turns the blocks of every finished load into cached blocks of the pool (least recently used ones
        evicted for them, `keep_free` blocks left free); returns how many. A block someone computed meanwhile
        is not installed twice."""
        self.io.progress.clear()
        finished = [j for j in self._jobs if j.done.is_set()]
        if not finished:
            return 0
        self._jobs = [j for j in self._jobs if not j.done.is_set()]
        installed = 0
        for job in finished:
            for h in job.hashes:
                if self._loading.get(h) is job:
                    del self._loading[h]
            self._loading_blocks -= len(job.hashes)
            self.loads += 1
            self.load_seconds += job.seconds
            installed += self._install(job, pool, keep_free)
            self.miss_blocks += len(job.hashes) - job.count
            job.data, job.installed = None, True
        return installed

    def _install(self, job: LoadJob, pool: BlockPool, keep_free: int) -> int:
        # the leading blocks not cached already (someone may have computed some meanwhile)
        n = 0
        while n < job.count and job.hashes[n] not in pool.cached:
            n += 1
        # NOTE: the prompt's own cached head may be the least recently used blocks (a session back after the
        # others' turns): held while the loaded blocks are allocated, or they would be evicted for its tail
        held = [blk for blk, h in job.keep if pool.cached.get(h) is blk]
        pool.touch(held)
        fit = min(n, pool.num_free - keep_free)
        self.dropped_loads += job.count - max(fit, 0)
        if fit <= 0 or job.data is None:
            pool.free(held)
            return 0
        blocks = pool.allocate(fit)
        self.capture()                  # what that evicted is copied out before it is overwritten
        self.kv.write_blocks([b.block_id for b in blocks], job.data[:fit])
        parent: BlockHash | None = None if job.parent == self.root else job.parent     # None: a first block
        for i, block in enumerate(blocks):
            pool.cache_full_block(block, job.hashes[i], job.token_ids[i], parent=parent)
            parent = job.hashes[i]
        pool.free(blocks)               # cached and free: the prompt's lookup takes them next
        pool.free(held)
        self.hit_blocks += fit
        return fit

    def close(self) -> None:
        """Hands over what is captured, stops waiting for loads, and lets the writer finish (io.CLOSE_FLUSH_S)."""
        self.capture()
        for job in self._jobs:
            job.cancelled = True
        self.io.close()

    # -- figures ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, KVStat]:
        faults = {k: sum(b.faults[k] for b in self.backends) for k in self.backends[0].faults}
        out = {
            "hit_blocks": KVStat("counter", self.hit_blocks, "KV blocks loaded from the tier instead of computed"),
            "miss_blocks": KVStat("counter", self.miss_blocks, "Prompt blocks neither the KV cache nor the tier "
                                  "held (computed)"),
            "loads": KVStat("counter", self.loads, "Loads from the tier finished (one per prompt that hit it)"),
            "load_seconds": KVStat("counter", self.load_seconds, "Seconds those loads took, request to verified "
                                   "bytes (mean: load_seconds / loads)"),
            "read_bytes": KVStat("counter", self.io.bytes_read, "Bytes read from the tier (verified blocks)"),
            "written_bytes": KVStat("counter", self.io.bytes_written, "Bytes written to the tier (every backend)"),
            "written_blocks": KVStat("counter", self.io.blocks_written, "Block files written to the tier"),
            "dropped_writes": KVStat("counter", self.dropped_writes, "Blocks not written: the write queue was full"),
            "dropped_loads": KVStat("counter", self.dropped_loads, "Blocks loaded but not installed (no free "
                                    "blocks, or computed meanwhile)"),
            "timeouts": KVStat("counter", self.timeouts, "Loads a request stopped waiting for (--kv-tier-load-"
                               "timeout): it computed the blocks"),
        }
        for kind, n in faults.items():
            out[f"faults_{kind}"] = KVStat("counter", n, f"Tier faults: {kind} (the block was a miss or not "
                                           "written; see engine/kv/tier/disk.py)")
        for b in self.backends:
            out[f"{b.name}_bytes"] = KVStat("gauge", b.num_bytes, f"Bytes of block files in the {b.name} tier "
                                            "directory")
            out[f"{b.name}_files"] = KVStat("gauge", b.num_files, f"Block files in the {b.name} tier directory")
            out[f"{b.name}_capacity_bytes"] = KVStat("gauge", b.max_bytes, f"The {b.name} tier's byte bound")
            out[f"{b.name}_evicted_files"] = KVStat("counter", b.evicted_files, f"Files the {b.name} tier evicted "
                                                    "(least recently used, for the byte bound)")
        return out


__all__ = ["KVTier", "LoadJob", "namespace"]
