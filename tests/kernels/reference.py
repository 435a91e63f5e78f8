"""Independent reference for the paged-attention kernels: plain torch, float64, one token at a time.

Shares no code with kernels/: every K/V row is fetched by walking the block table for its position
(block = table[pos // block_size], offset = pos % block_size), and attention is the textbook
softmax(q k^T * scale) v for each query token and head separately. Slow on purpose: obviously right.
"""
from __future__ import annotations

import math

import torch


def gather_token(cache: torch.Tensor, block_table: list[int], pos: int) -> torch.Tensor:
    """The [num_kv_heads, head_dim] row of the token at `pos`, through the block table."""
    block_size = cache.shape[1]
    return cache[block_table[pos // block_size], pos % block_size]


def ref_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                  scale: float) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim] float64.

    Query token j of sequence i sits at position seq_len - query_len + j and sees positions <= its own.
    """
    num_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64, device="cpu")
    q64 = q.detach().to("cpu", torch.float64)
    tables = block_tables.tolist()
    row = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        # Walk the table token by token: keys[p] / values[p] are [num_kv_heads, head_dim].
        keys = [gather_token(key_cache, tables[i], p).to("cpu", torch.float64) for p in range(seq_len)]
        values = [gather_token(value_cache, tables[i], p).to("cpu", torch.float64) for p in range(seq_len)]
        k_all = torch.stack(keys) if keys else torch.empty(0, num_kv_heads, q.shape[2], dtype=torch.float64)
        v_all = torch.stack(values) if values else k_all
        for j in range(q_len):
            pos = seq_len - q_len + j
            for kvh in range(num_kv_heads):
                heads = slice(kvh * group, (kvh + 1) * group)  # query heads h with h // group == kvh
                k = k_all[: pos + 1, kvh]                      # [pos + 1, head_dim]
                v = v_all[: pos + 1, kvh]
                scores = (q64[row + j, heads] @ k.T) * scale   # [group, pos + 1]
                scores = scores - scores.max(dim=1, keepdim=True).values
                weights = scores.exp()
                out[row + j, heads] = (weights / weights.sum(dim=1, keepdim=True)) @ v
        row += q_len
    return out


def ref_kv_write(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New (cloned) caches with token t written at row kv_rows[t]; negative rows are skipped."""
    kc, vc = key_cache.clone(), value_cache.clone()
    block_size = kc.shape[1]
    for t, row in enumerate(kv_rows.tolist()):
        if row < 0:
            continue
        kc[row // block_size, row % block_size] = key[t].to(kc.dtype)
        vc[row // block_size, row % block_size] = value[t].to(vc.dtype)
    return kc, vc


def ref_copy_blocks(caches: list[torch.Tensor], src: list[int], dst: list[int]) -> list[torch.Tensor]:
    """New (cloned) caches where every token row of block dst[i] equals that of block src[i]."""
    out = [c.clone() for c in caches]
    for c_new, c_old in zip(out, caches):
        for s, d in zip(src, dst):
            for off in range(c_old.shape[1]):
                c_new[d, off] = c_old[s, off]
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
