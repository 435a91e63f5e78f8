"""Per-sequence block tables over the BlockPool: prefix-cache lookup, on-demand growth, forks.

The scheduler talks to this class in sequence ids and token counts; it never sees `Block` objects.
Standard library only, like the pool.

NOTE: block tables are append-only while a sequence runs, but for copy-on-write, which replaces one block
in place. Position p of a sequence lives in block_table[p // block_size] at offset p % block_size. The worker
mirrors the tables in one array (engine/worker/block_table.py) and asks only what changed (`table_delta`) and
which sequences were freed (`drain_released`).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv.block_pool import Block, BlockHash, BlockPool, CacheSalt, hash_blocks, root_hash


@dataclass
class SeqBlocks:
    """What the manager keeps per sequence."""

    blocks: list[Block] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)   # chained hashes of the full blocks so far
    num_cached_blocks: int = 0                                # leading blocks already registered in the pool
    computing: list[BlockHash] = field(default_factory=list)  # prompt blocks it computes for the cache (in flight)
    salt: CacheSalt = ()                                      # mixed into its hashes (block_pool.CacheSalt)
    synced: int = 0                                           # leading blocks the worker's table already has


class Placement(Protocol):
    """Where a KV backend wants blocks to go (engine/slots.SlotTable for vAttention; none for paged).
    Told when a sequence gets its first blocks and when it gives them back; asked, for each block
    the manager allocates, which block it would rather have at that index."""

    def attach(self, seq_id: int, block_ids: list[int]) -> int: ...

    def detach(self, seq_id: int) -> None: ...

    def preferred(self, seq_id: int, index: int) -> int | None: ...


@dataclass(frozen=True)
class PrefixHit:
    """Blocks of a prompt found in the cache, as handed from `lookup` to `allocate`."""

    blocks: tuple[Block, ...]
    num_tokens: int


class BlockManager:
    def __init__(self, pool: BlockPool, block_size: int, fingerprint: str,
                 enable_prefix_caching: bool = True, placement: Placement | None = None) -> None:
        self.pool = pool
        self.placement = placement
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self._root = root_hash(fingerprint)
        self._seqs: dict[int, SeqBlocks] = {}
        self.pending_copies: list[tuple[int, int]] = []   # (src, dst) block copies for copy-on-write
        self._released: list[int] = []                    # sequences freed since the worker last asked
        # NOTE: in-flight prefix dedupe. A full prompt block a running sequence is computing now, by hash ->
        # that sequence: a waiting request whose next uncached block is in flight waits for it rather than
        # computing it again (scheduler). Entries leave when the block is cached (commit) or when their
        # sequence gives its blocks back (finished, aborted, preempted): a waiter then computes it itself.
        self._inflight: dict[BlockHash, int] = {}

    # -- hashing ------------------------------------------------------------------------------
    def block_hashes(self, token_ids: Seq[int], known: list[BlockHash] | None = None,
                     salt: CacheSalt = ()) -> list[BlockHash]:
        """Chained hashes of every full block of `token_ids`, extending `known` (a prefix of them, hashed
        with the same `salt`)."""
        out = list(known) if known else []
        out += hash_blocks(self.fingerprint, token_ids, self.block_size, out[-1] if out else self._root,
                           len(out) * self.block_size, salt)
        return out

    # -- admission ----------------------------------------------------------------------------
    def lookup(self, token_ids: Seq[int], hashes: Seq[BlockHash] | None = None, salt: CacheSalt = ()) -> PrefixHit:
        """Longest run of cached full blocks that starts the prompt (`hashes`: its full-block hashes,
        if the caller keeps them).

        Only blocks within the first len - 1 tokens count: the last prompt token is always computed,
        so the model has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return PrefixHit((), 0)
        b = self.block_size
        limit = (len(token_ids) - 1) // b
        if hashes is None or len(hashes) < limit:
            hashes = self.block_hashes(token_ids[:limit * b], list(hashes or []), salt)
        hits: list[Block] = []
        for i in range(limit):
            block = self.pool.lookup(hashes[i], token_ids[i * b:(i + 1) * b])
            if block is None:
                break
            hits.append(block)
        return PrefixHit(tuple(hits), len(hits) * b)

    def blocks_needed(self, seq_id: int, num_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free-queue blocks it takes to hold `num_tokens` tokens (hits that sit in the free queue
        count too: taking a reference removes them from it)."""
        have = len(self._seqs[seq_id].blocks) if seq_id in self._seqs else 0
        if hit is not None:
            have = len(hit.blocks)
        new = max(0, -(-num_tokens // self.block_size) - have)
        if hit is not None:
            new += sum(1 for blk in hit.blocks if blk.evictable)
        return new

    def allocate(self, seq_id: int, token_ids: Seq[int], hit: PrefixHit, num_tokens: int,
                 prompt_hashes: Seq[BlockHash] = (), salt: CacheSalt = ()) -> bool:
        """Start a sequence's table: take the hit blocks, then new blocks for `num_tokens` tokens.
        `prompt_hashes`: its prompt's full blocks; those past the hit that nobody computes yet are marked
        in flight, computed by this sequence. Hit blocks without a hash yet (another sequence writes them in
        this step) take theirs from `prompt_hashes`. `salt`: what its hashes mix in (block_pool.CacheSalt)."""
        assert seq_id not in self._seqs, f"sequence {seq_id} already has blocks"
        if self.blocks_needed(seq_id, num_tokens, hit) > self.pool.num_free:
            return False
        self.pool.touch(hit.blocks)
        state = SeqBlocks(blocks=list(hit.blocks), num_cached_blocks=len(hit.blocks), salt=salt)
        # a block another sequence computes this very step (`block_at`) has no hash yet: its hash is the prompt's
        state.hashes = [blk.block_hash if blk.block_hash is not None else prompt_hashes[i]  # type: ignore[misc]
                        for i, blk in enumerate(hit.blocks)]
        self._seqs[seq_id] = state
        if self.placement is not None:
            self.placement.attach(seq_id, [blk.block_id for blk in hit.blocks])
        if not self.grow(seq_id, num_tokens):
            return False
        if self.enable_prefix_caching:
            for h in prompt_hashes[len(hit.blocks):]:
                if h not in self._inflight:
                    self._inflight[h] = seq_id
                    state.computing.append(h)
        return True

    def in_flight(self, block_hash: BlockHash) -> int | None:
        """The running sequence computing this block for the cache now, if one is."""
        return self._inflight.get(block_hash)

    def block_at(self, seq_id: int, index: int) -> Block:
        """The sequence's block at `index` of its table: for a prompt that joins the step computing a block it
        shares (the scheduler's in-step sharing), which `allocate` then takes as part of a `PrefixHit`."""
        return self._seqs[seq_id].blocks[index]

    def grow(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> bool:
        """Make room for `num_tokens` tokens in all. If the block that position `write_from` falls in
        is shared with another sequence (a fork), copy it first (copy-on-write)."""
        state = self._seqs[seq_id]
        need = max(0, -(-num_tokens // self.block_size) - len(state.blocks))
        cow = self._shared_block_index(state, write_from)
        if need + (cow is not None) > self.pool.num_free:
            return False
        if cow is not None:
            old = state.blocks[cow]
            (new,) = self.pool.allocate(1, self._preferred(seq_id, cow, 1))
            self.pending_copies.append((old.block_id, new.block_id))
            state.blocks[cow] = new
            state.synced = min(state.synced, cow)
            self.pool.free([old])
        state.blocks.extend(self.pool.allocate(need, self._preferred(seq_id, len(state.blocks), need)))
        return True

    def _preferred(self, seq_id: int, start: int, count: int) -> list[int | None]:
        if self.placement is None or count == 0:
            return []
        return [self.placement.preferred(seq_id, i) for i in range(start, start + count)]

    def growable_tokens(self, seq_id: int, write_from: int | None = None) -> int:
        """The most tokens in all that `grow` could make room for now (its blocks plus the free ones,
        less one block if the write needs a copy-on-write first)."""
        state = self._seqs[seq_id]
        free = self.pool.num_free - (self._shared_block_index(state, write_from) is not None)
        return max(0, len(state.blocks) + free) * self.block_size

    def _shared_block_index(self, state: SeqBlocks, write_from: int | None) -> int | None:
        if write_from is None:
            return None
        idx = write_from // self.block_size
        if idx < len(state.blocks) and state.blocks[idx].ref_count > 1:
            return idx
        return None

    def commit(self, seq_id: int, token_ids: Seq[int], num_computed: int, num_prompt_tokens: int = 0) -> int:
        """Register the blocks that `num_computed` computed tokens have filled, so others can hit them.
        Returns how many tokens of the first `num_prompt_tokens` it wrote into the cache (full blocks that
        became the cached copy; a block someone else cached first is not a write)."""
        state = self._seqs[seq_id]
        full = num_computed // self.block_size
        written = 0
        if full <= state.num_cached_blocks:
            return written
        if self.enable_prefix_caching:
            if len(state.hashes) < full:
                state.hashes = self.block_hashes(token_ids[:full * self.block_size], state.hashes, state.salt)
            b = self.block_size
            for i in range(state.num_cached_blocks, full):
                if self.pool.cache_full_block(state.blocks[i], state.hashes[i], token_ids[i * b:(i + 1) * b],
                                              parent=state.hashes[i - 1] if i > 0 else None) \
                        and (i + 1) * b <= num_prompt_tokens:
                    written += b
                if self._inflight.get(state.hashes[i]) == seq_id:
                    del self._inflight[state.hashes[i]]
        state.num_cached_blocks = full
        return written

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent by reference count."""
        parent = self._seqs[parent_id]
        self.pool.touch(parent.blocks)
        self._seqs[child_id] = SeqBlocks(list(parent.blocks), list(parent.hashes), parent.num_cached_blocks,
                                         salt=parent.salt)
        if self.placement is not None:
            self.placement.attach(child_id, [blk.block_id for blk in parent.blocks])

    def free(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            for h in state.computing:
                if self._inflight.get(h) == seq_id:
                    del self._inflight[h]
            self.pool.free(state.blocks)
            self._released.append(seq_id)
            if self.placement is not None:
                self.placement.detach(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        return [blk.block_id for blk in self._seqs[seq_id].blocks]

    def table_delta(self, seq_id: int) -> tuple[int, list[int]]:
        """(start, the block ids from `start` on) of what changed in the sequence's table since the last call
        (its first call: the whole table); the table holds start + len(ids) blocks."""
        state = self._seqs[seq_id]
        start = state.synced
        state.synced = len(state.blocks)
        return start, [blk.block_id for blk in state.blocks[start:]]

    def drain_released(self) -> list[int]:
        """The sequences freed since the last call (their rows in the worker's table are free again)."""
        out, self._released = self._released, []
        return out

    def num_blocks(self, seq_id: int) -> int:
        return len(self._seqs[seq_id].blocks)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # -- prefixes -----------------------------------------------------------------------------
    def cached_blocks(self, token_ids: Seq[int], hashes: Seq[BlockHash] | None = None,
                      salt: CacheSalt = ()) -> list[Block | None]:
        """The cached block of each full block of `token_ids` (None where it is not cached);
        `hashes`: their chained hashes (hashed with `salt`), if the caller has them. Pins (engine/pinning.py)
        and the admission check read the cache through this one method."""
        if hashes is None:
            hashes = self.block_hashes(token_ids, salt=salt)
        b = self.block_size
        return [self.pool.lookup(h, token_ids[i * b:(i + 1) * b]) for i, h in enumerate(hashes)]


__all__ = ["BlockManager", "Placement", "PrefixHit"]
