"""The paged KV cache on the device: one K and one V tensor for all layers, read through block tables."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.kv.backends.base import Addressing, CacheSpec, KVStat, StepTables, read_layer_major, write_layer_major
from engine.kv.block_manager import Placement
from kernels import AttentionBackend


class PagedKVCache:
    """key / value: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each.

    One allocation per K and V for all layers; layer i uses key[i] (a contiguous view). Block b's
    memory is the same row in every layer, so one block id names a token range in all layers.
    """

    placement: Placement | None = None     # any block serves any sequence
    ahead_tokens = 0                       # blocks are allocated when a step needs them, never early

    def __init__(self, spec: CacheSpec) -> None:
        args = spec.args
        shape = (args.num_layers, spec.num_blocks, spec.block_size, args.num_kv_heads, args.head_dim)
        self.key = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.value = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.num_blocks = spec.num_blocks
        self.block_size = spec.block_size
        self.attention: AttentionBackend = spec.attention     # type: ignore[assignment]  # paged kernels copy blocks

    def layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key, self.value

    def addressing(self, seq_ids: list[int], tables: StepTables, seq_lens: list[int],
                   seq_of_token: np.ndarray, positions: np.ndarray, decoding: list[bool]) -> Addressing:
        b = self.block_size
        rows = tables.array[seq_of_token, positions // b].astype(np.int64) * b + positions % b
        return Addressing(rows, tables.array, None)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """With the attention kernels' block copy (a Triton kernel on GPUs)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.key.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.key.device)
        self.attention.copy_blocks(list(self.key.unbind(0)), list(self.value.unbind(0)), src, dst)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return read_layer_major(self.key, self.value, block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        write_layer_major(self.key, self.value, block_ids, data)

    def stats(self, blocks_of: Callable[[int], int]) -> dict[str, KVStat]:
        return {}             # the block pool's figures (EngineStats) say all there is

    def close(self) -> None:
        pass


__all__ = ["PagedKVCache"]
