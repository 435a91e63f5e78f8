"""KV blocks: reference counts, pin counts, content hashes and the LRU free queue.

Standard library only (no torch), so the allocator's tests run anywhere in milliseconds.

Invariants
- Only full blocks carry a hash. `hash(block) = H(parent_hash, token_ids, extra_keys)`, chained from a
  root seeded by the model fingerprint, with H = blake2b-256 over a fixed byte encoding: the same
  tokens give the same hash in every process, replica and restart (Python's `hash()` is salted per
  process and would not).
- A block is evictable iff `ref_count == 0 and pin_count == 0`; exactly the evictable blocks are in
  the free queue. Pinned blocks never enter it.
- Pins are capped twice, all or nothing: `max_pinned_blocks` distinct pinned blocks in all, and
  `max_pinned_per_owner` distinct blocks pinned by one owner (an opaque key: a tenant). A block pinned by
  several owners counts for each; one pinned twice by one owner (two prefixes sharing a start) counts once.
- Lazy eviction: a freed block keeps its hash (and stays findable) until `allocate` hands its memory
  out again; only then is the hash dropped.
- Events: when a `BlockEvents` sink is given, every change to the set of cached hashes is reported to
  it, in order: `stored` where a block is given its hash, `removed` where a hash is dropped (eviction,
  prefix-cache reset), `cleared` when a reset leaves no hash at all. The pool only calls the sink; what
  it does with the records (vLLM-format KV events, engine/kv/events.py) is not the pool's business.
- Spill: when a `Spill` sink is given (the KV tier, engine/kv/tier/), `allocate` shows it every cached block
  it evicts, before the hash is dropped and while the block's memory still holds that content (it is
  overwritten only by the next forward pass, or by the tier's own install).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

BlockHash = NewType("BlockHash", bytes)
CacheSalt = tuple[tuple[int, str], ...]
"""Keys mixed into chosen blocks' hashes, as (block index, key) pairs in ascending index order. A salt at
block 0 puts a whole sequence's cache apart (one tenant's prompts are a miss for another: the service
derives it from the caller, never from what the caller sends); a salt at block i > 0 puts apart what
follows a shared first part (a published prefix, then a tenant's own question). Every block after a
salted one differs too, because hashes chain."""


class BlockEvents(Protocol):
    """Receives the pool's cache changes. Called on the engine thread in the middle of allocation:
    an implementation records and returns (O(1), no I/O, never blocks)."""

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...]) -> None: ...

    def removed(self, block_hash: BlockHash) -> None: ...

    def cleared(self) -> None: ...


class Spill(Protocol):
    """Told of each cached block `allocate` evicts, before its hash is dropped (engine thread; O(1): it
    records, the bytes are copied before anything writes into the block)."""

    def evicted(self, block: Block) -> None: ...


def root_hash(fingerprint: str) -> BlockHash:
    """The parent of every sequence's first block: ties all hashes to one model and tokenizer."""
    return BlockHash(hashlib.blake2b(b"prefixserve-root\0" + fingerprint.encode(), digest_size=32).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    """Chained content hash of one full block. Encoding: parent | u32 count | i64 tokens | extra keys."""
    h = hashlib.blake2b(digest_size=32)
    h.update(parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        raw = key.encode()
        h.update(struct.pack("<I", len(raw)) + raw)
    return BlockHash(h.digest())


def hash_blocks(fingerprint: str, token_ids: Sequence[int], block_size: int,
                parent: BlockHash | None = None, start: int = 0, salt: CacheSalt = ()) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids[start:]`, chained from `parent` (default: the root);
    `salt` keys go into the blocks they name (block indexes count from token 0, not from `start`)."""
    out: list[BlockHash] = []
    prev = parent if parent is not None else root_hash(fingerprint)
    keys = dict(salt)
    for i in range(start, len(token_ids) - block_size + 1, block_size):
        key = keys.get(i // block_size)
        prev = hash_block(prev, token_ids[i:i + block_size], (key,) if key is not None else ())
        out.append(prev)
    return out


class Block:
    __slots__ = ("block_id", "ref_count", "pin_count", "block_hash", "parent", "token_ids", "prev", "next", "pinners")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.pin_count = 0
        self.block_hash: BlockHash | None = None
        self.parent: BlockHash | None = None    # the previous block's hash (None: a first block), with the hash
        self.token_ids: tuple[int, ...] = ()    # kept for full blocks, to confirm a hash hit
        self.prev: Block | None = None
        self.next: Block | None = None
        self.pinners: dict[str, int] | None = None     # owner -> its pins of this block (owned pins only)

    @property
    def evictable(self) -> bool:
        return self.ref_count == 0 and self.pin_count == 0

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"Block({self.block_id}, ref={self.ref_count}, pin={self.pin_count}, hashed={hashed})"


class FreeBlockQueue:
    """Evictable blocks, least recently used at the head.

    An intrusive doubly linked list through `Block.prev/next` (as vLLM's free queue): a prefix-cache hit
    takes a block out of the middle in O(1), and no node is allocated per operation, which a deque
    (O(n) removal) or an OrderedDict keyed by id (an allocation per insert) would not give.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.size = 0
        self.num_hashed = 0     # queued blocks that still hold a hash: counted here, never scanned
        for b in blocks:
            self.append(b)

    def popleft(self) -> Block:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: Block) -> None:
        self._link(block, self._head, self._head.next)

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not queued"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1
        self.num_hashed -= block.block_hash is not None

    def _link(self, block: Block, before: Block | None, after: Block | None) -> None:
        assert block.prev is None and block.next is None, f"{block} is already queued"
        assert before is not None and after is not None
        block.prev, block.next = before, after
        before.next = after.prev = block
        self.size += 1
        self.num_hashed += block.block_hash is not None

    def ids(self) -> list[int]:
        out, node = [], self._head.next
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next
        return out


class PinCapError(Exception):
    pass


class PinShareError(PinCapError):
    """The owner's share of the pinned blocks would be exceeded (the cap of all pins may not be)."""


@dataclass(frozen=True)
class PoolStats:
    total: int
    used: int        # ref_count > 0 or pin_count > 0
    pinned: int      # pin_count > 0
    cached: int      # evictable but still holding a hash (reusable)
    free: int        # evictable (cached ones included)


class BlockPool:
    def __init__(self, num_blocks: int, max_pinned_blocks: int | None = None,
                 events: BlockEvents | None = None, spill: Spill | None = None,
                 max_pinned_per_owner: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.max_pinned_blocks = num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        self.num_pinned = 0
        self.max_pinned_per_owner = self.max_pinned_blocks if max_pinned_per_owner is None else max_pinned_per_owner
        self.pinned_by: dict[str, int] = {}        # owner -> distinct blocks it pins (Block.pinners)
        self.events = events
        self.spill = spill

    @property
    def num_blocks_total(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.size

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int, prefer: Sequence[int | None] = ()) -> list[Block]:
        """Take `n` blocks from the head of the free queue (LRU first); their old hashes are dropped.

        `prefer[i]`: a block id to hand out as the i-th block instead, taken only if it is free and
        holds no hash (such blocks sit at the head of the queue anyway, so the choice among them costs
        the cache nothing). The vAttention backend prefers the block a slot already has mapped there."""
        if n > self.free_queue.size:
            raise MemoryError(f"need {n} blocks, {self.free_queue.size} free")
        chosen: list[Block | None] = [None] * n
        for i, want in enumerate(prefer[:n]):                 # first the preferred ones, so the queue's
            block = self.blocks[want] if want is not None else None     # head does not take them
            if block is not None and block.evictable and block.block_hash is None and block.prev is not None:
                self.free_queue.remove(block)
                chosen[i] = block
        out = []
        for block in chosen:
            if block is None:
                block = self.free_queue.popleft()
            if block.block_hash is not None:
                if self.spill is not None and self.cached.get(block.block_hash) is block:
                    self.spill.evicted(block)
                dropped = self._drop_hash(block)
                if dropped is not None and self.events is not None:
                    self.events.removed(dropped)
            block.ref_count = 1
            out.append(block)
        return out

    def _drop_hash(self, block: Block) -> BlockHash | None:
        """Forget a block's hash; returns it if this block was its cached copy (None if private)."""
        assert block.block_hash is not None
        dropped = None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            dropped = block.block_hash
        block.block_hash, block.parent, block.token_ids = None, None, ()
        return dropped

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a fork)."""
        for block in blocks:
            if block.evictable:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block, tail first.

        NOTE: reverse order matters. Blocks reaching zero are queued so that a sequence's tail blocks
        are evicted before its head blocks (the head is the part other prompts are likeliest to share).
        Blocks without a hash hold nothing reusable and go to the head of the queue.
        """
        for block in reversed(blocks):
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.evictable:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_full_block(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int],
                         parent: BlockHash | None = None) -> bool:
        """Give a just-filled block its hash (`parent`: the previous block's, None for a first block).
        If another block already holds this content, the existing one stays the cached copy and this
        one stays private. True when this block became the cached copy (a cache write)."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash, block.parent, block.token_ids = block_hash, parent, tuple(token_ids)
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent, block.token_ids)
        return True

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every evictable block (pinned and referenced blocks keep theirs); returns
        how many were dropped. The blocks move to the head of the free queue, as unhashed blocks do.
        Reported as one `cleared` when no hash is left at all, else one `removed` per hash."""
        victims = [b for b in self.cached.values() if b.evictable]
        dropped: list[BlockHash] = []
        for block in victims:
            self.free_queue.remove(block)
            h = self._drop_hash(block)
            if h is not None:
                dropped.append(h)
            self.free_queue.appendleft(block)
        if self.events is not None and dropped:
            if self.cached:
                for h in dropped:
                    self.events.removed(h)
            else:
                self.events.cleared()
        return len(victims)

    def forget(self, blocks: Iterable[Block]) -> int:
        """Drops the hash of each of `blocks` that is evictable (a deleted prefix's: what is referenced or pinned
        keeps it), as `reset_prefix_cache` does for all; returns how many were dropped."""
        dropped = 0
        for block in blocks:
            if block.block_hash is None or not block.evictable:
                continue
            self.free_queue.remove(block)
            h = self._drop_hash(block)
            self.free_queue.appendleft(block)
            dropped += 1
            if h is not None and self.events is not None:
                self.events.removed(h)
        return dropped

    # -- pinning ------------------------------------------------------------------------------
    def new_pins(self, blocks: Sequence[Block | None], owner: str = "") -> tuple[int, int]:
        """(blocks not pinned yet, blocks `owner` does not pin yet) among `blocks` (None: not cached yet)."""
        newly = {b.block_id if b is not None else -i - 1 for i, b in enumerate(blocks)
                 if b is None or b.pin_count == 0}
        mine = {b.block_id if b is not None else -i - 1 for i, b in enumerate(blocks)
                if b is None or not (b.pinners and b.pinners.get(owner))} if owner else set()
        return len(newly), len(mine)

    def pin(self, blocks: Sequence[Block], owner: str = "") -> None:
        """Pin every block once more, for `owner` ("": nobody's), all or nothing: over the cap, or over the
        owner's share, nothing changes (PinShareError for the share)."""
        newly, mine = self.new_pins(blocks, owner)
        if self.num_pinned + newly > self.max_pinned_blocks:
            raise PinCapError(
                f"pinning {newly} more blocks would exceed the cap of {self.max_pinned_blocks} pinned "
                f"blocks ({self.num_pinned} already pinned)")
        held = self.pinned_by.get(owner, 0)
        if owner and held + mine > self.max_pinned_per_owner:
            raise PinShareError(
                f"pinning {mine} more blocks would exceed this tenant's share of {self.max_pinned_per_owner} pinned "
                f"blocks ({held} pinned by it already)")
        for block in blocks:
            assert block.block_hash is not None, "only full, hashed blocks can be pinned"
            if block.evictable:
                self.free_queue.remove(block)
            if block.pin_count == 0:
                self.num_pinned += 1
            block.pin_count += 1
            if owner:
                pinners = block.pinners = block.pinners or {}
                if not pinners.get(owner):
                    self.pinned_by[owner] = self.pinned_by.get(owner, 0) + 1
                pinners[owner] = pinners.get(owner, 0) + 1

    def unpin(self, blocks: Sequence[Block], owner: str = "") -> None:
        """Drops one pin of `owner` from each block (one it pinned with `pin(blocks, owner)`); all or nothing."""
        if owner and any(not (b.pinners and b.pinners.get(owner)) for b in blocks):
            raise ValueError(f"a block is not pinned by {owner!r}")
        for block in reversed(blocks):
            assert block.pin_count > 0, f"unpin of unpinned {block}"
            if owner:
                pinners = block.pinners
                assert pinners is not None
                pinners[owner] -= 1
                if not pinners[owner]:
                    del pinners[owner]
                    self.pinned_by[owner] -= 1
                    if not self.pinned_by[owner]:
                        del self.pinned_by[owner]
                if not pinners:
                    block.pinners = None
            block.pin_count -= 1
            if block.pin_count == 0:
                self.num_pinned -= 1
                if block.ref_count == 0:
                    self.free_queue.append(block)

    def stats(self) -> PoolStats:
        total = len(self.blocks)
        free = self.free_queue.size
        # NOTE: O(1): the engine takes a snapshot after every step. A hash is only ever given to or
        # dropped from a block outside the queue, so the queue's count stays exact.
        return PoolStats(total=total, used=total - free, pinned=self.num_pinned, cached=self.free_queue.num_hashed,
                         free=free)
