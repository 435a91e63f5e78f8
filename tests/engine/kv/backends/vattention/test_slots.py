"""SlotTable (vAttention slots) and the block manager's placement preference: exact slots, exact blocks."""
from __future__ import annotations

from engine.kv.backends.vattention.slots import SlotTable
from engine.kv.block_manager import BlockManager, PrefixHit
from engine.kv.block_pool import BlockPool


def test_a_new_sequence_takes_the_free_slot_that_already_maps_its_hits() -> None:
    t = SlotTable(num_slots=3, pages_per_slot=4)
    for j, b in enumerate([7, 8, 9]):
        t.set_mapped(1, j, b)
    t.set_mapped(2, 0, 7)
    assert t.attach(seq_id=100, block_ids=[7, 8]) == 1        # two pages in place beat one
    assert t.attach(seq_id=101, block_ids=[7, 5]) == 2        # one beats none
    assert t.attach(seq_id=102, block_ids=[7]) == 0           # the only one left
    assert t.slot_of == {100: 1, 101: 2, 102: 0}


def test_ties_go_to_the_slot_freed_last() -> None:
    t = SlotTable(num_slots=4, pages_per_slot=2)
    for seq in (1, 2, 3):
        t.attach(seq, [])
    t.detach(3)
    t.detach(1)
    t.detach(2)
    assert [t.attach(s, []) for s in (4, 5, 6, 7)] == [1, 0, 2, 3]    # never-used slot 3 comes last


def test_the_table_doubles_when_every_slot_is_held() -> None:
    t = SlotTable(num_slots=2, pages_per_slot=2)
    assert [t.attach(s, []) for s in range(3)] == [0, 1, 2]
    assert t.num_slots == 4 and list(t.free) == [3]


def test_detach_keeps_the_mappings_and_preferred_names_them() -> None:
    t = SlotTable(num_slots=1, pages_per_slot=3)
    t.attach(1, [])
    t.set_mapped(0, 0, 4)
    t.set_mapped(0, 1, 6)
    t.detach(1)
    assert t.num_mapped == 2 and t.mapped[0] == [4, 6, -1]    # deferred reclamation
    t.attach(2, [])
    assert [t.preferred(2, j) for j in range(4)] == [4, 6, None, None]
    assert t.missing(0, [4, 5, 9]) == [(1, 5), (2, 9)]


def test_reclaimable_lists_free_slots_first_then_tails_of_busy_ones() -> None:
    t = SlotTable(num_slots=3, pages_per_slot=4)
    assert [t.attach(s, []) for s in (1, 2, 3)] == [0, 1, 2]
    t.detach(2)
    t.detach(3)                                               # slot 1 freed before slot 2
    for j in range(3):                                        # slot 0: busy, uses 1 page, maps 3
        t.set_mapped(0, j, j)
    t.set_mapped(1, 2, 9)
    t.set_mapped(2, 0, 8)
    assert t.reclaimable({0: 1}) == [(1, 0, 4), (2, 0, 4), (0, 1, 3)]
    for run in t.reclaimable({0: 1}):
        t.clear(*run)
    assert t.num_mapped == 1 and t.reclaimable({0: 1}) == []


def test_the_manager_allocates_the_block_already_mapped_in_place_when_it_is_free_and_unhashed() -> None:
    pool = BlockPool(8)
    slots = SlotTable(num_slots=2, pages_per_slot=4)
    manager = BlockManager(pool, block_size=4, fingerprint="fp", placement=slots)
    tokens = list(range(10))
    assert manager.allocate(1, tokens, PrefixHit((), 0), 10)
    assert manager.block_table(1) == [0, 1, 2] and slots.slot_of[1] == 0
    for j, b in enumerate(manager.block_table(1)):
        slots.set_mapped(0, j, b)
    manager.commit(1, tokens, 10)                             # blocks 0 and 1 are full: hashed
    manager.free(1)                                           # LRU queue: 2 (unhashed, head) ... 1, 0 (tail)
    assert pool.free_queue.ids()[:1] == [2] and pool.free_queue.ids()[-2:] == [1, 0]
    other = [100 + t for t in range(10)]
    assert manager.allocate(2, other, PrefixHit((), 0), 10)   # slot 0 again: it maps 0, 1, 2
    # page 0 and 1: their mapped blocks hold cached content, so the LRU head is taken instead; page 2:
    # block 2 is mapped there, free and unhashed, so it is reused and needs no new mapping.
    table = manager.block_table(2)
    assert slots.slot_of[2] == 0 and table[2] == 2 and 0 not in table and 1 not in table
    assert table[:2] == [3, 4]


def test_a_fork_gets_its_own_slot_that_maps_its_parents_blocks() -> None:
    pool = BlockPool(8)
    slots = SlotTable(num_slots=2, pages_per_slot=4)
    manager = BlockManager(pool, block_size=4, fingerprint="fp", placement=slots)
    assert manager.allocate(1, list(range(6)), PrefixHit((), 0), 6)
    manager.fork(1, 2)
    assert slots.slot_of == {1: 0, 2: 1}
    assert manager.block_table(2) == manager.block_table(1) == [0, 1]
    manager.free(1)
    manager.free(2)
    assert slots.slot_of == {} and pool.num_free == 8
