"""The vAttention KV cache (kv_backend="vattention"): each sequence's KV virtually contiguous, physical
pages mapped on demand, and shared between sequences by mapping one page at several addresses.

Memory (vmm.py does the mapping, reservation.py holds the virtual range):

    physical pool   num_blocks pages; page b is block b of the block pool:
                    [block_size tokens, K|V, num_layers, num_kv_heads, head_dim]
    virtual         one reservation [num_slots, slot_len, K|V, num_layers, num_kv_heads, head_dim]
                    (slot_len = pages_per_slot * block_size >= max_model_len); page j of slot s holds
                    positions [j * block_size, (j + 1) * block_size) of the sequence in slot s

Per layer, K (and V) is the strided view [num_slots, slot_len, num_kv_heads, head_dim] of that
reservation: position p of the sequence in slot s is row (s, p), with no block table. The layout is
token-major (a token's K and V rows of every layer are adjacent) so that one page holds whole tokens
for every layer and one mapping serves all layers: a mapping is a kernel VMA, a process has 65,530 of
them (vm.max_map_count), and per-layer pages would spend 2 x num_layers of them per block (60 for
SmolLM2), which the CPU's 4 KiB pages turn into a hard limit long before memory runs out.
A page's bytes, block_size x 2 x layers x heads x head_dim x dtype, must be a whole number of OS pages:
`page_block_size` rounds the block size up to the smallest size that makes it so (16 stays 16 for
SmolLM2 in fp32: 720 KiB pages).

Prefix sharing is physical: a prefix-cache hit (or a fork's shared prompt) maps the cached blocks'
pages into the new sequence's slot, so one page is seen at two virtual addresses; copy-on-write of a
fork's partial page copies the physical page. Hashes, ref counts, pins and the LRU are the block pool's,
page for block, unchanged.

Mapping off the critical path (vAttention's overlap): a decoding sequence about to fill its last page
gets its next block early (EngineCore grows it `map_ahead_tokens` ahead), and `addressing` hands pages a
step does not read yet to a mapper thread, which maps them while the forward pass runs. Pages a step
needs that are not mapped yet are mapped synchronously and counted (`sync_maps`); slots keep their
mappings when their sequence ends (deferred reclamation, slots.py).

Mappings are bounded (`max_mappings`, of the process's vm.max_map_count): each run of consecutive pages
costs at most two memory mappings (itself, and the PROT_NONE piece beside it), the reservation one more.
Before a step maps anything, `addressing` counts what it would hold afterwards; over the limit it undoes
stale mappings, then drops the mapping ahead, then refuses the last sequences of the batch (KVRefused:
their requests end with HTTP 507, nothing of the step was done). It never starts a mapping it cannot
finish within the limit.

Failures leave the cache consistent: `slots.mapped` says exactly what the kernel maps, the rest of the
reservation is PROT_NONE (vmm.py puts it back when a call fails), and the views see a whole reservation
(reservation.py moves them only once a bigger one is complete). Where PROT_NONE cannot be put back
(vmm.ReservationDamaged), the cache marks itself failed (`failure`): every later step raises EngineDead,
which the service reports (HTTP 503, /health).

NOTE: ownership. `SlotTable` is touched only on the engine thread; the mapper thread only makes
mmap calls on pages `addressing` gave it, and `addressing` waits for it before reading the table.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from engine.errors import EngineDead, KVRefused
from engine.kv.backends.base import Addressing, KVStat, StepTables, read_layer_major, write_layer_major
from engine.kv.backends.vattention.reservation import Reservation
from engine.kv.backends.vattention.slots import SlotTable, runs_of
from engine.kv.backends.vattention.vmm import OS_PAGE_BYTES, HostVirtualMemory, ReservationDamaged, map_areas_left
from engine.kv.block_manager import Placement
from engine.models.llama import ModelArgs

log = logging.getLogger(__name__)
Changes = dict[int, list[tuple[int, int]]]      # slot -> (page, block) to map there


def page_block_size(args: ModelArgs, dtype: torch.dtype, block_size: int) -> int:
    """The smallest multiple of the granule >= block_size whose page is a whole number of OS pages."""
    token_bytes = 2 * args.num_layers * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
    granule = OS_PAGE_BYTES // math.gcd(OS_PAGE_BYTES, token_bytes)
    return -(-block_size // granule) * granule


@dataclass
class _Need:
    """What one sequence of a step needs mapped."""

    seq_id: int
    slot: int
    now: list[tuple[int, int]]      # (page, block) the step reads or writes: mapped before it runs
    ahead: list[tuple[int, int]]    # (page, block) past the step's tokens: mapped by the mapper thread
    reused: int                     # pages the step needs that are mapped in place already
    decode: bool


class VAttentionCache:
    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 max_model_len: int, num_slots: int, *, ahead_tokens: int = 0, max_mappings: int) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError("kv_backend='vattention' runs on the CPU only for now (its CUDA VMM implementation "
                             "is not written yet); use kv_backend='paged' on GPUs")
        assert page_block_size(args, dtype, block_size) == block_size, "use page_block_size()"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.dims = (2, args.num_layers, args.num_kv_heads, args.head_dim)      # one token's row
        self.page_bytes = block_size * math.prod(self.dims) * torch.empty((), dtype=dtype).element_size()
        self.pages_per_slot = -(-max_model_len // block_size)
        self.slot_len = self.pages_per_slot * block_size
        self.vm = HostVirtualMemory(num_blocks, self.page_bytes)
        phys = self.vm.physical_view(dtype).view(num_blocks, block_size, *self.dims)
        self.pages = phys                                     # [num_blocks, block_size, 2, L, Hkv, D]
        # the pool seen as a paged cache [L, num_blocks, block_size, Hkv, D] (tests, copies)
        self.key = phys[:, :, 0].permute(2, 0, 1, 3, 4)
        self.value = phys[:, :, 1].permute(2, 0, 1, 3, 4)
        self.slots = SlotTable(num_slots, self.pages_per_slot)
        self.placement: Placement | None = self.slots     # a sequence's blocks go where its slot maps them
        self.ahead_tokens = ahead_tokens
        self.limit = min(max_mappings, map_areas_left())     # memory mappings this cache may hold
        self.failure: str | None = None                       # why the cache is broken for good, if it is
        self.range = Reservation(self.vm, num_slots, self.pages_per_slot, block_size, self.dims, dtype)
        self._mapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vattention-map")
        self._pending: tuple[Future[tuple[list[int], str | None]], list[tuple[int, int, int, int]]] | None = None
        self.sync_maps = self.decode_stalls = self.ahead_maps = self.reused_pages = self.reclaimed_pages = 0
        self.refused_seqs = 0
        self.sync_map_seconds = 0.0

    # -- virtual memory ---------------------------------------------------------------------------
    @property
    def key_virtual(self) -> torch.Tensor:
        return self.range.key

    @property
    def value_virtual(self) -> torch.Tensor:
        return self.range.value

    def _page_addr(self, slot: int, page: int) -> int:
        return self.range.page_addr(slot, page)

    def map_areas(self, runs: int | None = None) -> int:
        """Memory mappings the cache holds (with `runs` runs mapped instead of the table's): two per run at
        most, one for the reservation, and those of old reservations not gone yet (still viewed, or leaked)."""
        return 2 * (self.slots.num_runs if runs is None else runs) + 1 + self.range.retired_areas()

    def _fail(self, reason: str) -> NoReturn:
        self.failure = reason
        log.error("the vAttention KV cache is broken: %s", reason)
        raise EngineDead(f"the vAttention KV cache is broken ({reason}); restart the server")

    def _refuse(self, seq_ids: list[int], why: str) -> KVRefused:
        self.refused_seqs += len(seq_ids)
        return KVRefused(f"the vAttention KV cache cannot map this request's pages: {why}", seq_ids)

    def _grow(self, newcomers: list[int]) -> None:
        """Moves to a reservation of every slot the table has (the busy slots' pages mapped again in place, the
        free slots' stale mappings left behind), or refuses `newcomers` (the sequences in the new slots) with
        nothing changed."""
        num_slots = self.slots.num_slots
        busy = {s for s in self.slots.slot_of.values() if s < self.range.num_slots}
        runs = [(s, j, b, k) for s in sorted(busy) for j, b, k in self.slots.runs(s)]
        cost = 2 * len(runs) + 1                                # the new reservation, beside the old one
        if self.map_areas() + cost > self.limit:
            raise self._refuse(newcomers, f"{num_slots} slots would take more than the limit of {self.limit} memory "
                                          "mappings (--kv-max-mappings); retry later")
        old_slots = self.range.num_slots
        try:
            self.range.move(num_slots, runs, cost, 2 * self.slots.num_runs + 1)
        except (OSError, ReservationDamaged) as exc:
            raise self._refuse(newcomers, f"moving to {num_slots} slots failed ({exc})") from exc
        for s in range(old_slots):
            if s not in busy:
                self.slots.clear(s, 0, self.pages_per_slot)     # left behind with the old range

    # -- one step ---------------------------------------------------------------------------------
    def layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_virtual, self.value_virtual

    def addressing(self, seq_ids: list[int], tables: StepTables, seq_lens: list[int],
                   seq_of_token: np.ndarray, positions: np.ndarray, decoding: list[bool]) -> Addressing:
        """Maps what the step reads (synchronously where not done yet), hands what it does not read yet to
        the mapper; returns each new token's row in the flattened [num_slots * slot_len] view, and the slots."""
        if self.failure is not None:
            raise EngineDead(f"the vAttention KV cache is broken ({self.failure}); restart the server")
        self._finish_ahead()
        slots = [self.slots.slot_of[sid] for sid in seq_ids]
        if max(slots) >= self.range.num_slots:              # forks outnumbered the slots: the table grew
            self._grow([sid for sid, s in zip(seq_ids, slots) if s >= self.range.num_slots])
        needs = []
        rows = list(tables)                                 # each sequence's block ids
        for sid, slot, table, n, dec in zip(seq_ids, slots, rows, seq_lens, decoding):
            needed, missing = -(-n // self.block_size), self.slots.missing(slot, table)
            now = [(j, b) for j, b in missing if j < needed]
            needs.append(_Need(sid, slot, now, [(j, b) for j, b in missing if j >= needed], needed - len(now), dec))
        ahead = self._fit(needs, {slot: len(table) for slot, table in zip(slots, rows)})
        t0 = time.perf_counter()
        try:
            for need in needs:
                self.reused_pages += need.reused
                self._map_now(need)
        finally:
            self.sync_map_seconds += time.perf_counter() - t0
        jobs = [(slot, j, b, k) for slot, pages in ahead.items() for j, b, k in runs_of(pages)]
        if jobs:
            for slot, j, b, k in jobs:                      # recorded now; undone if the mapper fails
                for i in range(k):
                    self.slots.set_mapped(slot, j + i, b + i)
            self._pending = (self._mapper.submit(self._map_all, [(self._page_addr(s, j), b, k) for s, j, b, k in jobs]),
                             jobs)
        kv_rows = np.asarray(slots, dtype=np.int64)[seq_of_token] * self.slot_len + positions
        return Addressing(kv_rows, None, slots)

    def _fit(self, needs: list[_Need], busy: dict[int, int]) -> Changes:
        """Makes the step's mappings fit the limit, or raises KVRefused: undoes stale mappings if that helps,
        then gives up mapping ahead, then refuses sequences from the end of the batch (the youngest).
        Returns the mappings ahead to make."""
        def delta(changes: Changes) -> int:
            return sum(self.slots.runs_delta(slot, pages) for slot, pages in changes.items())

        def fits(changes: Changes) -> bool:
            d = delta(changes)
            return d <= 0 or self.map_areas(self.slots.num_runs + d) <= self.limit
        now = {n.slot: n.now for n in needs}
        both = {n.slot: n.now + n.ahead for n in needs}
        if not fits(both):
            self._reclaim(max(0, delta(both)), busy)
        if fits(both):
            return {n.slot: n.ahead for n in needs if n.ahead}
        if fits(now):
            return {}
        refused: list[int] = []
        runs = self.slots.num_runs + delta(now)
        for n in reversed(needs):
            if self.map_areas(runs) <= self.limit:
                break
            d = self.slots.runs_delta(n.slot, n.now)
            if d > 0:
                refused.append(n.seq_id)
                runs -= d
        raise self._refuse(refused, f"it would take more than the limit of {self.limit} memory mappings "
                                    f"(--kv-max-mappings; {self.map_areas()} in use); fewer samples (n, "
                                    "best_of) or a shorter prompt need fewer, or retry later")

    def _map_now(self, need: _Need) -> None:
        for j, b, k in runs_of(need.now):
            try:
                self.vm.map(self._page_addr(need.slot, j), b, k)
            except OSError as exc:                          # those pages are PROT_NONE again
                self.slots.clear(need.slot, j, k)
                raise self._refuse([need.seq_id], f"mapping failed ({exc})") from exc
            except ReservationDamaged as exc:
                self._fail(str(exc))
            for i in range(k):
                self.slots.set_mapped(need.slot, j + i, b + i)
            self.sync_maps += k
            self.decode_stalls += k * need.decode

    def _map_all(self, jobs: list[tuple[int, int, int]]) -> tuple[list[int], str | None]:
        """On the mapper thread: map each (address, first page, count); returns the jobs that failed (their
        range PROT_NONE again), and why the reservation is damaged if it is."""
        failed = []
        for i, (addr, page, count) in enumerate(jobs):
            try:
                self.vm.map(addr, page, count)
            except OSError:
                failed.append(i)
            except ReservationDamaged as exc:
                return failed + [i], str(exc)
        return failed, None

    def _finish_ahead(self) -> None:
        if self._pending is None:
            return
        fut, jobs = self._pending
        self._pending = None
        failed, damaged = fut.result()
        if damaged is not None:
            self._fail(damaged)
        undone = set(failed)
        for i, (slot, j, _, k) in enumerate(jobs):
            if i in undone:
                self.slots.clear(slot, j, k)                # mapped synchronously when a step needs it
            else:
                self.ahead_maps += k

    def _reclaim(self, wanted: int, busy: dict[int, int]) -> None:
        """Undo stale mappings, the most stale first, until `wanted` new runs fit the limit with room."""
        goal = (int(self.limit * 0.75) - 1 - self.range.retired_areas()) // 2 - wanted
        for slot, first, count in self.slots.reclaimable(busy):
            if self.slots.num_runs <= goal:
                break
            try:
                self.vm.unmap(self._page_addr(slot, first), count * self.page_bytes)
            except ReservationDamaged as exc:
                self._fail(str(exc))
            before = self.slots.num_mapped
            self.slots.clear(slot, first, count)
            self.reclaimed_pages += before - self.slots.num_mapped

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: whole physical pages (every layer's K and V) src -> dst."""
        if pairs:
            self.pages[torch.tensor([d for _, d in pairs])] = self.pages[torch.tensor([s for s, _ in pairs])]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """From the physical pages (through their layer-major view): a block need not be mapped anywhere."""
        return read_layer_major(self.key, self.value, block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        write_layer_major(self.key, self.value, block_ids, data)

    def stats(self, blocks_of: Callable[[int], int]) -> dict[str, KVStat]:
        live = sum(blocks_of(seq_id) for seq_id in self.slots.slot_of)
        return {
            "page_bytes": KVStat("gauge", self.page_bytes, "Bytes of one page (block_size tokens, all layers)"),
            "num_slots": KVStat("gauge", self.range.num_slots, "vAttention slots reserved (virtual address space)"),
            "busy_slots": KVStat("gauge", len(self.slots.slot_of), "vAttention slots held by a sequence"),
            "mapped_pages": KVStat("gauge", self.slots.num_mapped, "vAttention page mappings in place (in use and "
                                   "kept for reuse)"),
            "live_pages": KVStat("gauge", live, "Of those, pages the sequences holding slots use"),
            "sync_maps": KVStat("counter", self.sync_maps, "Pages mapped on the critical path (a step needed them "
                                "unmapped)"),
            "decode_stalls": KVStat("counter", self.decode_stalls, "Of those, the page of a decoding request's next "
                                    "token (mapping ahead should make this 0)"),
            "ahead_maps": KVStat("counter", self.ahead_maps, "Pages mapped ahead of need by the mapper thread, "
                                 "during a forward pass"),
            "reused_pages": KVStat("counter", self.reused_pages, "Pages a step needed that were already mapped in "
                                   "place"),
            "reclaimed_pages": KVStat("counter", self.reclaimed_pages, "Stale mappings undone for want of mappings "
                                      "(vm.max_map_count)"),
            "sync_map_seconds": KVStat("counter", self.sync_map_seconds, "Seconds spent mapping pages on the "
                                       "critical path"),
            "map_areas": KVStat("gauge", self.map_areas(), "Memory mappings (kernel VMAs) the vAttention cache holds, "
                                "at most"),
            "mapping_limit": KVStat("gauge", self.limit, "Memory mappings the vAttention cache may hold "
                                    "(--kv-max-mappings, or less if the process has fewer left)"),
            "refused_seqs": KVStat("counter", self.refused_seqs, "Sequences refused (HTTP 507) because their pages "
                                   "could not be mapped within the limit"),
            "failed": KVStat("gauge", float(self.failure is not None), "1 once the vAttention cache is broken for "
                             "good (requests answer 503, /health too)"),
        }

    def close(self) -> None:
        try:
            self._finish_ahead()
        except EngineDead:
            pass                                            # broken already: nothing left to finish
        self._mapper.shutdown(wait=True)


__all__ = ["VAttentionCache", "page_block_size"]
