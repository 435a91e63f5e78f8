"""Block pool: exact block ids, eviction order, hashes, pins (stdlib only: runs in milliseconds)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.kv.block_pool import (
    BlockPool,
    FreeBlockQueue,
    PinCapError,
    PinShareError,
    hash_block,
    hash_blocks,
    root_hash,
)


def test_allocate_takes_lowest_ids_first_and_free_returns_to_tail() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.free_queue.ids() == [3, 4, 5]
    for b, h in zip(a, [b"x" * 32, b"y" * 32, b"z" * 32]):
        pool.cache_full_block(b, h, [b.block_id])  # type: ignore[arg-type]
    pool.free(a)
    # reverse order: the sequence's tail block (2) is evicted before its head (0)
    assert pool.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(4)] == [3, 4, 5, 2]


def test_unhashed_blocks_go_to_the_head_of_the_queue() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_full_block(a[0], hash_block(root_hash("m"), [1, 2]), [1, 2])
    pool.free(a)  # block 1 is a private partial block: nothing to keep, evicted first
    assert pool.free_queue.ids() == [1, 2, 3, 0]


def test_lazy_eviction_keeps_hash_until_memory_reused() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = hash_block(root_hash("m"), [7, 8])
    pool.cache_full_block(b, h, [7, 8])
    pool.free([b])
    assert pool.lookup(h, [7, 8]) is b           # still findable while free
    assert pool.stats().cached == 1
    pool.touch([b])                              # a hit takes it out of the queue
    assert b.ref_count == 1 and pool.free_queue.ids() == [1]
    pool.free([b])
    assert pool.free_queue.ids() == [1, 0]
    pool.allocate(2)                             # now its memory is reused: hash dropped
    assert pool.lookup(h, [7, 8]) is None and b.block_hash is None


def test_hit_confirms_token_ids() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = hash_block(root_hash("m"), [1, 2])
    pool.cache_full_block(b, h, [1, 2])
    assert pool.lookup(h, [1, 3]) is None


def test_free_queue_o1_removal_from_middle() -> None:
    pool = BlockPool(5)
    q: FreeBlockQueue = pool.free_queue
    q.remove(pool.blocks[2])
    assert q.ids() == [0, 1, 3, 4] and q.size == 4
    q.appendleft(pool.blocks[2])
    assert q.ids() == [2, 0, 1, 3, 4]


def test_hash_chain_depends_on_parent_tokens_extra_and_fingerprint() -> None:
    r = root_hash("model-a")
    h1 = hash_block(r, [1, 2, 3])
    assert h1 == hash_block(r, [1, 2, 3])
    assert h1 != hash_block(r, [1, 2, 4])
    assert h1 != hash_block(root_hash("model-b"), [1, 2, 3])
    assert h1 != hash_block(r, [1, 2, 3], extra_keys=("lora-1",))
    assert hash_block(h1, [4]) != hash_block(hash_block(r, [9, 9, 9]), [4])
    assert len(hash_blocks("model-a", list(range(10)), 4)) == 2


def test_hashes_equal_across_processes() -> None:
    code = ("from engine.kv.block_pool import hash_blocks;"
            "print(','.join(h.hex() for h in hash_blocks('fp', list(range(50)), 16)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PYTHONPATH": "."}).stdout.strip() for seed in (1, 2)}
    assert outs == {",".join(h.hex() for h in hash_blocks("fp", list(range(50)), 16))}


def test_pin_cap_refuses_whole_and_changes_nothing() -> None:
    pool = BlockPool(8, max_pinned_blocks=3)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, hash_block(root_hash("m"), [i]), [i])
    pool.pin(blocks[:2])
    with pytest.raises(PinCapError):
        pool.pin(blocks[1:4])                    # 2 new pins on top of 2 > cap 3
    assert [b.pin_count for b in blocks] == [1, 1, 0, 0] and pool.num_pinned == 2
    pool.pin(blocks[:3])                          # 1 new: ok, and pin counts add up
    assert [b.pin_count for b in blocks] == [2, 2, 1, 0] and pool.num_pinned == 3


def test_an_owners_share_counts_its_distinct_blocks_and_refuses_whole() -> None:
    """Issue 34, item 5: one owner (a tenant) pins at most its share; a block it pins twice counts once, a block
    two owners pin counts for each; unpinning gives the share back; unowned pins count in the cap only."""
    pool = BlockPool(16, max_pinned_blocks=8, max_pinned_per_owner=3)
    blocks = pool.allocate(6)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, hash_block(root_hash("m"), [i]), [i])
    pool.pin(blocks[:2], "a")
    pool.pin(blocks[:3], "a")                     # two of them again: one more distinct block
    assert pool.pinned_by == {"a": 3} and pool.new_pins(blocks[:4], "a") == (1, 1)
    with pytest.raises(PinShareError):
        pool.pin(blocks[2:4], "a")                # block 3 would be its 4th
    assert [b.pin_count for b in blocks] == [2, 2, 1, 0, 0, 0] and pool.num_pinned == 3
    pool.pin(blocks[:3], "b")                     # another owner: a share of its own, the same blocks
    pool.pin(blocks[3:6])                         # nobody's: the cap only
    assert pool.pinned_by == {"a": 3, "b": 3} and pool.num_pinned == 6
    assert blocks[0].pinners == {"a": 2, "b": 1} and blocks[4].pinners is None
    with pytest.raises(ValueError):
        pool.unpin(blocks[3:5], "a")              # not its pins: nothing changes
    assert pool.num_pinned == 6 and blocks[3].pin_count == 1
    pool.unpin(blocks[:2], "a")
    pool.unpin(blocks[:3], "a")
    assert pool.pinned_by == {"b": 3} and [b.pin_count for b in blocks] == [1, 1, 1, 1, 1, 1]
    assert all(b.pinners == {"b": 1} for b in blocks[:3])
    pool.pin(blocks[3:5], "a")                    # its share is back


def test_pinned_blocks_never_enter_free_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, hash_block(root_hash("m"), [i]), [i])
    pool.pin(blocks)
    pool.free(blocks)
    assert pool.free_queue.ids() == [2, 3]
    assert pool.stats().used == pool.stats().pinned == 2
    with pytest.raises(MemoryError):
        pool.allocate(3)
    pool.unpin(blocks)
    assert pool.free_queue.ids() == [2, 3, 1, 0]
    assert pool.stats().used == 0 and pool.stats().cached == 2


class _Log:
    """A BlockEvents sink that keeps what it was told, in order (the pool's contract, nothing else)."""

    def __init__(self) -> None:
        self.records: list[tuple] = []

    def stored(self, block_hash, parent, token_ids) -> None:  # type: ignore[no-untyped-def]
        self.records.append(("stored", block_hash, parent, token_ids))

    def removed(self, block_hash) -> None:  # type: ignore[no-untyped-def]
        self.records.append(("removed", block_hash))

    def cleared(self) -> None:
        self.records.append(("cleared",))


def test_events_report_every_hash_given_and_dropped_in_order() -> None:
    log = _Log()
    pool = BlockPool(3, events=log)
    h1 = hash_block(root_hash("m"), [1, 2])
    h2 = hash_block(h1, [3, 4])
    a, b = pool.allocate(2)
    pool.cache_full_block(a, h1, [1, 2])
    pool.cache_full_block(b, h2, [3, 4], parent=h1)
    (c,) = pool.allocate(1)
    pool.cache_full_block(c, h1, [1, 2])            # same content elsewhere: c stays private, no event
    assert log.records == [("stored", h1, None, (1, 2)), ("stored", h2, h1, (3, 4))]
    pool.free([a, b])                                # tail first: queue [b, a]
    pool.free([c])                                   # unhashed: head of the queue, [c, b, a]
    log.records.clear()
    assert [blk.block_id for blk in pool.allocate(2)] == [2, 1]   # c (no hash), then b: h2 dropped
    assert log.records == [("removed", h2)]


def test_reset_drops_evictable_hashes_keeps_pinned_and_reports_it() -> None:
    log = _Log()
    pool = BlockPool(4, events=log)
    hs = [hash_block(root_hash("m"), [i]) for i in range(3)]
    blocks = pool.allocate(3)
    for blk, h, i in zip(blocks, hs, range(3)):
        pool.cache_full_block(blk, h, [i])
    pool.pin([blocks[0]])
    pool.free(blocks)
    log.records.clear()
    assert pool.reset_prefix_cache() == 2
    assert log.records == [("removed", hs[1]), ("removed", hs[2])]
    assert pool.lookup(hs[0], [0]) is blocks[0] and pool.lookup(hs[1], [1]) is None
    assert pool.stats().cached == 0 and pool.free_queue.ids()[:2] == [2, 1]
    pool.unpin([blocks[0]])
    log.records.clear()
    assert pool.reset_prefix_cache() == 1
    assert log.records == [("cleared",)]             # nothing is cached any more: one clear
    assert pool.reset_prefix_cache() == 0 and log.records == [("cleared",)]
