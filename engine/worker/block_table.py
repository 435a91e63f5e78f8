"""BlockTables: every running sequence's block table as a row of one persistent int32 array, written in place.

vLLM's worker keeps its block tables the same way (vllm/v1/worker/block_table.py): a step does not rebuild a
Python list per sequence nor pad it in a Python loop; it writes only what changed since the last step (the
blocks a sequence grew by, or from the block a copy-on-write replaced: BlockManager.table_delta) into the
sequence's row, then gathers the step's rows with one numpy index.

    rows         seq_id -> row, given on a sequence's first step and taken back when the manager frees it
    table        [rows, width] int32; row r holds its sequence's block ids, 0 past them
    num_blocks   [rows] the blocks each row holds

Both dimensions double when they run out (more live sequences than rows, a table wider than the widest so
far): amortized O(1) a block. NOTE: rows are the engine thread's, like the manager they mirror.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from engine.kv.backends.base import StepTables
from engine.kv.block_manager import BlockManager


class BlockTables:
    def __init__(self, manager: BlockManager, rows: int = 16, width: int = 16) -> None:
        self.manager = manager
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.rows: dict[int, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def step(self, seq_ids: Seq[int]) -> StepTables:
        """Brings the rows of `seq_ids` up to date with the manager and returns them, in that order."""
        for sid in self.manager.drain_released():
            row = self.rows.pop(sid, None)
            if row is not None:
                self.table[row, :self.num_blocks[row]] = 0
                self.num_blocks[row] = 0
                self._free_rows.append(row)
        rows = np.empty(len(seq_ids), dtype=np.int64)
        for i, sid in enumerate(seq_ids):
            row = self.rows.get(sid)
            if row is None:
                row = self.rows[sid] = self._take_row()
            start, ids = self.manager.table_delta(sid)
            end = start + len(ids)
            if ids:
                if end > self.table.shape[1]:
                    self._widen(end)
                self.table[row, start:end] = ids
            self.num_blocks[row] = end          # a live sequence's table never shrinks
            rows[i] = row
        n = self.num_blocks[rows]
        width = int(n.max()) if len(n) else 0
        return StepTables(self.table[rows, :width], n)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _widen(self, width: int) -> None:
        new = max(width, 2 * self.table.shape[1])
        grown = np.zeros((self.table.shape[0], new), dtype=np.int32)
        grown[:, :self.table.shape[1]] = self.table
        self.table = grown


__all__ = ["BlockTables", "StepTables"]
