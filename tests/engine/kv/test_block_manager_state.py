"""A hypothesis state machine over allocate / append / fork / free / pin / unpin / evict that checks
every block-pool invariant after each step, and that the worker's persistent block tables (written in place
from the manager's deltas, engine/worker/block_table.py) mirror the manager's tables after each step."""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool, PinCapError
from engine.worker.block_table import BlockTables

B = 4
NUM_BLOCKS = 24
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny alphabet: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    pins = Bundle("pins")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, max_pinned_blocks=8)
        self.mgr = BlockManager(self.pool, B, "fp")
        self.tables = BlockTables(self.mgr, rows=2, width=2)     # small: its rows and width grow
        self.tokens: dict[int, list[int]] = {}
        self.pinned: list[list[int]] = []
        self.next_id = 0

    @rule(target=seqs, toks=tokens)
    def allocate(self, toks: list[int]) -> int:
        sid, self.next_id = self.next_id, self.next_id + 1
        hit = self.mgr.lookup(toks)
        assert hit.num_tokens <= len(toks) - 1
        if not self.mgr.allocate(sid, toks, hit, len(toks)):
            return -1
        self.mgr.commit(sid, toks, len(toks))
        self.tokens[sid] = list(toks)
        return sid

    @rule(sid=seqs, more=tokens)
    def append(self, sid: int, more: list[int]) -> None:
        if sid not in self.tokens:
            return
        toks = self.tokens[sid]
        start = len(toks)
        if self.mgr.grow(sid, start + len(more), write_from=start):
            toks.extend(more)
            self.mgr.commit(sid, toks, len(toks))
            self.pool.free([])  # no-op; keeps the call shape honest

    @rule(target=seqs, sid=seqs)
    def fork(self, sid: int) -> int:
        if sid not in self.tokens:
            return -1
        child, self.next_id = self.next_id, self.next_id + 1
        self.mgr.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid: int) -> None:
        if sid in self.tokens:
            self.mgr.free(sid)
            del self.tokens[sid]

    @rule(target=pins, toks=st.lists(st.integers(0, 2), min_size=B, max_size=3 * B))
    def pin(self, toks: list[int]) -> list[int]:
        blocks = self.mgr.cached_blocks(toks)
        if any(b is None for b in blocks):
            return []
        before = [b.pin_count for b in self.pool.blocks]
        try:
            self.pool.pin(blocks)
        except PinCapError:
            assert [b.pin_count for b in self.pool.blocks] == before  # refused whole
            return []
        self.pinned.append(toks)
        return toks

    @rule(toks=consumes(pins))
    def unpin(self, toks: list[int]) -> None:
        if toks and toks in self.pinned:
            blocks = self.mgr.cached_blocks(toks)
            assert len(blocks) == len(toks) // B and all(b is not None and b.pin_count > 0 for b in blocks)
            self.pool.unpin(blocks)
            self.pinned.remove(toks)

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        n = min(n, self.pool.num_free)
        blocks = self.pool.allocate(n)   # pressure from outside: reuses the LRU blocks
        for b in blocks:
            assert b.block_hash is None
        self.pool.free(blocks)

    @invariant()
    def worker_tables_mirror_the_manager(self) -> None:
        live = [sid for sid in self.tokens if self.mgr.has(sid)]
        step = self.tables.step(live)
        for i, sid in enumerate(live):
            assert step.row(i) == self.mgr.block_table(sid)
            assert not step.array[i, len(step.row(i)):].any()        # padded with 0
        assert set(self.tables.rows) == set(live)                    # freed sequences gave their rows back

    @invariant()
    def invariants(self) -> None:
        queued = set(self.pool.free_queue.ids())
        assert len(queued) == self.pool.free_queue.size
        for b in self.pool.blocks:
            assert (b.block_id in queued) == (b.ref_count == 0 and b.pin_count == 0), b
        refs = Counter(bid for sid in self.tokens for bid in self.mgr.block_table(sid))
        for b in self.pool.blocks:
            assert b.ref_count == refs.get(b.block_id, 0), b
        assert self.pool.num_pinned == sum(1 for b in self.pool.blocks if b.pin_count > 0) <= 8
        for h, b in self.pool.cached.items():
            assert b.block_hash == h
        for sid, toks in self.tokens.items():
            assert self.mgr.num_blocks(sid) >= -(-len(toks) // B)
        stats = self.pool.stats()
        assert stats.used == NUM_BLOCKS - stats.free
        assert stats.cached == sum(1 for b in self.pool.cached.values() if b.evictable)
        if not self.tokens:
            assert stats.used == stats.pinned

    def teardown(self) -> None:
        for sid in list(self.tokens):
            self.mgr.free(sid)
        assert self.pool.stats().used == self.pool.stats().pinned


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
