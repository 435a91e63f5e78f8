"""The KV cache tensors on the device (the paged backend), how many blocks fit a memory budget, and the
small interface the model runner uses for either backend (paged here, vAttention in engine/vattention.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.models.llama import ModelArgs
from kernels import AttentionBackend


@dataclass
class Addressing:
    """Where one step's tokens live in a cache, as the attention backends read it."""

    rows: np.ndarray                       # [num_tokens] int64: each new token's K/V row (slot_mapping)
    block_tables: np.ndarray | None        # [num_seqs, max_blocks] int32 (paged)
    slot_ids: list[int] | None             # each sequence's slot (vAttention)


class KVStore(Protocol):
    """What the model runner needs of a KV cache, whichever backend holds it."""

    block_size: int

    def layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V indexed by layer first, as the model reads them."""
        ...

    def addressing(self, seq_ids: list[int], tables: list[list[int]], seq_lens: list[int],
                   seq_of_token: np.ndarray, positions: np.ndarray, decoding: list[bool]) -> Addressing:
        """Sequence i (`decoding[i]`: generating, not in its prompt) holds blocks tables[i] and
        seq_lens[i] tokens after this step; token t belongs to sequence seq_of_token[t], at positions[t]."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (copy-on-write of a shared partial block)."""
        ...


class KVCache:
    """key / value: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each.

    One allocation per K and V for all layers; layer i uses key[i] (a contiguous view). Block b's
    memory is the same row in every layer, so one block id names a token range in all layers.
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device, backend: AttentionBackend) -> None:
        shape = (args.num_layers, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.backend = backend

    @staticmethod
    def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem

    @classmethod
    def blocks_for_budget(cls, args: ModelArgs, block_size: int, dtype: torch.dtype, budget_bytes: float) -> int:
        return max(1, int(budget_bytes // cls.bytes_per_block(args, block_size, dtype)))

    def layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key, self.value

    def addressing(self, seq_ids: list[int], tables: list[list[int]], seq_lens: list[int],
                   seq_of_token: np.ndarray, positions: np.ndarray, decoding: list[bool]) -> Addressing:
        b = self.block_size
        padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            padded[i, :len(t)] = t
        rows = padded[seq_of_token, positions // b] * b + positions % b
        return Addressing(rows, padded.astype(np.int32), None)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """With the attention backend's block copy (a Triton kernel on GPUs)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.key.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.key.device)
        self.backend.copy_blocks(list(self.key.unbind(0)), list(self.value.unbind(0)), src, dst)
