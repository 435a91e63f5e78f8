"""KV write kernel (and the torch backend's write_kv) against the token-by-token reference."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_write import kv_write
from kernels.torch_backend import TorchAttentionBackend
from tests.kernels.batch import DEVICE, make_metadata
from tests.kernels.reference import ref_kv_write


def _caches(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(block_size * 100 + head_dim)
    kc = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    vc = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return kc, vc, gen


@pytest.mark.parametrize("block_size,heads,head_dim,src_dtype,cache_dtype", [
    (1, 1, 32, torch.float32, torch.float32),
    (8, 2, 48, torch.float16, torch.float16),
    (16, 8, 128, torch.bfloat16, torch.bfloat16),
    (32, 3, 80, torch.float32, torch.bfloat16),   # fp32 projection into a bf16 cache: rounded on store
    (16, 4, 96, torch.float32, torch.float16),
    (4, 40, 128, torch.float16, torch.float16),   # 40 heads: two head groups per token (32 + 8 masked)
])
def test_kv_write_matches_reference(block_size: int, heads: int, head_dim: int, src_dtype: torch.dtype,
                                    cache_dtype: torch.dtype) -> None:
    kc, vc, gen = _caches(12, block_size, heads, head_dim, cache_dtype)
    num_slots = 12 * block_size
    num_tokens = min(37, num_slots)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]          # distinct, any block, any offset
    slots[::5] = -1                                                        # padding tokens: skipped
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(src_dtype).to(DEVICE)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(src_dtype).to(DEVICE)
    exp_k, exp_v = ref_kv_write(kc.cpu(), vc.cpu(), key.cpu(), value.cpu(), slots)
    kv_write(kc, vc, key, value, slots.to(DEVICE))
    # Exact: a copy, and a cast that rounds to nearest-even like torch's .to().
    torch.testing.assert_close(kc.cpu(), exp_k, atol=0, rtol=0)
    torch.testing.assert_close(vc.cpu(), exp_v, atol=0, rtol=0)


def test_kv_write_strided_source() -> None:
    # key / value as views into a fused [tokens, q + k + v heads, head_dim] projection.
    kc, vc, gen = _caches(6, 16, 2, 64, torch.float16)
    qkv = torch.randn(20, 8 + 2 + 2, 64, generator=gen).to(torch.float16).to(DEVICE)
    key, value = qkv[:, 8:10], qkv[:, 10:12]
    slots = torch.arange(20, dtype=torch.int64) * 4 + 3
    exp_k, exp_v = ref_kv_write(kc.cpu(), vc.cpu(), key.cpu(), value.cpu(), slots)
    kv_write(kc, vc, key, value, slots.to(DEVICE))
    torch.testing.assert_close(kc.cpu(), exp_k, atol=0, rtol=0)  # exact: a plain copy
    torch.testing.assert_close(vc.cpu(), exp_v, atol=0, rtol=0)


def test_torch_backend_write_kv_matches_reference() -> None:
    kc, vc, gen = _caches(8, 16, 2, 48, torch.bfloat16)
    tables = [[5, 2], [7], [0, 3, 6]]
    md = make_metadata([20, 9, 40], [4, 9, 1], tables, block_size=16)
    n = md.kv_rows.shape[0]
    key = torch.randn(n, 2, 48, generator=gen).to(DEVICE)
    value = torch.randn(n, 2, 48, generator=gen).to(DEVICE)
    exp_k, exp_v = ref_kv_write(kc.cpu(), vc.cpu(), key.cpu(), value.cpu(), md.kv_rows.cpu())
    TorchAttentionBackend().write_kv(kc, vc, key, value, md)
    torch.testing.assert_close(kc.cpu(), exp_k, atol=0, rtol=0)  # exact: copy plus the same bf16 cast
    torch.testing.assert_close(vc.cpu(), exp_v, atol=0, rtol=0)
