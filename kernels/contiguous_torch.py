"""Attention over a contiguous (vAttention) KV cache in plain torch: the CPU path, no block table.

Cache layout: key_cache / value_cache are [num_slots, slot_len, num_kv_heads, head_dim], any strides
with head_dim contiguous and stride(0) == slot_len * stride(1) (the vAttention cache's per-layer views
are strided: a token row is 2 * num_layers * num_kv_heads * head_dim elements apart). Sequence i of a
step lives in slot md.slot_ids[i], positions 0 .. seq_len - 1, and nothing past them is mapped: no
read may go there. Each sequence attends over a view of its slot's rows: SDPA reads the cache in
place, where the paged path first gathers every row through the block table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.metadata import AttentionMetadata
from kernels.torch_backend import attend

if TYPE_CHECKING:
    from kernels.cpu.paged_decode import DecodePlan


class ContiguousTorchBackend:
    name = "torch"

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, md: AttentionMetadata) -> None:
        # key / value: [num_tokens, num_kv_heads, head_dim]; kv_rows: rows of the [slots * slot_len] view
        key_cache.flatten(0, 1).index_copy_(0, md.kv_rows, key.to(key_cache.dtype))
        value_cache.flatten(0, 1).index_copy_(0, md.kv_rows, value.to(value_cache.dtype))

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
        assert md.slot_ids is not None, "a contiguous cache needs slot ids"
        if md.is_decode_only:
            return self._decode(q, key_cache, value_cache, md, scale)
        out = torch.empty_like(q)
        starts = md.query_start_loc.tolist()
        for i, (slot, seq_len, q_len) in enumerate(zip(md.slot_ids.tolist(), md.seq_lens_list, md.query_lens_list)):
            s, e = starts[i], starts[i + 1]
            # the slot's first seq_len rows: a view, no copy, no table
            out[s:e] = attend(q[s:e], key_cache[slot, :seq_len].to(q.dtype), value_cache[slot, :seq_len].to(q.dtype),
                              scale, causal_offset=seq_len - q_len)
        return out

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        # One query token per sequence, attending over its slot's rows in place: no gather, no padding.
        # (A gather into a padded [S, max_len] batch, as the paged path does, copies every row first:
        # measured 2-4x slower here on SmolLM2's shapes, 8-32 sequences of 256-1024 tokens.)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        # The query heads of one KV head form that head's "query rows": q [1, Hkv, G, D] vs k [1, Hkv, L, D].
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = torch.empty_like(qg)
        for i, (slot, seq_len) in enumerate(zip(md.slot_ids.tolist(), md.seq_lens_list)):  # type: ignore[union-attr]
            k = key_cache[slot, :seq_len].transpose(0, 1)[None].to(q.dtype)     # (a bf16 cache: a float copy)
            v = value_cache[slot, :seq_len].transpose(0, 1)[None].to(q.dtype)
            out[i:i + 1] = torch.nn.functional.scaled_dot_product_attention(qg[i:i + 1], k, v, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)
