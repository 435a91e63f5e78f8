"""Paged decode attention on the CPU (kernels/cpu/paged_decode.cpp): one query token per sequence, K and V
read in place through the block table, GQA-aware, split-KV when a few long sequences would leave threads
idle. The launcher checks shapes, dtypes and strides and picks the split count; the C++ file has the
algorithm.

    q [num_seqs, num_heads, head_dim] float32 -> out, the same shape
    key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim] float32 or bfloat16
    (any strides with head_dim contiguous: a layer's slice of the [layers, blocks, ...] cache)
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels.cpu.build import load

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MIN_BLOCKS_PER_SPLIT = 4


@functools.cache
def _fn() -> Any:
    lib = load("paged_decode")
    f = lib.prefixserve_paged_decode
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    f.argtypes = [p, p, p, p, i64, p, p, i, i, i, i, i, ctypes.c_float, i64, i64, i64, i64, i64, i64, i, i]
    f.restype = ctypes.c_int
    return f


@functools.cache
def _fn_write() -> Any:
    lib = load("paged_decode")
    f = lib.prefixserve_paged_decode_write
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    f.argtypes = [p, p, p, i64, i64, i64, i64, p, p, p, p, i64, p, p, i, i, i, i, i, ctypes.c_float, i64, i64, i64,
                  i64, i64, i64, i, i]
    f.restype = ctypes.c_int
    return f


@dataclass(frozen=True)
class DecodePlan:
    """What every layer's call of a decode step shares: made once per step (`plan`)."""

    block_tables: torch.Tensor      # [S, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor          # [S] int32
    rows: torch.Tensor              # [S] int64: the cache row of each sequence's new token
    max_blocks: int
    splits: int


def plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, max_seq_len: int, block_size: int,
         num_kv_heads: int) -> DecodePlan:
    block_tables = block_tables.contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.shape == seq_lens.shape
    max_blocks = -(-max_seq_len // block_size)
    assert block_tables.shape[1] >= max_blocks, "every sequence's blocks must be in its table row"
    splits = pick_splits(seq_lens.shape[0], num_kv_heads, max_blocks, torch.get_num_threads())
    return DecodePlan(block_tables, seq_lens, rows, max_blocks, splits)


def paged_decode_write(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, p: DecodePlan, scale: float) -> torch.Tensor:
    """Writes key / value [S, Hkv, D] (float32) at p.rows, then decodes q [S, H, D] -> out [S, H, D]: one
    call for a layer of a decode step (the hot path: its checks are the few a wrong call could not pass)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    assert q.dtype == key.dtype == value.dtype == torch.float32 and q.is_contiguous()
    assert key.shape == value.shape == (num_seqs, num_kv_heads, head_dim)
    assert key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == 1
    assert key_cache.dtype == value_cache.dtype and p.seq_lens.shape[0] == num_seqs
    out = torch.empty_like(q)
    rc = _fn_write()(q.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
                     value.stride(1), p.rows.data_ptr(),
                     key_cache.data_ptr(), value_cache.data_ptr(), p.block_tables.data_ptr(),
                     p.block_tables.stride(0), p.seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
                     num_kv_heads, head_dim, block_size, scale, key_cache.stride(0), key_cache.stride(1),
                     key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                     _DTYPES[key_cache.dtype], p.splits)
    if rc != 0:
        raise ValueError(f"paged_decode_write: shapes not taken by the CPU kernel (code {rc})")
    return out


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    return (dtype in _DTYPES and head_dim % 16 == 0 and head_dim // 16 in (1, 2, 3, 4, 5, 6, 8, 16)
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16 and block_size <= 256)


def pick_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, threads: int) -> int:
    """Enough (sequence, KV head, split) items for 4 per thread, never a split of < 4 blocks."""
    splits = 1
    while num_seqs * num_kv_heads * splits < 4 * threads and max_blocks // (2 * splits) >= MIN_BLOCKS_PER_SPLIT:
        splits *= 2
    return splits


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, scale: float, out: torch.Tensor | None = None,
                 num_splits: int | None = None) -> torch.Tensor:
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
    max_blocks = -(-max_seq_len // block_size)
    assert block_tables.shape[1] >= max_blocks, "every sequence's blocks must be in its table row"
    splits = num_splits or pick_splits(num_seqs, num_kv_heads, max_blocks, torch.get_num_threads())
    rc = _fn()(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
               block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads,
               head_dim, block_size, scale, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
               value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), _DTYPES[key_cache.dtype], splits)
    if rc != 0:
        raise ValueError(f"paged_decode: shapes not taken by the CPU kernel (code {rc})")
    return out
