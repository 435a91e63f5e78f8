"""TierIO: the KV tier's two threads, and the little they share with the engine thread.

    writer thread   block copies (captured by the engine) -> encode, checksum, write to every backend;
                    deletions; every SCAN_INTERVAL_S a shared directory listed again
    loader thread   LoadJobs -> read each block from the first backend that has it, verify it against the
                    asking prompt (parent hash, token ids), into the job's host buffer; then `done`

Shared, under `_lock`: the hashes queued for writing and their bytes (bounded by WRITE_QUEUE_BYTES). A load
that wants a block still queued waits for its write (`_written`), so an evicted block is a hit at once.
No torch compute runs here (the engine thread owns the OpenMP team): the threads only allocate buffers and
move bytes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.kv.block_pool import Block, BlockHash
from engine.kv.tier.disk import DiskBackend
from engine.kv.tier.format import Header, checksum

log = logging.getLogger(__name__)
WRITE_QUEUE_BYTES = 256 * 2**20    # block copies waiting for the writer thread, at most
SCAN_INTERVAL_S = 2.0              # how often a shared directory is listed again for other replicas' blocks
CLOSE_FLUSH_S = 10.0               # what close() waits for queued writes (the pinned prefixes among them)


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
class Record:
    """A block to write: its identity (its bytes travel beside it, captured by the engine thread)."""

    block_id: int
    block_hash: BlockHash
    parent: BlockHash
    token_ids: tuple[int, ...]


@dataclass
class _Writes:
    """Captured blocks for the writer: data[i] is records[i]'s K|V."""

    records: list[Record]
    data: torch.Tensor


@dataclass
class _Deletes:
    hashes: list[BlockHash]


class TierIO:
    def __init__(self, backends: Sequence[DiskBackend], namespace: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.backends = list(backends)
        self.namespace = namespace
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_bytes = torch.empty(block_shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        self._lock = threading.Lock()
        self._queued: set[BlockHash] = set()
        self._queued_bytes = 0
        self._written = threading.Condition(self._lock)     # notified as queued blocks are written
        self.progress = threading.Event()                   # set as loads finish
        self.bytes_read = self.bytes_written = self.blocks_written = 0     # each counted by one thread
        self._writes: queue.SimpleQueue[_Writes | _Deletes | None] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-load", daemon=True)
        self._writer.start()
        self._loader.start()

    # -- any thread ---------------------------------------------------------------------------
    def queued(self, block_hash: BlockHash) -> bool:
        return block_hash in self._queued                  # NOTE: a set read: atomic under the GIL

    def stored(self, block_hash: BlockHash) -> bool:
        return any(b.contains(block_hash) for b in self.backends)

    def touch(self, block_hash: BlockHash) -> None:
        for b in self.backends:
            b.touch(block_hash)

    def reserve(self, block_hash: BlockHash) -> bool:
        """Room in the write queue for one more block (False: none; it is not written)."""
        with self._lock:
            if self._queued_bytes + self.block_bytes > WRITE_QUEUE_BYTES:
                return False
            self._queued.add(block_hash)
            self._queued_bytes += self.block_bytes
            return True

    def write(self, records: list[Record], data: torch.Tensor) -> None:
        """Hands reserved blocks and their bytes ([n, *block_shape], on the host) to the writer."""
        self._writes.put(_Writes(records, data))

    def delete(self, hashes: list[BlockHash]) -> None:
        self._writes.put(_Deletes(hashes))

    def load(self, job: LoadJob) -> None:
        self._reads.put(job)

    def drain(self, timeout: float) -> bool:
        """Waits until every reserved block is written; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._written:
            while self._queued and (left := deadline - time.monotonic()) > 0:
                self._written.wait(left)
            return not self._queued

    def close(self) -> None:
        """Writes what is queued (CLOSE_FLUSH_S at most: the pinned prefixes a restart will want), then stops."""
        self._reads.put(None)
        self._writes.put(None)
        self._writer.join(CLOSE_FLUSH_S)
        self._loader.join(1.0)
        if self._writer.is_alive():
            log.warning("KV tier: writes still queued after %.0f s at shutdown; left undone", CLOSE_FLUSH_S)

    # -- the loader thread --------------------------------------------------------------------
    def _load_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            try:
                self._load(job)
            except Exception:                       # noqa: BLE001 - a load that fails is a miss, never an outage
                log.exception("KV tier: a load failed")
            finally:
                job.seconds = time.monotonic() - job.started
                job.done.set()
                self.progress.set()

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

    # -- the writer thread --------------------------------------------------------------------
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

    def _dequeue(self, records: list[Record]) -> None:
        with self._written:
            for r in records:
                self._queued.discard(r.block_hash)
                self._queued_bytes -= self.block_bytes
            self._written.notify_all()

    def _delete(self, job: _Deletes) -> None:
        for h in job.hashes:
            for backend in self.backends:
                backend.delete(h)


__all__ = ["LoadJob", "Record", "TierIO"]
