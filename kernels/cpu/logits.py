"""Launchers of the per-row logits reductions (kernels/cpu/logits.cpp): one pass (two at most, the second
from cache) where torch runs logsumexp, argmax and topk as separate passes over a step's [T, V] logits.

    row_stats(x)      x [T, V] float32 -> (lse [T] float32, argmax [T] int64)
                      lse: torch.logsumexp's value and special cases (NaN row -> NaN, a +inf -> +inf, every
                      logit -inf -> -inf), within float32 rounding (the sum runs in float32 lanes, then double);
                      argmax: torch.argmax's index exactly (the first of equal maxima) on rows without NaN
    row_topk(x, k)    x [T, V] float32 or bfloat16 -> [T, k] int64: the indices of each row's k largest values,
                      in no particular order (k <= 64); of equal values at the boundary, the earlier index;
                      NaN is never chosen over a number
    refine(logits, top, x, w)
                      logits [T, V] float32, top [T, k] int64, x [T, H] float32, w [V, H] float32 or bfloat16:
                      logits[t, top[t, j]] = w[top[t, j]] . x[t] in float32 (vector lanes, then their sum:
                      torch's einsum within float32 rounding), in place; w's rows are read where they lie
    row_sample(x, temperature, u)
                      x [T, V] float32, temperature [T] float32 > 0, u [T] float64 in [0, 1) -> [T] int64: one
                      draw per row from softmax(x / temperature) by inverse CDF, as the sampler's torch path
                      (engine/sample/sampler.py): the first token with nonzero probability whose running
                      sum (float64) exceeds u x the total; e^x in float32 (the kernels' exp, ~1 ulp, where
                      torch's softmax has its own), the sums a block of 256 tokens at a time in vector lanes
                      and the blocks in vocabulary order, then the crossing block token by token (another
                      order of additions than torch's cumsum), so a u within rounding of a boundary may pick
                      the neighbour; a row without a finite maximum gives its argmax

Each row's result depends on that row only (the batch-invariant mode relies on it).
"""
from __future__ import annotations

import ctypes

import torch

MAX_K = 64
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _check(x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    assert x.dim() == 2 and x.dtype in dtypes and x.stride(1) == 1 and x.device.type == "cpu", (x.shape, x.dtype)
    assert x.shape[1] < 2**31 and x.shape[0] < 2**31


class Logits:
    """The kernels of one build (kernels/cpu/library.py loads it)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.prefixserve_row_stats.argtypes = [p, i64, i, i, p, p]
        lib.prefixserve_row_stats.restype = None
        lib.prefixserve_row_topk.argtypes = [p, i, i64, i, i, i, p]
        lib.prefixserve_row_topk.restype = ctypes.c_int
        lib.prefixserve_refine.argtypes = [p, i64, p, i, i64, p, i, i, i, p, i64]
        lib.prefixserve_refine.restype = None
        lib.prefixserve_row_sample.argtypes = [p, i64, i, i, p, p, p]
        lib.prefixserve_row_sample.restype = ctypes.c_int
        lib.prefixserve_logits_path.restype = ctypes.c_char_p
        self._lib = lib
        self.path: str = lib.prefixserve_logits_path().decode()     # the loops it runs: avx512, avx2, generic

    def row_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check(x, (torch.float32,))
        lse = torch.empty(x.shape[0], dtype=torch.float32)
        arg = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0] and x.shape[1]:
            self._lib.prefixserve_row_stats(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], lse.data_ptr(),
                                            arg.data_ptr())
        return lse, arg

    def row_topk(self, x: torch.Tensor, k: int) -> torch.Tensor:
        _check(x, tuple(_DTYPES))
        assert 1 <= k <= min(MAX_K, x.shape[1]), (k, x.shape)
        out = torch.empty(x.shape[0], k, dtype=torch.int64)
        if x.shape[0]:
            rc = self._lib.prefixserve_row_topk(x.data_ptr(), _DTYPES[x.dtype], x.stride(0), x.shape[0], x.shape[1],
                                                k, out.data_ptr())
            assert rc == 0, rc
        return out

    def refine(self, logits: torch.Tensor, top: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _check(logits, (torch.float32,))
        _check(x, (torch.float32,))
        _check(w, tuple(_DTYPES))
        T, k = top.shape
        assert top.dtype == torch.int64 and top.is_contiguous() and x.shape[0] == logits.shape[0] == T
        assert w.shape[1] == x.shape[1] and w.shape[0] == logits.shape[1] and w.shape[0] < 2**31
        if T and k:
            self._lib.prefixserve_refine(x.data_ptr(), x.stride(0), w.data_ptr(), _DTYPES[w.dtype], w.stride(0),
                                         top.data_ptr(), T, k, x.shape[1], logits.data_ptr(), logits.stride(0))
        return logits

    def row_sample(self, x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        _check(x, (torch.float32,))
        T = x.shape[0]
        assert temperature.dtype == torch.float32 and temperature.is_contiguous() and temperature.shape == (T,)
        assert u.dtype == torch.float64 and u.is_contiguous() and u.shape == (T,)
        assert x.shape[1] > 0
        out = torch.empty(T, dtype=torch.int64)
        if T:
            rc = self._lib.prefixserve_row_sample(x.data_ptr(), x.stride(0), T, x.shape[1], temperature.data_ptr(),
                                                  u.data_ptr(), out.data_ptr())
            if rc != 0:
                raise MemoryError("row_sample: no scratch for the vocabulary")
        return out


__all__ = ["MAX_K", "Logits"]
