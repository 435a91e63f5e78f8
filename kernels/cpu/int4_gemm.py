"""Launcher of the narrow-step int4 GEMM (kernels/cpu/int4_gemm.cpp) and its weight layout.

    pack(q, scale, zero)  q [N, K] int 0..15, scale / zero [N, K / 32] (W = (q - 8) scale + zero, GGUF's
                          Q4_1 as engine/models/quant.py holds it) -> (w [N / 8, K] int32: nibble j of w[b, k]
                          is q[8 b + j, k]; sz [N / 8, K / 32, 2, 8] float32: scale, then zero - 8 scale)
    gemm(x, w, sz)        x [T, K] float32 -> y [T, N] float32 = x @ W^T, the weights read 4-bit: every
                          decoded weight vector serves all T rows (torch's int4 kernel reads them once a row)
    gemm_wide(x, w, sz)   the same product for wide decode steps (16 rows and more; 12 on AVX-512 builds): each
                          panel of 16 outputs x <= 320 inputs decoded to float32 once into L1, then a float32 GEMM
                          micro-kernel (6 rows x 16 outputs, twelve accumulators) runs every row over it; on
                          AVX-512 builds (`wide_path` avx512) panels of 32 x <= 192 and 8 rows x 32 outputs
                          (sixteen 16-float accumulators)
    gemm_q16(x, w, sz)    the same product with each group of 32 of a row rounded to 16-bit integers (a = max |x| /
                          32767) times the 4-bit weights as 16-bit lanes: vpdpwssd (32 products an instruction,
                          twice a float32 FMA's), exact integer sums a group, then the group's scales in float32;
                          AVX-512 VNNI builds (`has_q16`): panels of 32 outputs x <= 256 inputs, 6 rows
                          x 32 outputs a pass. What an AVX-512 CPU without BF16 (Cascade Lake) runs for a GGUF Q4
                          layer's prompt chunks and decode steps (kernels/ops.py)
    pack_bf16(q, s, z)    (w4 [N / 16, K / 2, 16] uint8: byte (p, w, 2 j + c) holds q[16 p + j, 2 w + c] and,
                          above it, q[16 p + 8 + j, 2 w + c]; sz [N / 16, K / 32, 2, 16] bfloat16: s, then z) for
                          gemm_bf16: its low nibbles widen to the first 8 outputs' dimension pairs, its high
                          nibbles to the last 8's, the order vdpbf16ps reads (no shuffle after the decode)
    gemm_bf16(x, w4, sz)  x [T, K] bfloat16 -> y [T, N] bfloat16 = x @ W^T on AVX-512 BF16 builds (`has_bf16`),
                          for wide steps where the dense GEMM is oneDNN's bfloat16 one (no AMX): each block of 32
                          outputs decoded over the whole K into the dense copy's bfloat16 weights (L2), then
                          vdpbf16ps over every row; the weights read from memory are 4-bit (with bfloat16 scales:
                          a third of the dense copy's bytes)
    pack_u8(q)            q -> [N / 8, K / 4, 8, 4] uint8, the weights a byte each for gemm_q8
    gemm_q8(x, w, sz)     the same product with x quantized to int8 per group of 32 of a row (a = max |x| / 127):
                          integer products (vpmaddubsw, 32 a uop), exact sums a group, then the group's scales in
                          float32. Only the coarse logits of the output layer use it (Q8Head).

Agreement criterion (gemm): y equals x @ W^T with W dequantized in float32 within float32 rounding (the kernel sums
each group of 32 products, then scales it: another order than a dense GEMM's). A row's result depends on
that row only. Shapes: N a multiple of 16, K of 32 (`fits`).
Agreement criterion (gemm_wide): the same as gemm's (another order again: products summed in order of k, W
decoded as q s + z with one rounding); a row's result depends on that row only.
Agreement criterion (gemm_bf16): the weights it decodes are the dense copy's bfloat16 weights bit for bit (W =
(q - 8) s + z with s, z bfloat16, a float32 product then a float32 sum, rounded to nearest even, as
engine/models/quant.py makes them); products of bfloat16 values exact, summed in float32 in order of k, each output
rounded once to bfloat16: so y equals the bfloat16 rounding of x @ W^T (W the dense copy) up to float32 summation
order (at most an ulp of bfloat16 apart from oneDNN's result); a row's result depends on that row only.
Agreement criterion (gemm_q16): y equals x_q @ W^T within float32 rounding, x_q being x with each group of 32 of a
row rounded to the nearest multiple of max |x| / 32767 of the group (so off from x @ W^T by up to half such a step a
weight: a relative 2^-16 of the group's largest, where bfloat16 activations carry 2^-9 of each value); the weights
are the 4-bit ones exactly; a row's result depends on that row only. On the built-in model, greedy, the 20 chat
answers of tests/engine/models/test_real_model.py: 18 equal to transformers' float32 ones token for token and 390
of 405 tokens before the first divergence, against 19 and 397 with the float32 GEMMs (int16_activations off) on the
same CPU; the first step's log-probabilities within 0.110 of float32's (0.122).
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


def fits_bf16(out_features: int, in_features: int) -> bool:
    """gemm_bf16's shape rules: output blocks of 32, whole groups along the input."""
    return out_features % 32 == 0 and in_features % GROUP == 0


