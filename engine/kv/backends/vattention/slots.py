"""Slots of the vAttention KV backend: which sequence holds which virtual range, what each range has mapped.

Standard library only (like the block pool), so its rules are tested without torch or mmap.

A slot is one request's virtually contiguous KV range: page j of slot s holds positions
[j * block_size, (j + 1) * block_size) of its sequence, and a *page* is a block of the block pool (one
physical page holding those tokens' K and V in every layer). `mapped[s][j]` is the block actually mapped
at page j of slot s, or -1: it is what the kernel's page tables say, kept here so that a mapping is made
only where it differs from what the step needs.

Deferred reclamation (vAttention's): a sequence that ends leaves its slot with its pages still mapped.
The next sequence put in the slot needs no mapping where the same block comes back at the same place:
- a new sequence takes the free slot whose mapped pages match the longest run of its prefix-cache hits
  (a popular system prompt finds a slot that already maps it); ties go to the slot freed last, whose
  pages are the likeliest to be still free (and a small set of hot slots holds few mappings);
- a block the manager allocates for page j is the one already mapped there when that block is free and
  holds no cached content (`preferred`), so nothing the prefix cache could still hit is evicted early.
Mappings are never undone on the request path; `reclaimable` lists stale ones for when the process
runs short of mappings (vm.max_map_count).

Runs: a *run* is a stretch of pages j, j + 1, ... of one slot mapping blocks b, b + 1, ...: the kernel
merges it into one memory mapping (VMA), so runs, not pages, are what the mapping limit counts
(`num_runs`, kept up to date by `set_mapped` from the two neighbours of the page it changes).
"""
from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    def __init__(self, num_slots: int, pages_per_slot: int) -> None:
        assert num_slots >= 1 and pages_per_slot >= 1
        self.pages_per_slot = pages_per_slot
        self.mapped: list[list[int]] = []
        self.slot_of: dict[int, int] = {}                  # seq_id -> slot
        self.free: OrderedDict[int, None] = OrderedDict()  # free slots, freed last first
        self.num_mapped = 0                                # entries of `mapped` that are not -1
        self.num_runs = 0                                  # runs of consecutive blocks in `mapped` (module doc)
        self.grow(num_slots)

    @property
    def num_slots(self) -> int:
        return len(self.mapped)

    def grow(self, num_slots: int) -> None:
        """More slots (never fewer); the new ones are free and map nothing."""
        for s in range(len(self.mapped), num_slots):
            self.mapped.append([-1] * self.pages_per_slot)
            self.free[s] = None                            # new slots go last: used after the warm ones

    # -- the block manager's side (engine/block_manager.Placement) --------------------------------
    def attach(self, seq_id: int, block_ids: list[int]) -> int:
        """Give a sequence starting with `block_ids` (its prefix-cache hits, or a fork's parent's blocks) a
        slot: the free one that already maps most of them in place. With none free, the table doubles."""
        assert seq_id not in self.slot_of, f"sequence {seq_id} already has a slot"
        if not self.free:
            self.grow(2 * self.num_slots)
        best, best_run = next(iter(self.free)), -1
        for s in self.free:
            row, run = self.mapped[s], 0
            while run < len(block_ids) and row[run] == block_ids[run]:
                run += 1
            if run > best_run:
                best, best_run = s, run
                if run == len(block_ids):
                    break
        del self.free[best]
        self.slot_of[seq_id] = best
        return best

    def detach(self, seq_id: int) -> None:
        """The sequence gave its blocks back: its slot is free, its mappings stay (deferred reclamation)."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free[slot] = None
            self.free.move_to_end(slot, last=False)

    def preferred(self, seq_id: int, index: int) -> int | None:
        """The block mapped at page `index` of the sequence's slot (a candidate to allocate there)."""
        slot = self.slot_of.get(seq_id)
        if slot is None or index >= self.pages_per_slot:
            return None
        block = self.mapped[slot][index]
        return block if block >= 0 else None

    # -- the mapper's side ----------------------------------------------------------------------
    def set_mapped(self, slot: int, index: int, block: int) -> None:
        row = self.mapped[slot]
        before = _starts(row, index) + _starts(row, index + 1)
        self.num_mapped += (block >= 0) - (row[index] >= 0)
        row[index] = block
        self.num_runs += _starts(row, index) + _starts(row, index + 1) - before

    def runs(self, slot: int) -> list[tuple[int, int, int]]:
        """What a slot maps, as runs (first page, first block, page count)."""
        row = self.mapped[slot]
        return runs_of([(j, b) for j, b in enumerate(row) if b >= 0])

    def runs_delta(self, slot: int, changes: list[tuple[int, int]]) -> int:
        """How `num_runs` would change if (page, block) `changes` were made in `slot`: only the pages around
        them can start or stop a run, so only that window is counted."""
        if not changes:
            return 0
        row = self.mapped[slot]
        lo = max(0, min(j for j, _ in changes) - 1)
        hi = min(len(row), max(j for j, _ in changes) + 2)
        window = row[lo:hi]
        after = list(window)
        for j, b in changes:
            after[j - lo] = b
        return _count_runs(after) - _count_runs(window)

    def missing(self, slot: int, block_ids: list[int]) -> list[tuple[int, int]]:
        """(page index, block) of the pages a slot must map to hold `block_ids` from page 0."""
        row = self.mapped[slot]
        return [(j, b) for j, b in enumerate(block_ids) if row[j] != b]

    def reclaimable(self, lengths: dict[int, int]) -> list[tuple[int, int, int]]:
        """Stale mappings as (slot, first page, page count) runs, the most stale first: whole free
        slots (freed longest ago first), then the pages of busy slots past their sequence's blocks
        (`lengths`: slot -> blocks in use)."""
        out: list[tuple[int, int, int]] = []
        for s in reversed(self.free):
            if any(b >= 0 for b in self.mapped[s]):
                out.append((s, 0, self.pages_per_slot))
        for s, used in lengths.items():
            row = self.mapped[s]
            if any(b >= 0 for b in row[used:]):
                out.append((s, used, self.pages_per_slot - used))
        return out

    def clear(self, slot: int, first: int, count: int) -> None:
        for j in range(first, first + count):
            self.set_mapped(slot, j, -1)


def _starts(row: list[int], j: int) -> int:
    """1 if a run starts at page j of `row` (mapped, and not the next block after page j - 1's)."""
    if j >= len(row) or row[j] < 0:
        return 0
    return int(j == 0 or row[j - 1] < 0 or row[j - 1] + 1 != row[j])


def _count_runs(row: list[int]) -> int:
    return sum(_starts(row, j) for j in range(len(row)))


def runs_of(pages: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(page, block) pairs, pages ascending, as runs (first page, first block, count): one mmap call each."""
    out: list[tuple[int, int, int]] = []
    for j, b in pages:
        if out and out[-1][0] + out[-1][2] == j and out[-1][1] + out[-1][2] == b:
            first, block, count = out[-1]
            out[-1] = (first, block, count + 1)
        else:
            out.append((j, b, 1))
    return out


__all__ = ["SlotTable", "runs_of"]
