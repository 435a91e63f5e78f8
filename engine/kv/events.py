"""KV cache events in vLLM's format: the `--kv-events-config` JSON, the engine-side record queue, and
the msgpack encoding of one batch. The ZMQ sockets (and who may read them) are in engine/kv/event_publisher.py.

What is announced: every change to the set of cached (hashed) blocks of this engine's block pool, as
the pool reports it (engine/kv/block_pool.py `BlockEvents`): a full block given its hash -> BlockStored,
a hash dropped (LRU eviction, prefix-cache reset) -> BlockRemoved, a reset that leaves nothing
cached -> AllBlocksCleared. Pinned prefix blocks are announced like any other when first hashed.

Wire format: vLLM's vllm/distributed/kv_events.py, as its msgspec structs encode it (and as
vllm-router 0.1.17 decodes it). One ZMQ multipart message per batch:

    [topic (utf-8), seq (8 bytes, big-endian, from 0, +1 per batch), payload (msgpack)]

    KVEventBatch  msgspec.Struct(array_like=True, omit_defaults=True): a positional array
        [ts: float64, events: [...], data_parallel_rank: int]      (the rank is always set: 0 here)
    KVCacheEvent  msgspec.Struct(tag=True, omit_defaults=True): a map, the tag first, then the fields
        in declaration order; fields without a default are always written, fields with one only when
        they differ from it (extra_keys, group_idx, kv_cache_spec_* ... are never written here):
        {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
         "token_ids": [t, ...], "block_size": B, "lora_id": nil, "medium": "GPU", "lora_name": nil}
        {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU"}
        {"type": "AllBlocksCleared"}

One BlockStored covers a chain of consecutive blocks (block i's parent is block i-1, the first one's
is `parent_block_hash`), with their tokens concatenated, as vLLM sends them. `medium` is "GPU": vLLM's
name for the engine's own KV cache tier, whatever the device (vLLM's CPU backend says "GPU" too;
"CPU" there means a CPU offload tier, which we do not have, and vllm-router's kv_aware gives no credit
for it).

Block hashes on the wire are vLLM's default ExternalBlockHash: the low 64 bits of the big-endian
digest, as an unsigned int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). Ours are chained blake2b-256
digests seeded by the model fingerprint; vLLM's are sha256 over (parent, tokens, extra keys), seeded
by PYTHONHASHSEED. They cannot be equal, and need not be: a consumer uses the engine's hashes only as
opaque keys to link a block to its parent and to match a BlockRemoved to its BlockStored. vllm-router
0.1.17's kv_aware keys its index by its own sha256 of each block's token ids (from `token_ids` and
`block_size` above) and hashes the request's tokens (from the worker's /v1/*/render) the same way.

Loss: the engine never waits for the publisher. Records wait in a bounded queue; when it is full the
oldest record is dropped and counted, and the next batch starts with AllBlocksCleared, so a consumer
resets its view of this engine instead of keeping a wrong one (it then under-reports what is cached,
the safe direction, until blocks are stored again).
"""
from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from engine.kv.block_pool import BlockHash

MEDIUM = "GPU"
_PUBLISHERS = ("zmq", "null")
_SCHEMES = ("tcp://", "ipc://", "inproc://")

