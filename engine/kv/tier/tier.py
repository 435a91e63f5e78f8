"""KVTier: the engine's second KV tier, between its cache and the backends that hold blocks on disk.

    engine thread                           writer thread                loader thread
    ─────────────                           ─────────────                ─────────────
    pool evicts a cached block ─► evicted() records it
    before the next forward pass:
      capture() copies recorded blocks ───► encode, checksum, write
    a prefix is pinned ─► persist()         to every backend (LRU)
    a prompt's next block is not cached
      but the tier has it ─► request() ─────────────────────────────────► read, verify, fill a
      (the request waits; others run)                                     host buffer; done
    install(): blocks from the pool, ◄──────────────────────────────────────────────┘
      bytes copied in, hashes given: ordinary cached blocks the prompt then hits

Keys are the engine's own block hashes (block_pool.hash_block): chained from a root seeded by the model
fingerprint, with the tenant's salt mixed in, so the same tokens of the same tenant give the same key in
every process, replica and restart, and one tenant's blocks are never another's hit. What else makes KV
bytes reusable (the KV dtype, the weights' quantization, the kernels, the block size and shape) goes into
the namespace (`namespace()`), a folder of its own in each backend.

A block is used only if it is the block asked for: the file's namespace, hash, size and checksum (format.py,
disk.py), then its parent hash and token ids equal those of the prompt that asked (the prompt's own chain).
Anything else is a miss, counted as a fault; the prompt computes what it did not get.

Bounded: the bytes waiting to be written (WRITE_QUEUE_BYTES; beyond it a block is not written, counted
as dropped), the blocks being loaded (`max_load_blocks`), the time a request waits for a load
(`load_timeout`; then it computes), the bytes on disk (each backend's bound).

NOTE: who owns what. Everything but the two threads' work runs on the engine thread (the pool's owner):
`evicted`, `capture`, `persist`, `request`, `install_finished`, `discard`, `stats`. The loader fills a job's
buffer and then sets its `done` event; the engine reads the buffer only after that. The backends' indexes
take their own lock.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.kv.backends.base import KVStat, KVStore
from engine.kv.block_pool import Block, BlockHash, BlockPool
from engine.kv.tier.disk import DiskBackend
from engine.kv.tier.format import Header, checksum

log = logging.getLogger(__name__)
WRITE_QUEUE_BYTES = 256 * 2**20    # block copies waiting for the writer thread, at most
SCAN_INTERVAL_S = 2.0              # how often a shared directory is listed again for other replicas' blocks
CLOSE_FLUSH_S = 10.0               # what close() waits for queued writes (the pinned prefixes among them)


def namespace(description: str) -> bytes:
    """The backends' folder for KV bytes made under `description` (model fingerprint, KV dtype, weights,
    kernels, block shape): 16 bytes of its blake2b."""
    return hashlib.blake2b(description.encode(), digest_size=16).digest()


@dataclass(eq=False)
class LoadJob:
    """Consecutive blocks of one prompt, read by the loader thread for the engine thread."""

    hashes: list[BlockHash]
    parent: BlockHash                              # the hash before hashes[0] (the root for a first block)
    token_ids: list[tuple[int, ...]]
    keep: list[tuple[Block, BlockHash]] = field(default_factory=list)   # the prompt's cached blocks before
                                                                       # hashes[0] (its hit), with their hashes
    started: float = field(default_factory=time.monotonic)
    data: torch.Tensor | None = None               # [n, *block_shape], filled by the loader
    count: int = 0                                 # leading blocks read and verified
    seconds: float = 0.0
    cancelled: bool = False                        # the engine stopped waiting (load_timeout)
    installed: bool = False                        # its blocks are in the pool (engine thread)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Writes:
    """Captured blocks for the writer: data[i] is records[i]'s K|V."""

    records: list[_Record]
    data: torch.Tensor


@dataclass
class _Deletes:
    hashes: list[BlockHash]


@dataclass
class _Record:
    """A block to write: its identity, and (once captured) its bytes."""

    block_id: int
    block_hash: BlockHash
    parent: BlockHash
    token_ids: tuple[int, ...]


