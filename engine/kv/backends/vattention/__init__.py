"""The vAttention backend (ASPLOS'25): each sequence's KV virtually contiguous, pages mapped on demand,
with the prefix sharing vAttention lacks (one physical page mapped into several sequences' ranges).

    cache.py        VAttentionCache: mapping (ahead and on demand) within the mapping limit, refusals, failure
    reservation.py  Reservation: the slots' virtual range, its per-layer strided views, the move to a bigger one
    slots.py        SlotTable: which sequence holds which slot, what each slot maps (deferred reclamation)
    vmm.py          VirtualMemory: reserve / map / unmap over Linux virtual memory (memfd + mmap MAP_FIXED)
"""
from __future__ import annotations

import torch

from engine.kv.backends.base import CacheSpec, KVBackend, KVStore
from engine.models.llama import ModelArgs
from kernels import Attention
from kernels.ops import Ops


def _create(spec: CacheSpec) -> KVStore:
    from engine.kv.backends.vattention.cache import VAttentionCache
    return VAttentionCache(spec.args, spec.num_blocks, spec.block_size, spec.dtype, spec.device, spec.max_model_len,
                           spec.max_num_seqs, ahead_tokens=spec.map_ahead_tokens, max_mappings=spec.max_mappings)


def _attention(kernels: str, ops: Ops) -> Attention:
    """Attention over contiguous ranges, no block table: torch SDPA over slot views on the CPU, the Triton
    kernels in their CONTIGUOUS mode on GPUs."""
    if kernels in ("torch", "cpu"):       # SDPA over the slots' views reads in place already
        from kernels.contiguous_torch import ContiguousTorchBackend
        return ContiguousTorchBackend()
    if kernels == "triton":
        from kernels.triton_backend import ContiguousTritonBackend
        return ContiguousTritonBackend()
    raise ValueError(f"unknown attention kernels {kernels!r}; choose 'torch' or 'triton'")


def _block_size(args: ModelArgs, dtype: torch.dtype, requested: int) -> int:
    """A block is a page, whose bytes must be whole OS pages: the smallest such size >= the one asked."""
    from engine.kv.backends.vattention.cache import page_block_size
    return page_block_size(args, dtype, requested)


BACKEND = KVBackend("vattention", _create, _attention, _block_size)
