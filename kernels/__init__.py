"""Attention kernels over the paged KV cache and the contiguous (vAttention) one.

No engine imports: the engine calls in, never the reverse."""
from __future__ import annotations

from typing import Protocol

import torch

from kernels.metadata import AttentionMetadata


class Attention(Protocol):
    """Writes a step's new K/V into the cache and attends over it. Paged caches are [num_blocks,
    block_size, Hkv, D] read through md.block_tables; contiguous (vAttention) caches are [num_slots,
    slot_len, Hkv, D] read through md.slot_ids."""

    name: str

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, md: AttentionMetadata) -> None: ...

    def forward(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor: ...


class AttentionBackend(Attention, Protocol):
    """Attention over a paged cache, and the paged cache's block copy (copy-on-write)."""

    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    src: torch.Tensor, dst: torch.Tensor) -> None: ...


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from kernels.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from kernels.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


def get_contiguous_backend(name: str) -> Attention:
    if name == "torch":
        from kernels.contiguous_torch import ContiguousTorchBackend
        return ContiguousTorchBackend()
    if name == "triton":
        from kernels.triton_backend import ContiguousTritonBackend
        return ContiguousTritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


__all__ = ["AttentionBackend", "AttentionMetadata", "Attention", "get_backend", "get_contiguous_backend"]
