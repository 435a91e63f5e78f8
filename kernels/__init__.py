"""Attention kernels over the paged KV cache. No engine imports: the engine calls in, never the reverse."""
from __future__ import annotations

from typing import Protocol

import torch

from kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, md: AttentionMetadata) -> None: ...

    def forward(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor: ...

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


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
