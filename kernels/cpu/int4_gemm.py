"""Launcher of the narrow-step int4 GEMM (kernels/cpu/int4_gemm.cpp) and its weight layout.

    pack(q, scale, zero)  q [N, K] int 0..15, scale / zero [N, K / 32] (W = (q - 8) scale + zero, GGUF's
                          Q4_1 as engine/models/quant.py holds it) -> (w [N / 8, K] int32: nibble j of w[b, k]
                          is q[8 b + j, k]; sz [N / 8, K / 32, 2, 8] float32: scale, then zero - 8 scale)
    gemm(x, w, sz)        x [T, K] float32 -> y [T, N] float32 = x @ W^T, the weights read 4-bit: every
                          decoded weight vector serves all T rows (torch's int4 kernel reads them once a row)

Agreement criterion: y equals x @ W^T with W dequantized in float32 within float32 rounding (the kernel sums
each group of 32 products, then scales it: another order than a dense GEMM's). A row's result depends on
that row only. Shapes: N a multiple of 16, K of 32 (`fits`).
"""
from __future__ import annotations

import ctypes

import torch

GROUP = 32


def fits(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % GROUP == 0


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = q.shape
    assert fits(n, k) and scale.shape == zero.shape == (n, k // GROUP), (q.shape, scale.shape)
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    w = (q.to(torch.int64).view(n // 8, 8, k) << shifts).sum(dim=1)          # [N / 8, K], < 2^32
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()   # the same 32 bits, signed
    s, z = scale.float(), zero.float() - 8 * scale.float()
    sz = torch.stack([s.view(n // 8, 8, -1), z.view(n // 8, 8, -1)], dim=1)  # [N / 8, 2, 8, G]
    return w, sz.permute(0, 3, 1, 2).contiguous()                            # [N / 8, G, 2, 8]


class Int4Gemm:
    """The kernel of one build (kernels/cpu/library.py loads it)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.prefixserve_int4_gemm.argtypes = [p, i64, p, p, p, i64, i, i, i]
        lib.prefixserve_int4_gemm.restype = ctypes.c_int
        lib.prefixserve_int4_gemm_path.restype = ctypes.c_char_p
        self._lib = lib
        self.path: str = lib.prefixserve_int4_gemm_path().decode()      # the loops it runs: avx2, generic

    def gemm(self, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu"
        nb, k = w.shape
        assert w.dtype == torch.int32 and w.is_contiguous() and x.shape[1] == k
        assert sz.dtype == torch.float32 and sz.is_contiguous() and sz.shape == (nb, k // GROUP, 2, 8)
        y = torch.empty(x.shape[0], 8 * nb)
        rc = self._lib.prefixserve_int4_gemm(x.data_ptr(), x.stride(0), w.data_ptr(), sz.data_ptr(), y.data_ptr(),
                                             y.stride(0), x.shape[0], 8 * nb, k)
        if rc != 0:
            raise ValueError(f"int4_gemm: shapes not taken ({tuple(x.shape)} x {8 * nb}) or no memory")
        return y


__all__ = ["GROUP", "Int4Gemm", "fits", "pack"]
