"""The KV cache tensors on the device, and how many blocks fit a memory budget."""
from __future__ import annotations

import torch

from engine.models.llama import ModelArgs
from kernels import AttentionBackend


class KVCache:
    """key / value: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each.

    One allocation per K and V for all layers; layer i uses key[i] (a contiguous view). Block b's
    memory is the same row in every layer, so one block id names a token range in all layers.
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        shape = (args.num_layers, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem

    @classmethod
    def blocks_for_budget(cls, args: ModelArgs, block_size: int, dtype: torch.dtype, budget_bytes: float) -> int:
        return max(1, int(budget_bytes // cls.bytes_per_block(args, block_size, dtype)))

    def copy_blocks(self, pairs: list[tuple[int, int]], backend: AttentionBackend) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block),
        with the attention backend's block-copy (a Triton kernel on GPUs)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.key.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.key.device)
        backend.copy_blocks(list(self.key.unbind(0)), list(self.value.unbind(0)), src, dst)
