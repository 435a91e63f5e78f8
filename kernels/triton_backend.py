"""TritonAttentionBackend: the GPU path, wiring the four Triton launchers behind the backend protocol;
ContiguousTritonBackend: the same kernels over a contiguous (vAttention) cache, slots instead of tables.

forward sends decode-only batches (one query token per sequence) to the split-KV decode kernel and
everything else (prefill chunks, prefix-hit extends, mixed batches) to the paged prefill kernel.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.block_copy import copy_blocks
from kernels.kv_write import kv_write
from kernels.metadata import AttentionMetadata
from kernels.paged_decode import contiguous_decode, paged_decode
from kernels.paged_prefill import contiguous_prefill, paged_prefill

if TYPE_CHECKING:
    from kernels.cpu.paged_decode import DecodePlan


class TritonAttentionBackend:
    name = "triton"

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, md: AttentionMetadata) -> None:
        # key / value: [num_tokens, num_kv_heads, head_dim]
        kv_write(key_cache, value_cache, key, value, md.kv_rows)

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(key_cache, value_cache, key, value, md)
        return self.forward(q, key_cache, value_cache, md, scale)

    def decode_plan(self, md: AttentionMetadata, key_cache: torch.Tensor, num_heads: int,
                    head_dim: int) -> DecodePlan | None:
        return None                     # no C++ decode kernel behind this backend (kernels.Attention)

    def forward(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim]
        if md.is_decode_only:
            assert q.shape[0] == md.num_seqs, "a decode-only batch has one query token per sequence"
            return paged_decode(q, key_cache, value_cache, md.block_tables, md.seq_lens, md.max_seq_len, scale)
        return paged_prefill(q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                             md.max_query_len, scale)

    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_blocks(key_caches, value_caches, src, dst)


class ContiguousTritonBackend(TritonAttentionBackend):
    """Caches are [num_slots, slot_len, Hkv, D] (kernels/contiguous_torch.py has the layout). write_kv is
    the paged one's (kv_write treats a slot as one block of slot_len tokens, kv_rows being
    slot * slot_len + position); the attention kernels run in their CONTIGUOUS mode."""

    def forward(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        assert md.slot_ids is not None, "a contiguous cache needs slot ids"
        if md.is_decode_only:
            return contiguous_decode(q, key_cache, value_cache, md.slot_ids, md.seq_lens, md.max_seq_len, scale)
        return contiguous_prefill(q, key_cache, value_cache, md.slot_ids, md.seq_lens, md.query_start_loc,
                                  md.max_query_len, scale)
