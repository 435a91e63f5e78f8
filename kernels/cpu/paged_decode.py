"""Paged decode attention on the CPU (kernels/cpu/paged_decode.cpp): one query token per sequence, K and V
read in place through the block table, GQA-aware, split-KV when a few long sequences would leave threads
idle, and cascade: sequences whose tables start with the same blocks (a shared prefix, the workload this
engine is for) read those blocks once per step for all of them. The launcher checks shapes, dtypes and
strides and makes the work plan (`plan`); the C++ file has the algorithm.

    q [num_seqs, num_heads, head_dim] float32 -> out, the same shape
    key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim] float32 or bfloat16
    (any strides with head_dim contiguous: a layer's slice of the [layers, blocks, ...] cache)

NOTE: products. Over a bf16 cache (head_dim a multiple of 32), an AVX-512 BF16 build (path "avx512_bf16") computes
scores and values as bf16 dot products (vdpbf16ps, the prefill kernel's tiles: kernels/cpu/bf16_tile.h), q * scale
and the softmax weights rounded to bf16, the running max, sum and accumulators float32; agreement criterion: within
0.5% of the largest |V| of the float64 reference, as the prefill kernel's bf16 tiles. On an AMX build (path "amx"),
an item of 16 query rows or more (a cascade group's members over their shared prefix: 6 or more sequences at 3
query heads a KV head) runs the same tile's two products as AMX tiles on blocks of 16 rows (kernels/cpu/amx_tile.h;
the same packing, rounding and softmax, float32 sums in another order: the same criterion); `set_tiles` forces them
on any build with AVX-512 BF16, emulated, which is how the tests check them on CPUs without AMX (not run on AMX
silicon yet, speed not measured). Every other build and
head_dim, and float32 caches everywhere, keep float32 products (within float32 rounding). Measured on a Zen 4, in
process, the two builds alternating: the offline throughput load 487 / 500 -> 530 / 517 tok/s; 15 sequences sharing
a 3,072-token prefix (cascade), 30 layers: 34-44 -> 31-34 ms. Once, bf16 products were taken out: rounding each
step's query to bf16 turned the last-bit differences between two ways of computing the same prompt (a pinned prefix,
or the prompt inline) into different greedy tokens a few tokens later (tests/service/openai/test_real_model_http.py,
named prefix against inline). Those differences came from oneDNN's GEMM, whose rows depend on the step's row count;
a GGUF Q4 layer's wide steps now run kernels/cpu/int4_gemm.py gemm_bf16, whose rows do not, and the test passes.

NOTE: a decode step's K / V are far larger than L3 (64 sequences of ~200 tokens: ~350 MB over 30 layers), so
their reads, not the arithmetic, set its time. The kernel reads each tile's rows a tile ahead, and an item's
first tile an item ahead, with plain loads (a byte a cache line), not prefetch instructions. Measured on a Zen 3
(AVX2, 2 cores), 64 sequences of 130-250 tokens, 30 layers' caches, bf16, in one process alternating with the
kernel before this: 97 -> 50 ns per token and KV head on one thread, 104 -> 61 ns per thread on two (medians of
30); `__builtin_prefetch` of the same lines a tile ahead gave 91 -> 76-81. In the engine, a 64-row decode step's
attention went 45.6 -> 30.7 ms. The AVX2 loops compute scores row by row (a K row widened once for the rows of
its KV head, queries as memory operands) instead of transposing K: the same time with the data in cache, and
less code; its bf16 widening splits each 32-bit word into its two halves (no shuffle), so queries and
accumulators keep [0, 2, .., 14, 1, 3, .., 15] order per 16 dimensions inside the kernel.

NOTE: where the rest of a step goes on a Zen 4 (AVX-512 BF16 build, 2 threads; the same 64 sequences of 130-250
tokens, 30 layers, a plan made once as the engine does): ~22 ms, of which ~13 ms are the reads (the kernel with its
arithmetic taken out: ~21 GB/s of the ~24.5 this machine streams) and ~7.6 ms the arithmetic (all of it, with every
block in cache: packing K and V into tiles ~40% of that), one after the other: the reads a tile ahead do not overlap
the tile's arithmetic. Tried to overlap them, each against this kernel, builds alternating (ms for 30 layers: the
medians of five runs for the first, the runs' ranges for the others): the reads split into one part before each KV
head's tile, 22.3 against 22.5 (no gain); loads spread inside the tile's loops, 30-36 against 25-27; `_mm_prefetch`
spread inside them, 26-29 against 20-26; the next tile packed straight from memory instead of read ahead, 25-31
against 22-25. None kept.

The plan is a list of items (members, blocks [b0, b1)): every sequence's blocks are covered exactly once
for it, by its own items or by the shared items of its cascade group. Cascading changes only the order in
which a sequence's partial softmax sums are merged: the result agrees with the plain plan within float32
rounding (tested), not bit for bit. So does the split: by default a sequence is cut into as many items as
keep every thread busy (a function of the batch and the thread count); `split_blocks` cuts every sequence
into items of that many blocks instead, and without cascade a sequence's output is then a function of its
own context only, bit for bit, whatever else the step holds (the batch-invariant mode, tested).
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MIN_BLOCKS_PER_SPLIT = 4     # a split of fewer blocks costs more to merge than it saves
MIN_SHARED_BLOCKS = 2        # a shared run of fewer blocks is read by each sequence itself
MAX_MEMBERS = 16             # sequences per cascade item (the kernel's bound); a larger group takes several
ITEMS_PER_THREAD = 4         # enough items that dynamic scheduling evens out their lengths


@dataclass(frozen=True)
class DecodePlan:
    """What every layer's call of a decode step shares: made once per step (`plan`)."""

    block_tables: torch.Tensor      # [S, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor          # [S] int32
    rows: torch.Tensor | None       # [S] int64: the cache row of each sequence's new token (None: no write)
    items: np.ndarray               # [n_items, 4] int32: (first member in `members`, member count, b0, b1)
    members: np.ndarray             # [*] int32: sequence indices
    shared_blocks: int              # block reads the cascade saves per layer and KV head (for stats and tests)


def plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor | None, block_size: int,
         threads: int | None = None, splits: int | None = None, cascade: bool = True,
         split_blocks: int | None = None) -> DecodePlan:
    """The step's work items. `splits` forces each sequence's own blocks into that many items (tests);
    `split_blocks` cuts them into items of that many blocks (the last one shorter); `cascade=False` gives
    every sequence only its own items."""
    block_tables = block_tables.contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert rows is None or (rows.dtype == torch.int64 and rows.is_contiguous() and rows.shape == seq_lens.shape)
    lens = seq_lens.numpy()
    assert lens.size == 0 or lens.min() >= 1, "a decode row attends to at least its own token"
    num_blocks = (lens + block_size - 1) // block_size
    assert lens.size == 0 or block_tables.shape[1] >= num_blocks.max(), "every block must be in its table row"
    tables = block_tables.numpy()
    n = len(lens)
    own_from = np.zeros(n, dtype=np.int64)
    shared: list[tuple[list[int], int, int]] = []
    if cascade and n > 1:
        full = (lens - 1) // block_size           # blocks full for the sequence and not holding its last token
        heads = tables[full >= MIN_SHARED_BLOCKS, 0]
        if len(heads) > 1 and len(np.unique(heads)) < len(heads):      # some start alike: look closer (Python)
            _find_shared(tables, full, list(range(n)), 0, own_from, shared)
    segments = [(group[i:i + MAX_MEMBERS], b0, b1) for group, b0, b1 in shared
                for i in range(0, len(group), MAX_MEMBERS)]
    seg_b0 = np.asarray([b0 for _, b0, _ in segments], dtype=np.int64)
    seg_b1 = np.asarray([b1 for _, _, b1 in segments], dtype=np.int64)
    own_len, seg_len = num_blocks - own_from, seg_b1 - seg_b0
    # pieces a run of blocks is cut into, own runs first (NOTE: numpy over the sequences: no Python loop a
    # sequence unless a cascade group exists)
    if splits is not None:
        own_pieces, seg_pieces = np.full(n, splits, dtype=np.int64), np.ones(len(segments), dtype=np.int64)
    elif split_blocks is not None:
        own_pieces = np.maximum(1, -(-own_len // split_blocks))
        seg_pieces = np.maximum(1, -(-seg_len // split_blocks))
    else:
        target = ITEMS_PER_THREAD * (threads or torch.get_num_threads())
        size = max(MIN_BLOCKS_PER_SPLIT, -(-int(own_len.sum() + seg_len.sum()) // target))
        own_pieces, seg_pieces = np.maximum(1, own_len // size), np.maximum(1, seg_len // size)
    b0 = np.concatenate([own_from, seg_b0])
    length = np.concatenate([own_len, seg_len])
    pieces = np.concatenate([own_pieces, seg_pieces])
    run = np.repeat(np.arange(len(pieces)), pieces)                     # the run each item cuts
    i = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)    # the item's index in its run
    if split_blocks is not None and splits is None:
        a = b0[run] + i * split_blocks
        b = np.minimum(a + split_blocks, b0[run] + length[run])
    else:                                                               # near-equal parts
        a = b0[run] + length[run] * i // pieces[run]
        b = b0[run] + length[run] * (i + 1) // pieces[run]
    sizes = np.concatenate([np.ones(n, dtype=np.int64), [len(g) for g, _, _ in segments]]).astype(np.int64)
    firsts = np.cumsum(sizes) - sizes
    items = np.stack([firsts[run], sizes[run], a, b], axis=1).astype(np.int32)
    members = np.concatenate([np.arange(n, dtype=np.int64), *[np.asarray(g, dtype=np.int64) for g, _, _ in segments]])
    saved = sum((len(g) - 1) * (b1 - b0) for g, b0, b1 in shared)
    return DecodePlan(block_tables, seq_lens, rows, items.reshape(-1, 4), members.astype(np.int32), saved)


def _find_shared(tables: np.ndarray, full: np.ndarray, group: list[int], start: int, own_from: np.ndarray,
                 out: list[tuple[list[int], int, int]]) -> None:
    """Sequences of `group` whose tables agree on blocks [start, P), P >= start + MIN_SHARED_BLOCKS and
    within every member's full blocks, become a cascade segment; their own blocks start at P, and the
    same is looked for again past P (a common system prompt, then a few-shot template some requests share)."""
    by_block: dict[int, list[int]] = {}
    for s in group:
        if full[s] - start >= MIN_SHARED_BLOCKS:
            by_block.setdefault(int(tables[s, start]), []).append(s)
    for sub in by_block.values():
        if len(sub) < 2:
            continue
        cap = int(full[sub].min())
        block = tables[sub, start:cap]
        same = (block == block[0]).all(axis=0)
        end = start + (int(same.argmin()) if not same.all() else cap - start)
        if end - start < MIN_SHARED_BLOCKS:
            continue
        out.append((sub, start, end))
        own_from[sub] = end
        _find_shared(tables, full, sub, end, own_from, out)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    return (dtype in _DTYPES and head_dim % 16 == 0 and head_dim // 16 in (1, 2, 3, 4, 5, 6, 8, 16)
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16 and num_heads <= 64
            and block_size <= 256)


def cache_args(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """What the kernel takes of a layer's caches besides their pointers: K's block, token and head strides, V's, and
    the dtype's code."""
    return (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
            value_cache.stride(2), _DTYPES[key_cache.dtype])


class PagedDecode:
    """The kernel of one build (kernels/cpu/library.py loads it): `write_attend` for a decode step's layer,
    `attend` (a plan made once for a step's rows) and `decode` (a plan made by the call) for rows whose K / V are
    already in the cache."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        f = lib.prefixserve_paged_decode
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        f.argtypes = [p, p, p, i64, i64, i64, i64, p, p, p, p, i64, p, p, i, i, i, i, i, ctypes.c_float,
                      i64, i64, i64, i64, i64, i64, i, p, i, p]
        f.restype = ctypes.c_int
        self._fn = f
        lib.prefixserve_paged_decode_path.restype = ctypes.c_char_p
        # the loops it runs: amx, avx512_bf16, avx512, avx2, generic
        self.path: str = lib.prefixserve_paged_decode_path().decode()
        self._set_tiles = lib.prefixserve_paged_decode_set_tiles
        self._set_tiles.argtypes = [i]
        self._set_tiles.restype = i
        self.num_threads = lib.prefixserve_num_threads               # its OpenMP threads (torch's)
        self.num_threads.restype = ctypes.c_int

    def set_tiles(self, tiles: int) -> int:
        """Which tiles this build's calls take from now on, process-wide (a test hook; kernels/cpu/paged_prefill.py
        BEST, VECTOR, AMX: AMX runs a cascade group's items of 16 rows or more as AMX tiles, emulated on a build with
        AVX-512 BF16 and no AMX); returns the previous setting."""
        previous = self._set_tiles(tiles)
        if previous < 0:
            raise ValueError(f"tiles must be 0, 1 or 2, not {tiles}")
        return previous

    @contextlib.contextmanager
    def forced_tiles(self, tiles: int) -> Iterator[None]:
        """`set_tiles(tiles)` for the block, the previous setting back after it."""
        previous = self.set_tiles(tiles)
        try:
            yield
        finally:
            self.set_tiles(previous)

    def _call(self, q: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, key_cache: torch.Tensor,
              value_cache: torch.Tensor, p: DecodePlan, scale: float, out: torch.Tensor) -> None:
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        kp = vp = 0
        ks = (0, 0, 0, 0)
        rows = 0
        if key is not None and value is not None:
            assert p.rows is not None
            kp, vp, rows = key.data_ptr(), value.data_ptr(), p.rows.data_ptr()
            ks = (key.stride(0), key.stride(1), value.stride(0), value.stride(1))
        items, members = p.items, p.members
        rc = self._fn(q.data_ptr(), kp or None, vp or None, *ks, rows or None, key_cache.data_ptr(),
                      value_cache.data_ptr(), p.block_tables.data_ptr(), p.block_tables.stride(0),
                      p.seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
                      block_size, scale, *cache_args(key_cache, value_cache), items.ctypes.data, len(items),
                      members.ctypes.data)
        if rc != 0:
            raise ValueError(f"paged_decode: shapes not taken by the CPU kernel (code {rc})")

    def write_attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, p: DecodePlan, scale: float) -> torch.Tensor:
        """Writes key / value [S, Hkv, D] (float32) at p.rows, then decodes q [S, H, D] -> out [S, H, D]: one
        call for a layer of a decode step (the hot path: its checks are the few a wrong call could not pass)."""
        num_seqs, _, head_dim = q.shape
        assert q.dtype == key.dtype == value.dtype == torch.float32 and q.is_contiguous()
        assert key.shape == value.shape == (num_seqs, key_cache.shape[2], head_dim)
        assert key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == 1
        assert key_cache.dtype == value_cache.dtype and p.seq_lens.shape[0] == num_seqs
        out = torch.empty_like(q)
        self._call(q, key, value, key_cache, value_cache, p, scale, out)
        return out

    def attend(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, p: DecodePlan,
               scale: float) -> torch.Tensor:
        """Decodes q [S, H, D] (float32) over K / V already in the cache, by a plan made for these rows (`plan`: a
        mixed step's decode rows, one plan for all of its layers) -> out [S, H, D]."""
        num_seqs, _, head_dim = q.shape
        assert q.dtype == torch.float32 and q.is_contiguous() and p.seq_lens.shape[0] == num_seqs
        assert key_cache.dtype == value_cache.dtype and key_cache.shape[3] == head_dim
        assert key_cache.stride(-1) == value_cache.stride(-1) == 1
        out = torch.empty_like(q)
        if num_seqs:
            self._call(q, None, None, key_cache, value_cache, p, scale, out)
        return out

    def write(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              rows: torch.Tensor) -> None:
        """Writes key / value [T, Hkv, D] float32 (head_dim contiguous, any other strides) at the cache rows `rows`
        [T] int64 (block * block_size + offset), rounded to the cache's dtype as torch's .to() rounds (to nearest
        even; a NaN stays a NaN, though not torch's bfloat16 NaN bits): torch's index_copy of the converted rows
        (kernels/torch_backend.py write_kv), in one pass and no temporaries."""
        t, num_kv_heads, head_dim = key.shape
        assert key.dtype == value.dtype == torch.float32 and key.shape == value.shape
        assert key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == 1
        assert key_cache.dtype == value_cache.dtype and key_cache.shape[2:] == (num_kv_heads, head_dim)
        assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.shape == (t,)
        if t == 0:
            return
        rc = self._fn(None, key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
                      value.stride(1), rows.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), None, 0, None,
                      None, t, num_kv_heads, num_kv_heads, head_dim, key_cache.shape[1], 1.0,
                      *cache_args(key_cache, value_cache), None, 0, None)
        if rc != 0:
            raise ValueError(f"paged_decode write: shapes not taken by the CPU kernel (code {rc})")

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, num_splits: int | None = None,
               cascade: bool = True, split_blocks: int | None = None) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, kv_dim = key_cache.shape
        assert q.dtype == torch.float32 and q.is_contiguous() and q.device.type == "cpu"
        assert key_cache.dtype == value_cache.dtype and key_cache.dtype in _DTYPES
        assert key_cache.shape == value_cache.shape and kv_dim == head_dim
        assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "head_dim must be contiguous"
        assert supports(num_heads, num_kv_heads, head_dim, block_size, key_cache.dtype)
        assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 and block_tables.shape[0] == num_seqs
        assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.shape == (num_seqs,)
        if out is None:
            out = torch.empty_like(q)
        assert out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous()
        if num_seqs == 0:
            return out
        p = plan(block_tables, seq_lens, None, block_size, splits=num_splits, cascade=cascade,
                 split_blocks=split_blocks)
        self._call(q, None, None, key_cache, value_cache, p, scale, out)
        return out


__all__ = ["DecodePlan", "PagedDecode", "cache_args", "plan", "supports"]
