"""Launcher of the narrow-step int4 GEMM (kernels/cpu/int4_gemm.cpp) and its weight layout.

    pack(q, scale, zero)  q [N, K] int 0..15, scale / zero [N, K / 32] (W = (q - 8) scale + zero, GGUF's
                          Q4_1 as engine/models/quant.py holds it) -> (w [N / 8, K] int32: nibble j of w[b, k]
                          is q[8 b + j, k]; sz [N / 8, K / 32, 2, 8] float32: scale, then zero - 8 scale)
    gemm(x, w, sz)        x [T, K] float32 -> y [T, N] float32 = x @ W^T, the weights read 4-bit: every
                          decoded weight vector serves all T rows (torch's int4 kernel reads them once a row)
    gemm_wide(x, w, sz)   the same product for wide decode steps (16 rows and more): each panel of 16 outputs x
                          <= 320 inputs decoded to float32 once into L1, then a float32 GEMM micro-kernel (6 rows
                          x 16 outputs, twelve accumulators) runs every row over it
    pack_u8(q)            q -> [N / 8, K / 4, 8, 4] uint8, the weights a byte each for gemm_q8
    gemm_q8(x, w, sz)     the same product with x quantized to int8 per group of 32 of a row (a = max |x| / 127):
                          integer products (vpmaddubsw, 32 a uop), exact sums a group, then the group's scales in
                          float32. Only the coarse logits of the output layer use it (Q8Head).

Agreement criterion (gemm): y equals x @ W^T with W dequantized in float32 within float32 rounding (the kernel sums
each group of 32 products, then scales it: another order than a dense GEMM's). A row's result depends on
that row only. Shapes: N a multiple of 16, K of 32 (`fits`).
Agreement criterion (gemm_wide): the same as gemm's (another order again: products summed in order of k, W
decoded as q s + z with one rounding); a row's result depends on that row only.
Agreement criterion (gemm_q8): y equals x_q @ W^T within float32 rounding, x_q being x with each group of 32
of a row rounded to the nearest multiple of max |x| / 127 of the group (so off from x @ W^T by up to half a step
a weight); a row's result depends on that row only, and every build gives the same bits.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

GROUP = 32


def fits(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % GROUP == 0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest, asymmetric, min/max per group of 32 (as GGUF's Q4_1 quantizes): (q [N, K] int32 0..15,
    scale, zero [N, K / 32]) with W ~ (q - 8) scale + zero."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.clamp(torch.round((g - lo[..., None]) / safe[..., None]), 0, 15).reshape(out, inp)
    return q.to(torch.int32), d, lo + 8 * d


def pack_u8(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int 0..15 -> [N / 8, K / 4, 8, 4] uint8 (gemm_q8's layout: four weights of one output a 32-bit lane)."""
    n, k = q.shape
    assert fits(n, k), q.shape
    return q.to(torch.uint8).view(n // 8, 8, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = q.shape
    assert fits(n, k) and scale.shape == zero.shape == (n, k // GROUP), (q.shape, scale.shape)
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    w = (q.to(torch.int64).view(n // 8, 8, k) << shifts).sum(dim=1)          # [N / 8, K], < 2^32
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()   # the same 32 bits, signed
    return w, pack_sz(scale, zero)


def pack_sz(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale, zero [N, K / 32] -> [N / 8, K / 32, 2, 8] float32: scale, then zero - 8 scale."""
    n = scale.shape[0]
    s, z = scale.float(), zero.float() - 8 * scale.float()
    sz = torch.stack([s.view(n // 8, 8, -1), z.view(n // 8, 8, -1)], dim=1)  # [N / 8, 2, 8, G]
    return sz.permute(0, 3, 1, 2).contiguous()                               # [N / 8, G, 2, 8]


class Int4Gemm:
    """The kernel of one build (kernels/cpu/library.py loads it)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.prefixserve_int4_gemm.argtypes = [p, i64, p, p, p, i64, i, i, i]
        lib.prefixserve_int4_gemm.restype = ctypes.c_int
        lib.prefixserve_int4_gemm_wide.argtypes = [p, i64, p, p, p, i64, i, i, i]
        lib.prefixserve_int4_gemm_wide.restype = ctypes.c_int
        lib.prefixserve_int4_gemm_q8.argtypes = [p, i64, p, p, p, i64, i, i, i]
        lib.prefixserve_int4_gemm_q8.restype = ctypes.c_int
        lib.prefixserve_int4_gemm_path.restype = ctypes.c_char_p
        self._lib = lib
        self.path: str = lib.prefixserve_int4_gemm_path().decode()      # the loops it runs: avx2, generic

    def gemm(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return self._call_int4(self._lib.prefixserve_int4_gemm, "int4_gemm", x, w, sz)

    def gemm_wide(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """gemm's product, computed as wide steps want it (the module's docstring)."""
        return self._call_int4(self._lib.prefixserve_int4_gemm_wide, "int4_gemm_wide", x, w, sz)

    def _call_int4(self, fn: Any, name: str, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """gemm's and gemm_wide's call: w as `pack` made it."""
        nb, k = w.shape
        assert w.dtype == torch.int32 and w.is_contiguous()
        return self._call(fn, name, x, w, sz, nb, k)

    def gemm_q8(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 @ W^T with x quantized to int8 per group of 32 of a row, W as pack_u8 (weights) and
        pack (sz) made it -> [T, N] float32."""
        assert w.dtype == torch.uint8 and w.is_contiguous() and w.shape[2:] == (8, 4) and w.data_ptr() % 32 == 0
        return self._call(self._lib.prefixserve_int4_gemm_q8, "int4_gemm_q8", x, w, sz, w.shape[0], 4 * w.shape[1])

    @staticmethod
    def _call(fn: Any, name: str, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, nb: int, k: int) -> torch.Tensor:
        """y [T, 8 nb] float32 from one of the two kernels (the same arguments: x, its row stride, w, sz, y, ...)."""
        assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu"
        assert x.shape[1] == k and sz.dtype == torch.float32 and sz.is_contiguous()
        assert sz.shape == (nb, k // GROUP, 2, 8)
        y = torch.empty(x.shape[0], 8 * nb)
        if fn(x.data_ptr(), x.stride(0), w.data_ptr(), sz.data_ptr(), y.data_ptr(), y.stride(0), x.shape[0], 8 * nb,
              k) != 0:
            raise ValueError(f"{name}: shapes not taken ({tuple(x.shape)} x {8 * nb}) or no memory")
        return y


class Q8Head:
    """The output projection's coarse logits for wide steps where the dense GEMM is float32 (AVX2 without VNNI:
    oneDNN's int8 product saturates there, kernels/quant_gemm.py Int8ActHead): the weight as 4-bit groups
    (`quantize`; a byte each, 28 MB for SmolLM2's 49,152 x 576) times int8 activations (gemm_q8). Measured on a
    Zen 3 at 64 rows: 1.26-1.52x the float32 GEMM's speed (22-23 against 29-34 ms). Its logits are off by up
    to a few units (measured on SmolLM2's real hidden states: 4.7 at most, 0.41 on average), so the op layer
    recomputes its top 64 exactly, as for the narrow steps' 4-bit head (the float32 top 8 ranked within its top
    34 there, the argmax within its top 4); the criterion is the one of every coarse head
    (tests/engine/models/test_real_model.py)."""

    refine = 64

    def __init__(self, kernel: Int4Gemm, weight: torch.Tensor) -> None:
        q, scale, zero = quantize(weight.detach())
        self.kernel = kernel
        self.w = pack_u8(q)
        self.sz = pack_sz(scale, zero)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, vocab] float32."""
        return self.kernel.gemm_q8(x.float().contiguous(), self.w, self.sz)


__all__ = ["GROUP", "Int4Gemm", "Q8Head", "fits", "pack", "pack_sz", "pack_u8", "quantize"]
