"""The paged backend (PagedAttention, the default): blocks of `block_size` tokens read through block tables.

    cache.py    PagedKVCache: K and V [num_layers, num_blocks, block_size, Hkv, D], block-table addressing
"""
from __future__ import annotations

import torch

from engine.kv.backends.base import CacheSpec, KVBackend, KVStore
from engine.models.llama import ModelArgs
from kernels import Attention
from kernels.ops import Ops


def _create(spec: CacheSpec) -> KVStore:
    from engine.kv.backends.paged.cache import PagedKVCache
    return PagedKVCache(spec)


def _attention(kernels: str, ops: Ops) -> Attention:
    """Paged attention: C++ and flash kernels or plain torch on the CPU, Triton on GPUs (kernels/); the C++
    build and the batch-invariant mode are the op layer's."""
    if kernels == "torch":
        from kernels.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if kernels == "cpu":
        from kernels.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend(ops.cpu, invariant=ops.config.batch_invariant)
    if kernels == "triton":
        from kernels.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention kernels {kernels!r}; choose 'torch', 'cpu' or 'triton'")


def _block_size(args: ModelArgs, dtype: torch.dtype, requested: int) -> int:
    return requested             # any block size


BACKEND = KVBackend("paged", _create, _attention, _block_size)
