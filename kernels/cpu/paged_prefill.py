"""Paged prefill attention on the CPU (kernels/cpu/paged_prefill.cpp): every prompt chunk of a step in one call,
each over its sequence's whole context read in place through the block table, GQA-aware, causal, and cascade:
sequences whose block tables start with the same blocks (a shared system prompt) walk those tiles once for all
of them instead of once each.

    q [num_tokens, num_heads, head_dim] float32 -> out, the same shape (rows of the listed sequences)
    key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim] bfloat16 or float32, head_dim contiguous

Four kinds of loops (`path`): on an AMX build, a bf16 cache's two products are AMX tiles (TDPBF16PS on blocks of 16
rows, "amx"; head_dim a multiple of 32); on a build with AVX-512 BF16, bf16 dot products with float32 sums
("avx512_bf16"); on an AVX-512 VNNI build without BF16 (Cascade Lake, Ice Lake), 16-bit integer dot products with
exact 32-bit sums ("avx512_vnni": q * scale, K and V rows each rounded with their own scale, the weights a row of a
tile at a time; kernels/cpu/i16_tile.h); everywhere else, and for float32 caches, float32 products with FMA
("avx512", "avx2", or "generic": portable loops). The AMX tiles share the bf16 tiles' packing, rounding and softmax
and differ from them only in the order of the float32 sums. `with_tiles(AMX)` forces them; on a build with AVX-512
BF16 and no AMX they then run emulated (kernels/cpu/amx_tile.h: the instructions' documented semantics, in memory),
which is how the tests check their logic on CPUs without AMX.

Agreement criteria (tested in tests/kernels/cpu/test_cpu_prefill.py, the AMX tiles emulated where there is no AMX):
- against float64 attention over the same cache: float32 products, within float32 rounding (2e-5 of the
  largest |V|); bf16 products (vector or AMX tiles), within 0.5% of the largest |V| (the kernel rounds q * scale
  and the softmax weights to bf16; measured 0.07-0.15%); int16 products, within the same 0.5% (each side rounded
  to 2^-13.5 of its vector's largest, at head_dim 64);
- bit for bit the same output for a token however its prompt was cut into chunks, however much of it came
  from the prefix cache, and with or without cascade, given the same K and V in the cache: every row walks
  the same tiles, aligned to absolute positions, with the same arithmetic, and the cascade only saves a row's
  softmax state after the shared tiles and resumes from it (no merge of partial sums). Whether the K / V rows
  another request wrote are bit for bit the ones this request would have written is the rest of the model's
  business: in the batch-invariant mode they are; by default the quantized layers pick their GEMM by the
  step's shape, so a request that hits another's blocks may read K / V that differ in the last bits (README,
  "Batch invariance").

Where it does not apply (other shapes or dtypes), `PagedPrefill.prefill` returns None and the caller keeps
its flash path.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BEST, VECTOR, AMX = 0, 1, 2      # `tiles`: the build's best loops, the vector tiles, the AMX tiles
BF16_PATHS = ("avx512_bf16", "amx")   # the loops (`path`, and PagedDecode.path) whose products are bf16
I16_PATHS = ("avx512_vnni",)          # the prefill loops whose products are 16-bit integers (rounded inputs)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    return (dtype in _DTYPES and head_dim % 16 == 0 and 0 < head_dim <= 256 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 16)


@dataclass(frozen=True)
class PrefillStats:
    """What one call's plan did (per KV head; for tests and the benchmark's bytes-read figures)."""

    groups: int              # cascade groups: sequences sharing leading tiles
    grouped_keys: int        # members x shared keys, summed over the groups: what their phase 1 covers
    keys: int                # keys walked in all, summed over the work items: K / V rows read per KV head
    packed_tiles: int = 0    # tiles packed once before the items, for all that walk them (int16 tiles; per KV head)


class PagedPrefill:
    """The kernel of one build (kernels/cpu/library.py loads it)."""

    def __init__(self, lib: ctypes.CDLL, tiles: int = BEST) -> None:
        f = lib.prefixserve_paged_prefill
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        f.argtypes = [p, p, p, p, i64, p, p, p, i, p, i, i, i, i, ctypes.c_float, i64, i64, i64, i64, i64, i64,
                      i, i, p, i]
        f.restype = ctypes.c_int
        self._lib = lib
        self._fn = f
        self._path = lib.prefixserve_paged_prefill_path
        self._path.argtypes = [i, i, i]
        self._path.restype = ctypes.c_char_p
        self.tiles = tiles

    def with_tiles(self, tiles: int) -> PagedPrefill:
        """The same build forced to `VECTOR` or `AMX` tiles (AMX: where they take the cache, a bf16 one with
        head_dim a multiple of 32, else the build's loops; emulated on a build with AVX-512 BF16 and no AMX)."""
        return PagedPrefill(self._lib, tiles)

    def path(self, dtype: torch.dtype = torch.bfloat16, head_dim: int = 64) -> str:
        """The loops a cache of this dtype runs with these tiles: amx or avx512_bf16 (bf16 products), avx512_vnni
        (int16 products), avx512, avx2 or generic (float32)."""
        return self._path(_DTYPES[dtype], head_dim, self.tiles).decode()

    def prefill(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, seqs: list[int],
                scale: float, out: torch.Tensor, cascade: bool = True) -> torch.Tensor | None:
        """Fills out's rows of the sequences `seqs` (the step's prompt chunks): sequence s's queries are rows
        query_start_loc[s] .. query_start_loc[s + 1] of q, the last positions of its seq_lens[s] tokens, whose
        K / V are already in the cache. Returns out, or None where the kernel does not apply."""
        return out if self._run(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, seqs, scale,
                                out, cascade) is not None else None

    def prefill_stats(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      seqs: list[int], scale: float, out: torch.Tensor, cascade: bool = True) -> PrefillStats | None:
        """`prefill`, returning what its plan did instead of out (None where the kernel does not apply)."""
        return self._run(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, seqs, scale, out,
                         cascade)

    def _run(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, seqs: list[int], scale: float, out: torch.Tensor,
             cascade: bool) -> PrefillStats | None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = key_cache.shape[2]
        if not supports(num_heads, num_kv_heads, head_dim, key_cache.dtype):
            return None
        assert q.dtype == out.dtype == torch.float32 and q.is_contiguous() and out.is_contiguous()
        assert q.shape == out.shape and key_cache.shape[3] == head_dim
        assert key_cache.dtype == value_cache.dtype and key_cache.shape == value_cache.shape
        assert key_cache.stride(-1) == value_cache.stride(-1) == 1
        block_tables = block_tables.contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        starts = query_start_loc.to(torch.int32).contiguous()
        assert block_tables.dtype == torch.int32 and lens.shape[0] == block_tables.shape[0] == starts.shape[0] - 1
        assert all(0 <= s < lens.shape[0] for s in seqs)
        which = torch.tensor(seqs, dtype=torch.int32)
        stats = torch.zeros(4, dtype=torch.int64)
        rc = self._fn(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
                      block_tables.stride(0), lens.data_ptr(), starts.data_ptr(), which.data_ptr(), len(seqs),
                      out.data_ptr(), num_heads, num_kv_heads, head_dim, key_cache.shape[1], scale,
                      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
                      value_cache.stride(1), value_cache.stride(2), _DTYPES[key_cache.dtype], int(cascade),
                      stats.data_ptr(), self.tiles)
        if rc != 0:
            return None
        groups, shared, keys, packed = stats.tolist()
        return PrefillStats(groups, shared, keys, packed)


__all__ = ["AMX", "BEST", "BF16_PATHS", "I16_PATHS", "VECTOR", "PagedPrefill", "PrefillStats", "supports"]
