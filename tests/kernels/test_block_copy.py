"""Block copy kernel (and the torch backend's copy_blocks) against the token-by-token reference."""
from __future__ import annotations

import pytest
import torch

from kernels.block_copy import copy_blocks
from kernels.torch_backend import TorchAttentionBackend
from tests.kernels.batch import DEVICE
from tests.kernels.reference import ref_copy_blocks


def _layers(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(num_layers * 7 + shape[1])
    return [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(num_layers)]


@pytest.mark.parametrize("block_size,heads,head_dim,dtype", [
    (1, 1, 32, torch.float32), (16, 8, 128, torch.bfloat16), (32, 3, 80, torch.float16)])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_copy_blocks_matches_reference(block_size: int, heads: int, head_dim: int, dtype: torch.dtype,
                                       backend: str) -> None:
    shape = (10, block_size, heads, head_dim)
    key_caches, value_caches = _layers(3, shape, dtype), _layers(3, shape, dtype)
    src, dst = [4, 0, 9], [1, 7, 2]   # no dst is also a src (the allocator's copy-on-write contract)
    exp_k = ref_copy_blocks([c.cpu() for c in key_caches], src, dst)
    exp_v = ref_copy_blocks([c.cpu() for c in value_caches], src, dst)
    src_t = torch.tensor(src, dtype=torch.int64, device=DEVICE)
    dst_t = torch.tensor(dst, dtype=torch.int64, device=DEVICE)
    if backend == "triton":
        copy_blocks(key_caches, value_caches, src_t, dst_t)
    else:
        TorchAttentionBackend().copy_blocks(key_caches, value_caches, src_t, dst_t)
    # Exact: a byte copy; every other block must be untouched.
    for got, exp in zip(key_caches + value_caches, exp_k + exp_v):
        torch.testing.assert_close(got.cpu(), exp, atol=0, rtol=0)


def test_copy_blocks_empty_is_a_no_op() -> None:
    caches = _layers(2, (4, 8, 2, 32), torch.float16)
    before = [c.clone() for c in caches]
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_blocks(caches, caches, empty, empty)
    for got, exp in zip(caches, before):
        torch.testing.assert_close(got, exp, atol=0, rtol=0)
