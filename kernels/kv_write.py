"""KV write: scatter this step's new keys / values into their cache slots by slot mapping.

Grid (num_tokens, head groups): a program copies BLOCK_H heads of one new token's key and value
rows ([num_kv_heads, head_dim] each) to block slot // block_size, offset slot % block_size.
A negative slot (padding) is skipped, as in vLLM's reshape_and_cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kv_write_kernel(
    KEY, VALUE,                # [num_tokens, num_kv_heads, head_dim]
    KEY_CACHE, VALUE_CACHE,    # [num_blocks, block_size, num_kv_heads, head_dim]
    KV_ROWS,                   # [num_tokens] int64: block * BLOCK_SIZE + offset, < 0: skip
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    head_group = tl.program_id(1)
    row = tl.load(KV_ROWS + tok).to(tl.int64)
    if row < 0:
        return
    block = row // BLOCK_SIZE
    offset = row % BLOCK_SIZE

    offs_h = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(KEY + tok.to(tl.int64) * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :],
                mask=mask)
    v = tl.load(VALUE + tok.to(tl.int64) * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :],
                mask=mask)
    kc = KEY_CACHE + block * stride_kc_block + offset * stride_kc_tok
    vc = VALUE_CACHE + block * stride_vc_block + offset * stride_vc_tok
    tl.store(kc + offs_h[:, None] * stride_kc_head + offs_d[None, :], k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vc_head + offs_d[None, :], v, mask=mask)


def kv_write(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kv_rows: torch.Tensor) -> None:
    """Write key / value [num_tokens, num_kv_heads, head_dim] into the caches at kv_rows [num_tokens]."""
    assert key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype
    assert key_cache.dim() == 4, "cache must be [num_blocks, block_size, num_kv_heads, head_dim]"
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert key.shape == value.shape and key.dim() == 3 and key.shape[1:] == (num_kv_heads, head_dim), \
        f"key {tuple(key.shape)} does not match cache heads/dim ({num_kv_heads}, {head_dim})"
    assert key.dtype.is_floating_point and value.dtype.is_floating_point
    assert kv_rows.dim() == 1 and kv_rows.shape[0] == key.shape[0]
    assert kv_rows.dtype in (torch.int32, torch.int64)
    # The last dim must be unit-stride (vectorized rows); heads and tokens may be strided
    # (e.g. key / value sliced out of a fused qkv projection).
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "head_dim must be the contiguous dimension"
    assert key.device == key_cache.device == kv_rows.device
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # NOTE: a source in another dtype (fp32 projection, bf16 cache) is cast here by torch, which
    # rounds to nearest-even on every device; the Triton interpreter's fp32->bf16 cast truncates,
    # so an in-kernel cast would make CPU tests and GPU disagree. The kernel is a pure copy.
    key = key.to(key_cache.dtype)
    value = value.to(value_cache.dtype)
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_dim_pad))  # <= 4K elements
    kv_write_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        key, value, key_cache, value_cache, kv_rows,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=block_h, HEAD_DIM_PAD=head_dim_pad,
    )