Record = tuple[Any, ...]   # ("stored", hash, parent, tokens) | ("removed", hash) | ("cleared",)


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field (the JSON of `--kv-events-config`)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None         # "zmq" | "null"; None: "zmq" when events are enabled
    # PUB; bound when its host is a wildcard (*, ::) or loopback, or it is ipc/inproc (event_publisher.binds).
    # NOTE: vLLM's default is tcp://*:5557, every interface; ours is loopback: the events carry prompt tokens.
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None   # ROUTER for subscribers that missed batches (always bound)
    buffer_steps: int = 10_000           # batches kept for replay
    hwm: int = 100_000                   # PUB send high-water mark: beyond it ZMQ drops for that subscriber
    max_queue_size: int = 100_000        # event records waiting for the publisher thread
    topic: str = ""                      # first frame of every message

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        checks: list[tuple[bool, str]] = [
            (self.publisher in _PUBLISHERS, f"publisher must be one of {_PUBLISHERS}, got {self.publisher!r}"),
            (self.endpoint.startswith(_SCHEMES), f"endpoint must start with one of {_SCHEMES}, got {self.endpoint!r}"),
            (self.replay_endpoint is None or self.replay_endpoint.startswith(_SCHEMES),
             f"replay_endpoint must start with one of {_SCHEMES}, got {self.replay_endpoint!r}"),
            (self.buffer_steps >= 1, "buffer_steps must be >= 1"),
            (self.hwm >= 0, "hwm must be >= 0"),
            (self.max_queue_size >= 1, "max_queue_size must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"kv events config: {message}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses vLLM's JSON; an unknown key or a wrong type is a ValueError naming it."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv events config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv events config must be a JSON object")
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(raw) - set(types))
        if unknown:
            raise ValueError(f"kv events config: unknown field(s) {unknown}; known: {sorted(types)}")
        for key, value in raw.items():
            kind = types[key]
            ok = (isinstance(value, bool) if kind == "bool" else
                  isinstance(value, int) and not isinstance(value, bool) if kind == "int" else
                  isinstance(value, str) if kind == "str" else
                  value is None or isinstance(value, str))
            if not ok:
                raise ValueError(f"kv events config: {key} must be {kind}, got {value!r}")
        return cls(**raw)


class KVEventQueue:
    """The pool's `BlockEvents` sink: appends small records for the publisher thread to drain.

    A deque, because append (engine thread) and popleft (publisher thread) are each atomic in CPython:
    no lock on the engine's hot path. Bounded by dropping the oldest record, counted in `dropped`
    (one writer: the engine thread) and flagged so that the next batch restarts with AllBlocksCleared.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._records: deque[Record] = deque()
        self._lost = False

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...]) -> None:
        self._put(("stored", block_hash, parent, token_ids))

    def removed(self, block_hash: BlockHash) -> None:
        self._put(("removed", block_hash))

    def cleared(self) -> None:
        self._put(("cleared",))

    def _put(self, record: Record) -> None:
        if len(self._records) >= self.capacity:
            try:
                self._records.popleft()
            except IndexError:      # the publisher emptied it meanwhile: nothing was lost
                pass
            else:
                self.dropped += 1
                self._lost = True
        self._records.append(record)

    def __len__(self) -> int:
        return len(self._records)

    def drain(self) -> list[Record]:
        """Everything queued so far, oldest first; led by a ("cleared",) if records were lost."""
        out: list[Record] = []
        lost, self._lost = self._lost, False
        while True:
            try:
                out.append(self._records.popleft())
            except IndexError:
                break
        if lost:
            out.insert(0, ("cleared",))
        return out


def external_hash(block_hash: BlockHash) -> int:
    """vLLM's int ExternalBlockHash: the low 64 bits of the big-endian digest."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def events_of(records: Sequence[Record], block_size: int) -> list[dict[str, Any]]:
    """The events of one batch, in order; chains of stored blocks and runs of removals merged."""
    events: list[dict[str, Any]] = []
    last: BlockHash | None = None           # the last hash of the BlockStored at the end of `events`
    for record in records:
        kind = record[0]
        prev = events[-1] if events else None
        if kind == "stored":
            _, h, parent, tokens = record
            if prev is not None and prev["type"] == "BlockStored" and parent is not None and parent == last:
                prev["block_hashes"].append(external_hash(h))
                prev["token_ids"].extend(tokens)
            else:
                events.append({"type": "BlockStored", "block_hashes": [external_hash(h)],
                               "parent_block_hash": None if parent is None else external_hash(parent),
                               "token_ids": list(tokens), "block_size": block_size, "lora_id": None,
                               "medium": MEDIUM, "lora_name": None})
            last = h
        elif kind == "removed":
            if prev is not None and prev["type"] == "BlockRemoved":
                prev["block_hashes"].append(external_hash(record[1]))
            else:
                events.append({"type": "BlockRemoved", "block_hashes": [external_hash(record[1])], "medium": MEDIUM})
        else:
            events.append({"type": "AllBlocksCleared"})
    return events


def encode_batch(events: list[dict[str, Any]], ts: float, data_parallel_rank: int = 0) -> bytes:
    """msgpack of vLLM's KVEventBatch: [ts, events, rank]; dict order is the field order above."""
    return msgpack.packb([float(ts), events, data_parallel_rank], use_bin_type=True)
