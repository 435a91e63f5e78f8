"""The int4 GEMMs of narrow and of wide decode steps (kernels/cpu/int4_gemm.cpp) against x @ W^T with W
dequantized in float64, with every build this CPU runs; and the quantized model on it against torch's int4
kernel. The same for the int4 x int8 GEMM of the coarse head (gemm_q8), against the product of the rows rounded
as it rounds them.

Agreement criteria (kernels/cpu/int4_gemm.py): within float32 rounding of the dequantized product (relative
1e-5 of the row's largest output); a row's result bit for bit the same whatever rows share its call.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.cpu import int4_gemm
from kernels.cpu.library import CpuKernels, load, runnable_variants


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


def check_gemm(gemm: Any, rows: int, shape: tuple[int, int], seed: int, alone: list[int]) -> None:
    """gemm(x, w, sz) against the float64 product (relative 1e-5 of a row's largest output); the rows `alone`
    computed by themselves give the same bits."""
    n, k = shape
    q, scale, zero, dense = weights(n, k, seed=seed)
    w, sz = int4_gemm.pack(q, scale, zero)
    x = (torch.randn(rows, k + 24) * 2)[:, 8:8 + k]            # a row stride wider than the row
    y = gemm(x, w, sz)
    want = x.double() @ dense.T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs().amax(dim=1) <= 1e-5 * want.abs().amax(dim=1)).all()
    for t in alone:
        assert torch.equal(gemm(x[t:t + 1], w, sz)[0], y[t])


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("shape", [(16, 32), (960, 576), (576, 1536)])
def test_int4_gemm_equals_the_dequantized_product(variant: CpuKernels, rows: int, shape: tuple[int, int]) -> None:
    check_gemm(variant.int4.gemm, rows, shape, seed=shape[0] + rows, alone=list(range(rows)))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 64, 100, 151])
@pytest.mark.parametrize("shape", [(16, 32), (48, 352), (960, 576), (576, 1536)])
def test_wide_int4_gemm_equals_the_dequantized_product(variant: CpuKernels, rows: int, shape: tuple[int, int]) -> None:
    """gemm_wide: row blocks of six with a ragged last one (151 rows: passes of 144 rows and of 7), K in panels
    of up to 320 (352 and 1,536: a shorter last panel, its sums added onto the first ones')."""
    check_gemm(variant.int4.gemm_wide, rows, shape, seed=3 * shape[0] + rows, alone=sorted({0, rows // 2, rows - 1}))


def test_int4_gemm_refuses_shapes_it_does_not_take(variant: CpuKernels) -> None:
    w = torch.zeros(3, 64, dtype=torch.int32)                  # 24 outputs: not a multiple of 16
    with pytest.raises(ValueError):
        variant.int4.gemm(torch.zeros(2, 64), w, torch.zeros(3, 2, 2, 8))
    with pytest.raises(ValueError):
        variant.int4.gemm_wide(torch.zeros(2, 64), w, torch.zeros(3, 2, 2, 8))


def q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """gemm_q8's sums in float64: each group of 32 of a row rounded to a multiple of its max |x| / 127 for the
    products with q * scale, the group's exact sum for its offset zero - 8 scale."""
    t, k = x.shape
    g = x.double().view(t, -1, 32)
    # the rounding as the kernel does it, in float32 (x * (127 / max), half to even): in float64, a product a hair
    # from .5 would round the other way now and then, a whole step off
    g32 = x.float().view(t, -1, 32)
    mx = g32.abs().amax(-1, keepdim=True)
    inv = torch.full_like(mx, 127.0).div(torch.where(mx > 0, mx, 1.0))    # a division (127 / t is 127 * (1 / t))
    h = torch.round(g32 * torch.where(mx > 0, inv, 0.0))
    xq = (h.double() * (mx / 127).double()).view(t, k)
    wq = (q.double().view(q.shape[0], -1, 32) * scale.double()[..., None]).view(q.shape)
    return xq @ wq.T + g.sum(-1) @ (zero.double() - 8 * scale.double()).T


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("shape", [(16, 32), (960, 576), (576, 1536)])
def test_int8_activation_gemm_equals_the_product_of_the_rounded_rows(variant: CpuKernels, rows: int,
                                                                     shape: tuple[int, int]) -> None:
    n, k = shape
    q, scale, zero, dense = weights(n, k, seed=n + rows)
    wu, sz = int4_gemm.pack_u8(q), int4_gemm.pack_sz(scale, zero)
    x = (torch.randn(rows, k + 24) * 2)[:, 8:8 + k]            # a row stride wider than the row
    x[0, :32] = 0.0                                            # a group of zeros: no scale to divide by
    x[-1, k - 5] = 300.0                                       # an outlier: its group's step grows, others' not
    y = variant.int4.gemm_q8(x, wu, sz)
    want = q8_reference(x, q, scale, zero)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs().amax(dim=1) <= 1e-5 * want.abs().amax(dim=1)).all()
    # against the unrounded product: off by at most half a step of each group a weight (the int8 rounding, no more)
    half = (x.double().view(rows, -1, 32).abs().amax(-1) / 254).repeat_interleave(32, dim=1)
    wq = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    assert ((y.double() - x.double() @ dense.T).abs() <= half @ wq.abs().T + 1e-4).all()
    for t in range(rows):                                       # a row alone gives the same bits
        assert torch.equal(variant.int4.gemm_q8(x[t:t + 1], wu, sz)[0], y[t])


def test_int8_activation_gemm_gives_the_same_bits_in_every_build() -> None:
    """The vector loops and the portable ones: the same integer sums, the same float steps in the same order."""
    variants = runnable_variants()
    if len(variants) < 2:
        pytest.skip(f"one build runs here ({variants})")
    q, scale, zero, _ = weights(64, 96, seed=3)
    wu, sz = int4_gemm.pack_u8(q), int4_gemm.pack_sz(scale, zero)
    x = torch.randn(7, 96) * 3
    ys = [load(v).int4.gemm_q8(x, wu, sz) for v in variants]
    assert all(torch.equal(y, ys[0]) for y in ys[1:])


def q16_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """gemm_q16's sums in float64: each group of 32 of a row rounded to a multiple of its max |x| / 32767 (in float32,
    as the kernel: x * (32767 / max), half to even) for the products with q * scale, the group's exact sum for its
    offset zero - 8 scale."""
    t, k = x.shape
    g32 = x.float().view(t, -1, 32)
    mx = g32.abs().amax(-1, keepdim=True)
    inv = torch.full_like(mx, 32767.0).div(torch.where(mx > 0, mx, 1.0))
    h = torch.round(g32 * torch.where(mx > 0, inv, 0.0))
    xq = (h.double() * (mx / 32767).double()).view(t, k)
    wq = (q.double().view(q.shape[0], -1, 32) * scale.double()[..., None]).view(q.shape)
    return xq @ wq.T + x.double().view(t, -1, 32).sum(-1) @ (zero.double() - 8 * scale.double()).T


def q16_kernels(variant: CpuKernels) -> int4_gemm.Int4Gemm:
    if not variant.int4.has_q16:
        pytest.skip(f"gemm_q16 needs an AVX-512 VNNI build ({variant.variant})")
    return variant.int4


def test_int16_activation_gemm_is_in_the_avx512_vnni_builds(variant: CpuKernels) -> None:
    assert variant.int4.has_q16 == (variant.variant in ("avx512_vnni", "avx512_bf16", "amx"))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 151])
@pytest.mark.parametrize("shape", [(16, 32), (48, 352), (960, 576), (576, 1536)])
def test_int16_activation_gemm_equals_the_product_of_the_rounded_rows(variant: CpuKernels, rows: int,
                                                                      shape: tuple[int, int]) -> None:
    """gemm_q16's agreement criterion: y equals x_q @ W^T within float32 rounding (x_q: each group of 32 of a row
    rounded to 16 bits), so within half a step of each group a weight of x @ W^T; a row's result its own (row
    blocks of six with a ragged last one, passes of 144 rows; K in panels of 256 and a remainder; a last half
    panel of 16 outputs)."""
    kern = q16_kernels(variant)
    n, k = shape
    q, scale, zero, dense = weights(n, k, seed=n + rows)
    w, sz = int4_gemm.pack(q, scale, zero)
    x = (torch.randn(rows, k + 24) * 2)[:, 8:8 + k]            # a row stride wider than the row
    x[0, :32] = 0.0                                            # a group of zeros: no scale to divide by
    x[-1, k - 5] = 300.0                                       # an outlier: its group's step grows, others' not
    y = kern.gemm_q16(x, w, sz)
    want = q16_reference(x, q, scale, zero)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs().amax(dim=1) <= 1e-5 * want.abs().amax(dim=1)).all()
    half = (x.double().view(rows, -1, 32).abs().amax(-1) / 65534).repeat_interleave(32, dim=1)
    wq = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    assert ((y.double() - x.double() @ dense.T).abs() <= half @ wq.abs().T + 1e-4).all()
    for t in sorted({0, rows // 2, rows - 1}):                 # a row alone gives the same bits
        assert torch.equal(kern.gemm_q16(x[t:t + 1], w, sz)[0], y[t])


def test_int16_activation_gemm_refuses_shapes_it_does_not_take(variant: CpuKernels) -> None:
    kern = q16_kernels(variant)
    w = torch.zeros(3, 64, dtype=torch.int32)                  # 24 outputs: not a multiple of 16
    with pytest.raises(ValueError, match="int4_gemm_q16"):
        kern.gemm_q16(torch.zeros(2, 64), w, torch.zeros(3, 2, 2, 8))
    assert kern.gemm_q16(torch.zeros(0, 64), w[:2], torch.zeros(2, 2, 2, 8)).shape == (0, 16)


def test_pack_u8_puts_four_weights_of_one_output_in_a_lane() -> None:
    q, _, _, _ = weights(16, 64, seed=2)
    wu = int4_gemm.pack_u8(q)
    assert wu.shape == (2, 16, 8, 4) and wu.dtype == torch.uint8
    for n, k in ((0, 0), (9, 5), (15, 63), (3, 37)):
        assert int(wu[n // 8, k // 4, n % 8, k % 4]) == int(q[n, k])


def bf16_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weights() with bfloat16 scales and zeros, and the dense copy as engine/models/quant.py makes it: (q - 8) s + z
    in float32, a product then a sum, rounded to bfloat16."""
    q, scale, zero, _ = weights(n, k, seed)
    s, z = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()
    dense = ((q.float() - 8).view(n, -1, 32) * s[..., None] + z[..., None]).view(n, k).to(torch.bfloat16)
    return q, s, z, dense


def test_bf16_gemm_exists_in_the_avx512_bf16_builds_only(variant: CpuKernels) -> None:
    assert variant.int4.has_bf16 == (variant.variant in ("avx512_bf16", "amx"))
    if not variant.int4.has_bf16:
        with pytest.raises(AssertionError):
            variant.int4.gemm_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 16, dtype=torch.uint8),
                                   torch.zeros(2, 2, 2, 16, dtype=torch.bfloat16))


def test_bf16_gemm_decodes_the_dense_copys_weights_bit_for_bit(variant: CpuKernels) -> None:
    """One-hot rows: each output is one weight times 1, so y is the decoded weights themselves."""
    if not variant.int4.has_bf16:
        pytest.skip(f"no gemm_bf16 in the {variant.variant} build")
    q, s, z, dense = bf16_weights(64, 96, seed=7)
    w4, sz = int4_gemm.pack_bf16(q, s, z)
    assert w4.shape == (4, 48, 16) and sz.shape == (4, 3, 2, 16)
    y = variant.int4.gemm_bf16(torch.eye(96, dtype=torch.bfloat16), w4, sz)
    assert torch.equal(y, dense.T.contiguous())


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 151])
@pytest.mark.parametrize("shape", [(32, 32), (960, 576), (576, 1536)])
def test_bf16_gemm_is_the_bf16_rounding_of_the_product(variant: CpuKernels, rows: int, shape: tuple[int, int]) -> None:
    """Within an ulp of bfloat16 plus float32 summation error of x @ W^T (W the dense copy, in float64); a row's
    result the same bits whatever rows share its call (row passes of 8 with ragged last ones); and where oneDNN has
    its bfloat16 GEMM, at most an ulp of bfloat16 from it over the same weights."""
    if not variant.int4.has_bf16:
        pytest.skip(f"no gemm_bf16 in the {variant.variant} build")
    n, k = shape
    q, s, z, dense = bf16_weights(n, k, seed=n + rows)
    w4, sz = int4_gemm.pack_bf16(q, s, z)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k + 24, generator=g) * 2).to(torch.bfloat16)[:, 8:8 + k]   # a row stride wider than the row
    y = variant.int4.gemm_bf16(x, w4, sz)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    want = x.double() @ dense.double().T
    sums = k * 2.0**-24 * (x.double().abs() @ dense.double().abs().T)    # float32 summation error, at most
    assert ((y.double() - want).abs() <= want.abs() * 2.0**-8 + sums).all()
    for t in sorted({0, rows // 2, rows - 1}):
        assert torch.equal(variant.int4.gemm_bf16(x[t:t + 1], w4, sz)[0], y[t])
    from kernels import quant_gemm as qg
    if qg.ONEDNN_BF16:
        ref = qg.dense_mm(x, qg.pack_dense(dense), None)
        assert ((y.double() - ref.double()).abs() <= ref.double().abs() * 2.0**-7 + 2 * sums).all()


def test_bf16_gemm_refuses_shapes_it_does_not_take(variant: CpuKernels) -> None:
    if not variant.int4.has_bf16:
        pytest.skip(f"no gemm_bf16 in the {variant.variant} build")
    assert int4_gemm.fits_bf16(32, 64) and not int4_gemm.fits_bf16(48, 64) and not int4_gemm.fits_bf16(32, 48)
    with pytest.raises(ValueError):                               # 48 outputs: not whole blocks of 32
        variant.int4.gemm_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(3, 32, 16, dtype=torch.uint8),
                               torch.zeros(3, 2, 2, 16, dtype=torch.bfloat16))