class KVTier:
    def __init__(self, backends: Sequence[DiskBackend], kv: KVStore, block_shape: tuple[int, ...],
                 dtype: torch.dtype, root: BlockHash, namespace: bytes, *, load_timeout: float = 5.0,
                 max_load_blocks: int = 1024) -> None:
        assert backends, "a KV tier needs at least one backend"
        self.backends = list(backends)
        self.kv = kv
        self.block_shape = block_shape                     # [2, layers, block_size, kv_heads, head_dim]
        self.block_size = block_shape[2]
        self.dtype = dtype
        self.block_bytes = torch.empty(block_shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        self.root = root
        self.namespace = namespace
        self.load_timeout = load_timeout
        self.max_load_blocks = max_load_blocks
        # engine thread
        self._evicted: list[_Record] = []
        self._deferred: list[tuple[Block, BlockHash]] = []   # pinned blocks waiting for room in the write queue
        self._loading: dict[BlockHash, LoadJob] = {}
        self._jobs: list[LoadJob] = []
        self._loading_blocks = 0
        # shared with the writer (under _lock)
        self._lock = threading.Lock()
        self._queued: set[BlockHash] = set()
        self._queued_bytes = 0
        self._written = threading.Condition(self._lock)     # notified as queued blocks are written
        # counters (written by one thread each, read by `stats`)
        self.hit_blocks = self.miss_blocks = self.loads = self.timeouts = self.dropped_writes = 0
        self.dropped_loads = self.bytes_read = self.bytes_written = self.blocks_written = 0
        self.load_seconds = 0.0
        self._progress = threading.Event()
        self._writes: queue.SimpleQueue[_Writes | _Deletes | None] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-load", daemon=True)
        self._writer.start()
        self._loader.start()

    # -- engine thread: writing ---------------------------------------------------------------
    def has(self, block_hash: BlockHash) -> bool:
        """In a backend, or on its way there (the loader waits for the write)."""
        return block_hash in self._queued or self._stored(block_hash)

    def _stored(self, block_hash: BlockHash) -> bool:
        return any(b.contains(block_hash) for b in self.backends)

    def evicted(self, block: Block) -> None:
        """The pool's Spill sink: a cached block is evicted; it is written unless the tier has it already."""
        assert block.block_hash is not None
        if not self._record(block, block.block_hash):
            self.dropped_writes += 1

    def _record(self, block: Block, block_hash: BlockHash) -> bool:
        """Queues a block for `capture`; False when the write queue has no room (counted as dropped)."""
        if block_hash in self._queued:
            return True
        if self._stored(block_hash):
            for b in self.backends:
                b.touch(block_hash)
            return True
        with self._lock:
            if self._queued_bytes + self.block_bytes > WRITE_QUEUE_BYTES:
                return False
            self._queued.add(block_hash)
            self._queued_bytes += self.block_bytes
        self._evicted.append(_Record(block.block_id, block_hash, block.parent or self.root, block.token_ids))
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
        data = self.kv.read_blocks([r.block_id for r in records])
        self._writes.put(_Writes(records, data))

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
        self._writes.put(_Deletes(list(hashes)))

    # -- engine thread: loading ---------------------------------------------------------------
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
        self._reads.put(job)
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
        deadline = time.monotonic() + timeout
        with self._written:
            while self._queued and (left := deadline - time.monotonic()) > 0:
                self._written.wait(left)
            return not self._queued

    def wait(self, timeout: float) -> None:
        """Blocks the engine thread until a load finishes or `timeout` passes: for a step with nothing to run
        while requests wait for their blocks."""
        self._progress.wait(timeout)

    def install_finished(self, pool: BlockPool, keep_free: int = 0) -> int:
        """Turns the blocks of every finished load into cached blocks of the pool (least recently used ones
        evicted for them, `keep_free` blocks left free); returns how many. A block someone computed meanwhile
        is not installed twice."""
        self._progress.clear()
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

    # -- threads --------------------------------------------------------------------------------
    def _load_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            try:
                self._load(job)
            except Exception:                       # noqa: BLE001 - a load that fails is a miss, never an outage
                log.exception("KV tier: a load failed")
            finally:
                job.seconds = time.monotonic() - job.started
                job.done.set()
                self._progress.set()

    def _load(self, job: LoadJob) -> None:
        data = torch.empty((len(job.hashes), *self.block_shape), dtype=self.dtype)
        raw = data.view(-1).view(torch.uint8).numpy().reshape(len(job.hashes), -1)
        parent = job.parent
        for i, h in enumerate(job.hashes):
            if job.cancelled or not self._read_one(h, parent, job.token_ids[i], memoryview(raw[i]), job):
                break
            job.count += 1
            parent = h
        job.data = data

    def _read_one(self, block_hash: BlockHash, parent: BlockHash, tokens: tuple[int, ...], out: memoryview,
                  job: LoadJob) -> bool:
        with self._written:             # evicted a moment ago: its write comes first
            while block_hash in self._queued and not job.cancelled:
                self._written.wait(0.1)
        for backend in self.backends:
            if not backend.contains(block_hash):
                continue
            header = backend.read(block_hash, len(tokens), out)
            if header is None:
                continue
            if header.parent != parent or header.token_ids != tokens:
                backend.reject(block_hash, "its parent or token ids are not the prompt's")
                continue
            self.bytes_read += header.size + len(out)
            return True
        return False

    def _write_loop(self) -> None:
        shared = [b for b in self.backends if b.shared]
        next_scan = time.monotonic() + SCAN_INTERVAL_S
        while True:
            item: _Writes | _Deletes | None = _Deletes([])
            try:
                item = self._writes.get(timeout=max(0.0, next_scan - time.monotonic()) if shared else None)
            except queue.Empty:
                pass                                # time to scan
            if item is None:
                return
            try:
                self._write(item) if isinstance(item, _Writes) else self._delete(item)
            except Exception:                       # noqa: BLE001 - the tier is a cache: log, go on
                log.exception("KV tier: %s failed", type(item).__name__)
            if shared and time.monotonic() >= next_scan:
                for b in shared:
                    b.scan()
                next_scan = time.monotonic() + SCAN_INTERVAL_S

    def _write(self, job: _Writes) -> None:
        left = list(reversed(job.records))          # each leaves the queue once written (or failed)
        try:
            raw = job.data.view(len(job.records), -1).view(torch.uint8).numpy()
            for i, r in enumerate(job.records):
                payload = memoryview(raw[i])
                header = Header(self.namespace, r.block_hash, r.parent, r.token_ids, len(payload), checksum(payload))
                for backend in self.backends:
                    written = backend.write(header, payload)
                    self.bytes_written += written
                    self.blocks_written += written > 0
                self._dequeue([left.pop()])
        finally:
            self._dequeue(left)

    def _dequeue(self, records: list[_Record]) -> None:
        with self._written:
            for r in records:
                self._queued.discard(r.block_hash)
                self._queued_bytes -= self.block_bytes
            self._written.notify_all()

    def _delete(self, job: _Deletes) -> None:
        for h in job.hashes:
            for backend in self.backends:
                backend.delete(h)

    def close(self) -> None:
        """Writes what is queued (CLOSE_FLUSH_S at most: the pinned prefixes a restart will want), then stops."""
        self.capture()
        for job in self._jobs:
            job.cancelled = True
        self._reads.put(None)
        self._writes.put(None)
        self._writer.join(CLOSE_FLUSH_S)
        self._loader.join(1.0)
        if self._writer.is_alive():
            log.warning("KV tier: writes still queued after %.0f s at shutdown; left undone", CLOSE_FLUSH_S)

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
            "read_bytes": KVStat("counter", self.bytes_read, "Bytes read from the tier (verified blocks)"),
            "written_bytes": KVStat("counter", self.bytes_written, "Bytes written to the tier (every backend)"),
            "written_blocks": KVStat("counter", self.blocks_written, "Block files written to the tier"),
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
