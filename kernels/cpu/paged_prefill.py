"""Paged prefill attention on the CPU for bfloat16 caches (kernels/cpu/paged_prefill.cpp): every prompt
chunk of a step in one call, each over its sequence's whole context read in place through the block
table, GQA-aware, causal, the products as bf16 dot products (AVX-512 BF16) with float32 sums.

    q [num_tokens, num_heads, head_dim] float32 -> out, the same shape (rows of the listed sequences)
    key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim] bfloat16, head_dim contiguous

Agreement criterion (tested in tests/kernels/cpu/test_cpu_prefill.py):
- against float64 attention over the same bf16 cache, each output within 0.5% of the largest |V| (the
  kernel rounds q * scale and the softmax weights to bf16; measured 0.07-0.15%);
- bit for bit the same output for a token however its prompt was cut into chunks, and however much of
  it came from the prefix cache, given the same K and V in the cache (every row walks the same tiles,
  aligned to absolute positions, with the same instructions). Whether the K / V rows another request wrote
  are bit for bit the ones this request would have written is the rest of the model's business: in the
  batch-invariant mode they are; by default the quantized layers pick their GEMM by the step's shape, so a
  request that hits another's blocks may read K / V that differ in the last bits (README, "Batch invariance").

Where it does not apply (a float32 cache, a build without AVX-512 BF16, other shapes), `PagedPrefill.prefill`
returns None and the caller keeps its flash path.
"""
from __future__ import annotations

import ctypes

import torch


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim // 16 in (2, 4, 6, 8, 16)
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16)


class PagedPrefill:
    """The kernel of one build (kernels/cpu/library.py loads it); `available`: this build has the bf16 loops."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.available = bool(lib.prefixserve_paged_prefill_available())
        f = lib.prefixserve_paged_prefill
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        f.argtypes = [p, p, p, p, i64, p, p, p, i, p, i, i, i, i, ctypes.c_float, i64, i64, i64, i64, i64, i64]
        f.restype = ctypes.c_int
        self._fn = f

    def prefill(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, seqs: list[int],
                scale: float, out: torch.Tensor) -> torch.Tensor | None:
        """Fills out's rows of the sequences `seqs` (the step's prompt chunks): sequence s's queries are rows
        query_start_loc[s] .. query_start_loc[s + 1] of q, the last positions of its seq_lens[s] tokens, whose
        K / V are already in the cache. Returns out, or None where the kernel does not apply."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = key_cache.shape[2]
        if not self.available or not supports(num_heads, num_kv_heads, head_dim, key_cache.dtype):
            return None
        assert q.dtype == out.dtype == torch.float32 and q.is_contiguous() and out.is_contiguous()
        assert key_cache.dtype == value_cache.dtype and key_cache.shape == value_cache.shape
        assert key_cache.stride(-1) == value_cache.stride(-1) == 1
        block_tables = block_tables.contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        starts = query_start_loc.to(torch.int32).contiguous()
        assert block_tables.dtype == torch.int32 and lens.shape[0] == block_tables.shape[0] == starts.shape[0] - 1
        which = torch.tensor(seqs, dtype=torch.int32)
        rc = self._fn(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
                      block_tables.stride(0), lens.data_ptr(), starts.data_ptr(), which.data_ptr(), len(seqs),
                      out.data_ptr(), num_heads, num_kv_heads, head_dim, key_cache.shape[1], scale,
                      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
                      value_cache.stride(1), value_cache.stride(2))
        return out if rc == 0 else None


__all__ = ["PagedPrefill", "supports"]
