"""Random paged batches for the kernel tests: caches, block tables and AttentionMetadata.

Physical blocks are handed out in a seeded random order (never 0, 1, 2, ...), so a kernel that
ignores the block table fails. Every cache slot no sequence owns (unallocated blocks, and the tail
of each sequence's last block) holds `poison` (NaN by default), so a kernel that reads past a
sequence's length without masking the load fails too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedBatch:
    q: torch.Tensor            # [num_tokens, num_heads, head_dim]
    key: torch.Tensor          # [num_tokens, num_kv_heads, head_dim] this step's new K (already in the cache)
    value: torch.Tensor
    key_cache: torch.Tensor    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    md: AttentionMetadata
    tables: list[list[int]]    # physical blocks of each sequence, in logical order


def make_metadata(seq_lens: list[int], query_lens: list[int], tables: list[list[int]], block_size: int,
                  device: str = DEVICE) -> AttentionMetadata:
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    slots = []
    for seq_len, q_len, table in zip(seq_lens, query_lens, tables):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        kv_rows=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens_list=list(seq_lens), query_lens_list=list(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )


def make_batch(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0, spare_blocks: int = 3,
               poison: float = float("nan"), device: str = DEVICE) -> PagedBatch:
    """A batch whose cache already holds every sequence's context, new tokens included."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, poison, dtype=dtype)
    value_cache = torch.full(shape, poison, dtype=dtype)
    keys, values = [], []
    for seq_len, q_len, table in zip(seq_lens, query_lens, tables):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(seq_len):
            key_cache[table[pos // block_size], pos % block_size] = k[pos]
            value_cache[table[pos // block_size], pos % block_size] = v[pos]
        keys.append(k[seq_len - q_len:])
        values.append(v[seq_len - q_len:])
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device), key=torch.cat(keys).to(device), value=torch.cat(values).to(device),
        key_cache=key_cache.to(device), value_cache=value_cache.to(device),
        md=make_metadata(seq_lens, query_lens, tables, block_size, device), tables=tables)


def rebuild(batch: PagedBatch, block_size: int, seed: int) -> PagedBatch:
    """The same token contents laid out with another block size and another random block order."""
    md = batch.md
    num_kv_heads, head_dim = batch.key_cache.shape[2:]
    old_bs = batch.key_cache.shape[1]
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in md.seq_lens_list]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.full(shape, float("nan"), dtype=batch.key_cache.dtype, device=batch.key_cache.device)
    vc = torch.full_like(kc, float("nan"))
    tables, used = [], 0
    for seq_len, old_table, n in zip(md.seq_lens_list, batch.tables, needed):
        table = order[used:used + n]
        used += n
        for pos in range(seq_len):
            src = (old_table[pos // old_bs], pos % old_bs)
            kc[table[pos // block_size], pos % block_size] = batch.key_cache[src]
            vc[table[pos // block_size], pos % block_size] = batch.value_cache[src]
        tables.append(table)
    return PagedBatch(q=batch.q, key=batch.key, value=batch.value, key_cache=kc, value_cache=vc,
                      md=make_metadata(md.seq_lens_list, md.query_lens_list, tables, block_size,
                                       str(batch.q.device)), tables=tables)


# L16 orthogonal array: 16 rows over five 4-level factors in which every pair of factors shows all
# 16 level combinations (columns a, b, a+b, a+2b, a+3b over GF(4)). It stands in for the full cross
# product, which the interpreter cannot afford: any bug that needs only two factors to line up is hit.
_L16 = [(0, 0, 0, 0, 0), (0, 1, 1, 2, 3), (0, 2, 2, 3, 1), (0, 3, 3, 1, 2), (1, 0, 1, 1, 1), (1, 1, 0, 3, 2),
        (1, 2, 3, 2, 0), (1, 3, 2, 0, 3), (2, 0, 2, 2, 2), (2, 1, 3, 0, 1), (2, 2, 0, 1, 3), (2, 3, 1, 3, 0),
        (3, 0, 3, 3, 3), (3, 1, 2, 1, 0), (3, 2, 1, 0, 2), (3, 3, 0, 2, 1)]


def pairwise(*factors: list) -> list[tuple]:
    """Up to five 4-level factors -> 16 combinations covering every pair of levels."""
    assert len(factors) <= 5 and all(len(f) == 4 for f in factors)
    return [tuple(f[row[i]] for i, f in enumerate(factors)) for row in _L16]


# Output tolerance against the float64 reference, per dtype (see each test for the why).
#   fp32: only summation order differs (and exp2 vs exp), errors ~1e-6 for N(0, 1) data.
#   fp16: the output is rounded to fp16 (half an ulp is 2^-11 relative) and, on GPU, the softmax
#         weights are rounded to fp16 before the P @ V product: a few 2^-11 relative.
#   bf16: the same with 8 mantissa bits: half an ulp is 2^-9 relative (a whole ulp, 2^-8, under
#         TRITON_INTERPRET=1, whose fp32->bf16 cast truncates), so 2^-6 covers it with margin for
#         outputs near zero, where the error is relative to sum |p v| rather than to the output.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
