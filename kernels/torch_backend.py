"""Attention on the paged KV cache in plain torch: the CPU path (vectorized, per sequence, not per token).

Cache layout (shared by every backend): key_cache / value_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; a token at position p of a sequence lives in
block block_table[p // block_size] at offset p % block_size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kernels.cpu.paged_decode import DecodePlan


class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, md: AttentionMetadata) -> None:
        # key / value: [num_tokens, num_kv_heads, head_dim]
        _, _, h, d = key_cache.shape
        key_cache.view(-1, h, d).index_copy_(0, md.kv_rows, key.to(key_cache.dtype))
        value_cache.view(-1, h, d).index_copy_(0, md.kv_rows, value.to(value_cache.dtype))

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
            return self._decode(q, key_cache, value_cache, md, scale)
        out = torch.empty_like(q)
        block_size = key_cache.shape[1]
        starts = md.query_start_loc.tolist()
        for i, (seq_len, q_len) in enumerate(zip(md.seq_lens_list, md.query_lens_list)):
            nb = -(-seq_len // block_size)
            blocks = md.block_tables[i, :nb].long()
            k = key_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)      # [seq_len, Hkv, D]
            v = value_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)
            s, e = starts[i], starts[i + 1]
            out[s:e] = attend(q[s:e], k, v, scale, causal_offset=seq_len - q_len)
        return out

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        # One query token per sequence: gather every sequence's context, padded to max_seq_len, by slot.
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        slots, mask, pad = _decode_gather(md, key_cache.shape[1])
        k = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(
            num_seqs, -1, num_kv_heads, head_dim).to(q.dtype).masked_fill_(pad, 0.0)
        v = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(
            num_seqs, -1, num_kv_heads, head_dim).to(q.dtype).masked_fill_(pad, 0.0)
        # The query heads of one KV head form that head's "query rows": q [S, Hkv, G, D] vs k [S, Hkv, L, D].
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.to(q.dtype), scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    src: torch.Tensor, dst: torch.Tensor) -> None:
        for kc, vc in zip(key_caches, value_caches):
            kc[dst] = kc[src]
            vc[dst] = vc[src]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int) -> torch.Tensor:
    # q: [Q, H, D]; k, v: [L, Hkv, D]; query row i sits at position causal_offset + i.
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    q_len, ctx = q.shape[0], k.shape[0]
    rows = torch.arange(q_len, device=q.device)[:, None] + causal_offset
    mask = torch.arange(ctx, device=q.device)[None, :] <= rows           # [Q, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _decode_gather(md: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cache row of every (sequence, position < max_seq_len), the additive mask of padded positions and
    the padding itself [S, L, 1, 1], computed once per step and shared by every layer (kept on the
    metadata object).

    NOTE: padded positions read row 0 (whatever it holds) and are masked with -inf; the gathered rows
    are also zeroed there, because a NaN in row 0 would otherwise reach the output (NaN x 0 weight).
    """
    cached = md.scratch.get("decode_gather")
    if cached is None:
        dev = md.block_tables.device
        pos = torch.arange(md.max_seq_len, device=dev)
        pad = pos[None, :] >= md.seq_lens[:, None].long()                               # [S, L]
        slots = md.block_tables.long()[:, pos // block_size] * block_size + pos % block_size
        mask = torch.zeros(pad.shape, device=dev).masked_fill_(pad, float("-inf"))[:, None, None, :]
        cached = (slots.masked_fill_(pad, 0).view(-1), mask, pad[:, :, None, None])    # [S * L], [S, 1, 1, L]
        md.scratch["decode_gather"] = cached
    return cached
