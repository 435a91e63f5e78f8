"""Launchers of the fused elementwise kernels (kernels/cpu/fused.cpp): shapes, dtypes and strides checked,
outputs allocated. Rows are [T, width] with a row stride and the last dimension contiguous. The activations
between the matmuls (`act`: a norm's output, a residual branch, a projection) are bfloat16 or float32."""
from __future__ import annotations

import ctypes

import torch

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "prefixserve_rms_norm": [_P, _I64, _P, _F, _P, _I64, _I, _I, _I],
    "prefixserve_add_rms_norm": [_P, _I64, _P, _I64, _P, _F, _P, _I64, _I, _I, _I],
    "prefixserve_qkv_rope": [_P, _I64, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I],
    "prefixserve_silu_mul": [_P, _I64, _P, _I64, _I, _I, _I],
}
_ACT = {torch.bfloat16: 0, torch.float32: 1}       # the activations between the matmuls


def _rows(x: torch.Tensor, dtype: torch.dtype) -> None:
    assert x.dim() == 2 and x.dtype == dtype and x.stride(1) == 1 and x.device.type == "cpu", (x.shape, x.dtype)


class Fused:
    """The kernels of one build (kernels/cpu/library.py loads it)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            f = getattr(lib, name)
            f.argtypes = argtypes
            f.restype = None
        self._lib = lib
        lib.prefixserve_fused_path.restype = ctypes.c_char_p
        self.path: str = lib.prefixserve_fused_path().decode()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 act: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """act(weight * x * rsqrt(mean(x^2) + eps)); x [T, H] float32."""
        _rows(x, torch.float32)
        assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape == (x.shape[1],)
        y = torch.empty(x.shape, dtype=act)
        self._lib.prefixserve_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, y.data_ptr(), y.stride(0),
                                       x.shape[0], x.shape[1], _ACT[act])
        return y

    def add_rms_norm(self, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += r (in place, float32; r bfloat16 or float32), then rms_norm(x) in r's dtype."""
        _rows(x, torch.float32)
        assert r.dim() == 2 and r.dtype in _ACT and r.stride(1) == 1
        assert r.shape == x.shape and weight.dtype == torch.float32 and weight.is_contiguous()
        y = torch.empty(x.shape, dtype=r.dtype)
        self._lib.prefixserve_add_rms_norm(x.data_ptr(), x.stride(0), r.data_ptr(), r.stride(0), weight.data_ptr(),
                                           eps, y.data_ptr(), y.stride(0), x.shape[0], x.shape[1], _ACT[r.dtype])
        return y

    def qkv_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k, v [T, Hkv, D] float32 from a bfloat16 or float32 [T, (H + 2 Hkv) D] projection; q and k
        rotated by cos, sin [T, D] (or [T, 1, D]), NeoX halves."""
        assert qkv.dim() == 2 and qkv.dtype in _ACT and qkv.stride(1) == 1
        t = qkv.shape[0]
        assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
        cos, sin = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        q = torch.empty(t, num_heads, head_dim)
        k = torch.empty(t, num_kv_heads, head_dim)
        v = torch.empty(t, num_kv_heads, head_dim)
        self._lib.prefixserve_qkv_rope(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                                       k.data_ptr(), v.data_ptr(), t, num_heads, num_kv_heads, head_dim,
                                       _ACT[qkv.dtype])
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [T, 2I] = [gate | up] (bfloat16 or float32), in its dtype."""
        assert gate_up.dim() == 2 and gate_up.dtype in _ACT and gate_up.stride(1) == 1
        inter = gate_up.shape[1] // 2
        y = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
        self._lib.prefixserve_silu_mul(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), y.stride(0),
                                       gate_up.shape[0], inter, _ACT[gate_up.dtype])
        return y


__all__ = ["Fused"]
