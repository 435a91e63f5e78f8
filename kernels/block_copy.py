"""Block copy: copy whole cache blocks src[i] -> dst[i] in every layer (copy-on-write of a shared block).

One launch per layer moves that layer's key and value blocks; grid (num_pairs, chunks per block).
A block is block_size * num_kv_heads * head_dim contiguous elements, copied as raw elements.

NOTE: pairs run concurrently, so no dst block may also be a src block in the same call (the
allocator hands copy-on-write a fresh block, so this holds; torch's kc[dst] = kc[src] would
gather first and hide such a mix-up, this kernel would race).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # elements per program


@triton.jit
def block_copy_kernel(
    KEY_CACHE, VALUE_CACHE,    # [num_blocks, block_size, num_kv_heads, head_dim], each block contiguous
    SRC, DST,                  # [num_pairs] int64 block ids
    stride_kc_block, stride_vc_block,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(SRC + pair).to(tl.int64)
    dst = tl.load(DST + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    k = tl.load(KEY_CACHE + src * stride_kc_block + offs, mask=mask)
    tl.store(KEY_CACHE + dst * stride_kc_block + offs, k, mask=mask)
    v = tl.load(VALUE_CACHE + src * stride_vc_block + offs, mask=mask)
    tl.store(VALUE_CACHE + dst * stride_vc_block + offs, v, mask=mask)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], src: torch.Tensor,
                dst: torch.Tensor) -> None:
    """For every layer, block dst[i] of its key and value cache becomes a copy of block src[i]."""
    assert len(key_caches) == len(value_caches)
    assert src.dim() == 1 and src.shape == dst.shape, "src / dst must be [num_pairs]"
    assert src.dtype in (torch.int32, torch.int64) and dst.dtype in (torch.int32, torch.int64)
    num_pairs = src.shape[0]
    if num_pairs == 0 or not key_caches:
        return
    src = src.to(device=key_caches[0].device, dtype=torch.int64).contiguous()
    dst = dst.to(device=key_caches[0].device, dtype=torch.int64).contiguous()
    shape = key_caches[0].shape
    for kc, vc in zip(key_caches, value_caches):
        assert kc.shape == vc.shape == shape and kc.dtype == vc.dtype, "every layer's caches must match"
        assert kc[0].is_contiguous() and vc[0].is_contiguous(), "each block must be contiguous"
        assert kc.device == vc.device == src.device
        block_numel = kc[0].numel()
        block_copy_kernel[(num_pairs, triton.cdiv(block_numel, CHUNK))](
            kc, vc, src, dst, kc.stride(0), vc.stride(0), BLOCK_NUMEL=block_numel, CHUNK=CHUNK)
