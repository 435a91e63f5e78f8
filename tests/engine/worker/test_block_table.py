"""The worker's persistent block tables: a step writes only what changed in a sequence's table (the blocks it
grew by, or from the block a copy-on-write replaced), rows come back when the manager frees a sequence.
(tests/engine/kv/test_block_manager_state.py checks the mirror against the manager under random operations.)"""
from __future__ import annotations

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool
from engine.worker.block_table import BlockTables

B = 4
MARK = -7          # written into the persistent array by the test: a step that rewrote a row would erase it


def test_a_step_writes_only_what_changed() -> None:
    pool = BlockPool(32, max_pinned_blocks=4)
    mgr = BlockManager(pool, B, "fp", enable_prefix_caching=False)
    tables = BlockTables(mgr, rows=1, width=1)
    assert mgr.allocate(0, list(range(10)), mgr.lookup(list(range(10))), 10)
    assert tables.step([0]).row(0) == mgr.block_table(0) == [0, 1, 2]
    row0 = tables.rows[0]
    tables.table[row0, :3] = MARK
    assert mgr.grow(0, 13)                                          # one more block
    assert tables.step([0]).row(0) == [MARK, MARK, MARK, 3]        # appended in place, the rest untouched
    tables.table[row0, :4] = [0, 1, 2, 3]
    mgr.fork(0, 1)                                                  # the child shares every block
    step = tables.step([0, 1])                                      # rows grew from 1 to 2
    assert step.row(1) == step.row(0) == [0, 1, 2, 3]
    row1 = tables.rows[1]
    tables.table[row1, :3] = MARK
    assert mgr.grow(1, 14, write_from=13)                           # a write into the shared last block copies it
    cow = mgr.block_table(1)[3]
    step = tables.step([1, 0])
    assert cow != 3 and step.row(0) == [MARK, MARK, MARK, cow]     # from the replaced block on
    assert step.row(1) == [0, 1, 2, 3]
    mgr.free(1)
    tables.step([0])
    assert set(tables.rows) == {0} and not tables.table[row1].any()    # the child's row is free and zeroed
    assert mgr.allocate(2, list(range(5)), mgr.lookup(list(range(5))), 5)
    step = tables.step([2, 0])
    assert tables.rows[2] == row1 and step.row(0) == mgr.block_table(2) and step.array.shape == (2, 4)
    assert not step.array[0, 2:].any()                              # padded with 0
