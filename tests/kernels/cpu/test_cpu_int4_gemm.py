"""The narrow steps' int4 GEMM (kernels/cpu/int4_gemm.cpp) against x @ W^T with W dequantized in float64, with
every build this CPU runs; and the quantized model on it against torch's int4 kernel.

Agreement criterion (kernels/cpu/int4_gemm.py): within float32 rounding of the dequantized product (relative
1e-5 of the row's largest output); a row's result bit for bit the same whatever rows share its call.
"""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import int4_gemm
from kernels.cpu.library import CpuKernels


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    zero = torch.randn(n, k // 32, generator=g) * 0.05
    dense = ((q.double() - 8).view(n, -1, 32) * scale.double()[..., None] + zero.double()[..., None]).view(n, k)
    return q, scale, zero, dense


def test_pack_keeps_every_nibble_and_the_offsets() -> None:
    q, scale, zero, _ = weights(32, 64, seed=1)
    w, sz = int4_gemm.pack(q, scale, zero)
    assert w.shape == (4, 64) and sz.shape == (4, 2, 2, 8)
    bits = w.to(torch.int64) & 0xFFFFFFFF
    for j in range(8):
        assert torch.equal((bits >> (4 * j)) & 15, q[j::8].to(torch.int64))
    assert torch.equal(sz[:, :, 0].permute(0, 2, 1).reshape(32, 2), scale)
    torch.testing.assert_close(sz[:, :, 1].permute(0, 2, 1).reshape(32, 2), zero - 8 * scale)
    assert int4_gemm.fits(48, 96) and not int4_gemm.fits(40, 64) and not int4_gemm.fits(48, 80)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("shape", [(16, 32), (960, 576), (576, 1536)])
def test_int4_gemm_equals_the_dequantized_product(variant: CpuKernels, rows: int, shape: tuple[int, int]) -> None:
    n, k = shape
    q, scale, zero, dense = weights(n, k, seed=n + rows)
    w, sz = int4_gemm.pack(q, scale, zero)
    x = (torch.randn(rows, k + 24) * 2)[:, 8:8 + k]            # a row stride wider than the row
    y = variant.int4.gemm(x, w, sz)
    want = x.double() @ dense.T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs().amax(dim=1) <= 1e-5 * want.abs().amax(dim=1)).all()
    for t in range(rows):                                       # a row alone gives the same bits
        assert torch.equal(variant.int4.gemm(x[t:t + 1], w, sz)[0], y[t])


def test_int4_gemm_refuses_shapes_it_does_not_take(variant: CpuKernels) -> None:
    w = torch.zeros(3, 64, dtype=torch.int32)                  # 24 outputs: not a multiple of 16
    with pytest.raises(ValueError):
        variant.int4.gemm(torch.zeros(2, 64), w, torch.zeros(3, 2, 2, 8))
