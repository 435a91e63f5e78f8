"""A decoder layer's work around its attention in two C++ calls (kernels/cpu/layers.cpp), for the quantized fast
path's wide steps: `pre` (norm, qkv projection, RoPE) and `post` (the o projection, norm, MLP) call the same
kernels the op layer would call one by one from Python (int4_gemm.cpp gemm_bf16 and fused.cpp), in the same
order, so a step's hidden states are the same bit for bit (tested), without a dozen Python launches, checks and
allocations a layer.

    step scratch (`LayerScratch`, made once a step for its T rows, every layer reuses it):
        h, o [T, H], qkv [T, (Hq + 2 Hkv) D], a [T, Hq D], gu [T, 2 I], act [T, I] bfloat16
        q [T, Hq, D], k, v [T, Hkv, D] float32 (pre's outputs: the attention reads them before the next pre)
        r: two [T, H] bfloat16 buffers, one layer's output and the next one's, in turn

NOTE: why it pays. Measured on a 2-core Zen 4 (AVX-512 BF16), in process, 64 x 128 / 128 tokens: a decode step
spent ~8 ms and a prompt step ~24 ms outside the C++ kernels (Python, its launchers and torch's small ops), one core
computing while the other waited at the next parallel region for it.

Where it applies (`LayerHalves.fits`): every layer's four projections int4 with gemm_bf16's packed weights (a
GGUF Q4 model on an AVX-512 BF16 CPU without AMX: quant.py), no biases, float32 norm weights; and the step wide
(a prompt chunk, or DENSE_FROM_ROWS rows and more: the steps whose projections take gemm_bf16) with bfloat16
between its matmuls. Anything else keeps the op-by-op path.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Table(ctypes.Structure):
    """layers.cpp PrefixserveLayerKernels: the kernels' entry points, in its order."""

    _fields_ = [("gemm_bf16", _P), ("rms_norm", _P), ("add_rms_norm", _P), ("qkv_rope", _P), ("silu_mul", _P)]


@dataclass
class LayerScratch:
    """A step's buffers (the module docstring), for T rows."""

    h: torch.Tensor
    qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    o: torch.Tensor
    gu: torch.Tensor
    act: torch.Tensor
    r: tuple[torch.Tensor, torch.Tensor]


class LayerHalves:
    """The halves of one build (kernels/cpu/library.py loads it), bound to that build's gemm_bf16 and fused
    kernels."""

    def __init__(self, lib: ctypes.CDLL, int4: ctypes.CDLL, fused: ctypes.CDLL) -> None:
        self._table = _Table(*(ctypes.cast(f, _P) for f in (
            int4.prefixserve_int4_gemm_bf16, fused.prefixserve_rms_norm, fused.prefixserve_add_rms_norm,
            fused.prefixserve_qkv_rope, fused.prefixserve_silu_mul)))
        self._pre = lib.prefixserve_layer_pre
        self._pre.argtypes = [_P, _P, _P, _P, _F, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I]
        self._pre.restype = _I
        self._post = lib.prefixserve_layer_post
        self._post.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I]
        self._post.restype = _I
        self._ptr = ctypes.addressof(self._table)

    @staticmethod
    def fits(model: Any) -> bool:
        """Whether every layer of `model` (engine/models/llama.py) takes the halves on a wide step."""
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if getattr(lin, "kind", None) != "int4" or not lin.w4.numel() or lin.bias is not None:
                    return False
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
                    return False
        return True

    @staticmethod
    def scratch(t: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> LayerScratch:
        def e(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype)

        f32 = torch.float32
        return LayerScratch(h=e(t, hidden), qkv=e(t, (heads + 2 * kv_heads) * head_dim),
                            q=e(t, heads, head_dim, dtype=f32), k=e(t, kv_heads, head_dim, dtype=f32),
                            v=e(t, kv_heads, head_dim, dtype=f32), a=e(t, heads * head_dim), o=e(t, hidden),
                            gu=e(t, 2 * inter), act=e(t, inter), r=(e(t, hidden), e(t, hidden)))

    def pre(self, s: LayerScratch, layer: Any, x: torch.Tensor, r: torch.Tensor | None, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] float32 (+= r, in place), r [T, H] bfloat16 or None (the first layer); cos, sin [T, D] float32
        contiguous -> q [T, Hq, D], k, v [T, Hkv, D] float32 (s's buffers)."""
        attn, norm = layer.self_attn, layer.input_layernorm
        qkv = attn.qkv_proj
        t, hidden = x.shape
        rc = self._pre(self._ptr, x.data_ptr(), None if r is None else r.data_ptr(), norm.weight.data_ptr(),
                       norm.eps, qkv.w4.data_ptr(), qkv.sz4.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       s.h.data_ptr(), s.qkv.data_ptr(), s.q.data_ptr(), s.k.data_ptr(), s.v.data_ptr(), t, hidden,
                       attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if rc != 0:
            raise ValueError(f"layer_pre: gemm_bf16 refused the qkv projection (code {rc})")
        return s.q, s.k, s.v

    def post(self, s: LayerScratch, layer: Any, out: torch.Tensor, x: torch.Tensor, r_out: torch.Tensor) -> None:
        """out: the attention's [T, Hq, D] float32 (contiguous); x [T, H] float32 (+= the o projection, in
        place); the MLP's output into r_out [T, H] bfloat16."""
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        o, gu, dn = attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        t, hidden = x.shape
        rc = self._post(self._ptr, out.data_ptr(), s.a.data_ptr(), o.w4.data_ptr(), o.sz4.data_ptr(), s.o.data_ptr(),
                        x.data_ptr(), norm.weight.data_ptr(), norm.eps, s.h.data_ptr(), gu.w4.data_ptr(),
                        gu.sz4.data_ptr(), s.gu.data_ptr(), s.act.data_ptr(), dn.w4.data_ptr(), dn.sz4.data_ptr(),
                        r_out.data_ptr(), t, hidden, attn.q_size, mlp.inter)
        if rc != 0:
            raise ValueError(f"layer_post: gemm_bf16 refused a projection (code {rc})")


__all__ = ["LayerHalves", "LayerScratch"]
