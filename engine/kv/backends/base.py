"""What a KV backend is to the engine: the cache it creates (KVStore), how it is described (KVBackend),
and the values it reports (KVStat). The registry (engine/kv/backends/__init__.py) maps names to KVBackends.

    KVBackend   name, cache factory, attention getter, block-size rule     (one per backend, registered)
    KVStore     the cache on the device: tensors per layer, where a step's tokens live, block copies,
                where blocks should go (placement), how far ahead to grow, stats, close     (one per engine)

The block pool, the block manager, the scheduler and the pins are the same for every backend: a backend
decides how a block's memory is laid out and read, never which blocks a sequence holds.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import numpy as np
import torch

from engine.kv.block_manager import Placement
from engine.models.llama import ModelArgs
from kernels import Attention
from kernels.ops import Ops


class KVStat(NamedTuple):
    """One value a backend reports; the service exports it as `prefixserve_<backend>_<name>`."""

    kind: Literal["gauge", "counter"]
    value: float
    doc: str


@dataclass
class StepTables:
    """The step's block tables, in batch order: what KVStore.addressing and the attention kernels read (rows of
    the worker's persistent table, engine/worker/block_table.py)."""

    array: np.ndarray          # [S, W] int32, rows padded with 0 (W: the widest table of the step)
    num_blocks: np.ndarray     # [S] int64

    def __len__(self) -> int:
        return self.array.shape[0]

    def row(self, i: int) -> list[int]:
        """Sequence i's block ids (a backend that needs them as a list: vattention's page mapping)."""
        return self.array[i, :int(self.num_blocks[i])].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self.row(i) for i in range(len(self)))

    @classmethod
    def from_lists(cls, tables: Seq[Seq[int]]) -> StepTables:
        """From explicit block lists (tests, tools)."""
        width = max((len(t) for t in tables), default=0)
        array = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            array[i, :len(t)] = t
        return cls(array, np.asarray([len(t) for t in tables], dtype=np.int64))


@dataclass
class Addressing:
    """Where one step's tokens live in a cache, as the attention kernels read it."""

    kv_rows: np.ndarray                    # [num_tokens] int64: each new token's K/V row
    block_tables: np.ndarray | None        # [num_seqs, max_blocks] int32 (block tables)
    slot_ids: list[int] | None             # each sequence's slot (virtually contiguous caches)


@dataclass(frozen=True)
class CacheSpec:
    """What a backend's factory is given to build the cache."""

    args: ModelArgs
    num_blocks: int
    block_size: int                        # already through the backend's block-size rule
    dtype: torch.dtype
    device: str
    max_model_len: int
    max_num_seqs: int
    attention: Attention                   # the backend's attention, from its getter
    map_ahead_tokens: int                  # how early a decoding sequence may get its next block
    max_mappings: int                      # memory mappings the cache may hold (vattention)


class KVStore(Protocol):
    """What the engine needs of a KV cache, whichever backend holds it."""

    block_size: int
    placement: Placement | None            # where the backend wants blocks to go (None: anywhere)
    ahead_tokens: int                      # grow a decoding sequence this many tokens early (0: never)

    def layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V indexed by layer first, as the model reads them."""
        ...

    def addressing(self, seq_ids: list[int], tables: StepTables, seq_lens: list[int],
                   seq_of_token: np.ndarray, positions: np.ndarray, decoding: list[bool]) -> Addressing:
        """Sequence i (`decoding[i]`: generating, not in its prompt) holds blocks tables.row(i) and
        seq_lens[i] tokens after this step; token t belongs to sequence seq_of_token[t], at positions[t].
        Raises KVRefused (sequences the cache cannot hold this step; nothing done for the step) or
        EngineDead (the cache is broken for good)."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (copy-on-write of a shared partial block)."""
        ...

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' K and V on the host, in the tier's layout (BLOCK_LAYOUT), one row per block:
        [n, 2, num_layers, block_size, num_kv_heads, head_dim]."""
        ...

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """The inverse of `read_blocks`: block_ids[i] gets data[i] (a block loaded from the KV tier)."""
        ...

    def stats(self, blocks_of: Callable[[int], int]) -> dict[str, KVStat]:
        """The backend's own figures (`blocks_of(seq_id)`: blocks a sequence holds); {} if none."""
        ...

    def close(self) -> None:
        """Stops what the cache started (threads); the engine calls it once, last."""
        ...


@dataclass(frozen=True)
class KVBackend:
    """A KV backend, as registered: everything the engine asks of it by name."""

    name: str
    create: Callable[[CacheSpec], KVStore]                        # the cache factory
    attention: Callable[[str, Ops], Attention]                    # kernel family ("cpu", "triton") -> attention
    block_size: Callable[[ModelArgs, torch.dtype, int], int]      # the block size it can serve for one asked


BLOCK_LAYOUT = "[2, layers, block_size, kv_heads, head_dim]"    # one block's K|V as read_blocks returns it


def read_layer_major(key: torch.Tensor, value: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """read_blocks over K and V seen as [num_layers, num_blocks, block_size, Hkv, D] (both backends can be)."""
    out = torch.empty((len(block_ids), 2, *key[:, 0].shape), dtype=key.dtype)
    for i, b in enumerate(block_ids):
        out[i, 0].copy_(key[:, b])
        out[i, 1].copy_(value[:, b])
    return out


def write_layer_major(key: torch.Tensor, value: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    for i, b in enumerate(block_ids):
        key[:, b].copy_(data[i, 0])
        value[:, b].copy_(data[i, 1])


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens in every layer: what one block costs in any backend."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem


def blocks_for_budget(args: ModelArgs, block_size: int, dtype: torch.dtype, budget_bytes: float) -> int:
    return max(1, int(budget_bytes // bytes_per_block(args, block_size, dtype)))