def pack_bf16(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int 0..15, scale / zero [N, K / 32] (W = (q - 8) scale + zero) -> gemm_bf16's (w4, sz)."""
    n, k = q.shape
    assert fits_bf16(n, k) and scale.shape == zero.shape == (n, k // GROUP), (q.shape, scale.shape)
    qq = q.to(torch.uint8).view(n // 16, 2, 8, k // 2, 2)                      # [P, half, j, w, c]
    w4 = (qq[:, 0] | (qq[:, 1] << 4)).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 16)   # [P, w, (j, c)]
    s, z = (t.to(torch.bfloat16).view(n // 16, 16, -1) for t in (scale, zero))
    return w4, torch.stack([s, z], dim=1).permute(0, 3, 1, 2).contiguous()     # [N / 16, K / 32, 2, 16]


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
        lib.prefixserve_int4_gemm_q16.argtypes = [p, i64, p, p, p, i64, i, i, i]
        lib.prefixserve_int4_gemm_q16.restype = ctypes.c_int
        lib.prefixserve_int4_gemm_bf16.argtypes = [p, i64, p, p, p, i64, i, i, i]
        lib.prefixserve_int4_gemm_bf16.restype = ctypes.c_int
        lib.prefixserve_int4_gemm_path.restype = ctypes.c_char_p
        lib.prefixserve_int4_gemm_wide_path.restype = ctypes.c_char_p
        self._lib = lib
        self.path: str = lib.prefixserve_int4_gemm_path().decode()      # the loops it runs: avx2, generic
        self.wide_path: str = lib.prefixserve_int4_gemm_wide_path().decode()   # gemm_wide's: avx512, avx2, generic
        self.has_bf16 = bool(lib.prefixserve_int4_gemm_has_bf16())      # gemm_bf16 (AVX-512 BF16 builds)
        self.has_q16 = bool(lib.prefixserve_int4_gemm_has_q16())        # gemm_q16 (AVX-512 VNNI builds)

    def gemm(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return self._call_int4(self._lib.prefixserve_int4_gemm, "int4_gemm", x, w, sz)

    def gemm_wide(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """gemm's product, computed as wide steps want it (the module's docstring)."""
        return self._call_int4(self._lib.prefixserve_int4_gemm_wide, "int4_gemm_wide", x, w, sz)

    def gemm_q16(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """gemm's product with each group of 32 of a row rounded to 16-bit integers (`has_q16`; the module's
        docstring)."""
        assert self.has_q16, "gemm_q16 needs an AVX-512 VNNI build"
        return self._call_int4(self._lib.prefixserve_int4_gemm_q16, "int4_gemm_q16", x, w, sz)

    def _call_int4(self, fn: Any, name: str, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """gemm's and gemm_wide's call: w as `pack` made it."""
        nb, k = w.shape
        assert w.dtype == torch.int32 and w.is_contiguous()
        return self._call(fn, name, x, w, sz, nb, k)

    def gemm_bf16(self, x: torch.Tensor, w4: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """x [T, K] bfloat16 @ W^T, W as pack_bf16 made it -> [T, N] bfloat16 (AVX-512 BF16 builds: `has_bf16`)."""
        assert self.has_bf16, "gemm_bf16 needs an AVX-512 BF16 build"
        assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.device.type == "cpu"
        assert w4.dtype == torch.uint8 and w4.is_contiguous() and w4.shape[2] == 16
        n, k = 16 * w4.shape[0], 2 * w4.shape[1]
        assert x.shape[1] == k and sz.dtype == torch.bfloat16 and sz.is_contiguous()
        assert sz.shape == (w4.shape[0], k // GROUP, 2, 16)
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        if self._lib.prefixserve_int4_gemm_bf16(x.data_ptr(), x.stride(0), w4.data_ptr(), sz.data_ptr(), y.data_ptr(),
                                                y.stride(0), x.shape[0], n, k) != 0:
            raise ValueError(f"int4_gemm_bf16: shapes not taken ({tuple(x.shape)} x {n}) or no memory")
        return y

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


__all__ = ["GROUP", "Int4Gemm", "Q8Head", "fits", "fits_bf16", "pack", "pack_bf16", "pack_sz", "pack_u8", "quantize"]
