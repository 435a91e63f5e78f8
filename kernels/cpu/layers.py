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

Where it applies (`LayerHalves.bind`): every layer's four projections int4 with gemm_bf16's packed weights (a
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


@dataclass(frozen=True)
class BoundLayer:
    """One layer's weights as the two calls take them: pointers into the layer's own tensors (`LayerHalves.bind`,
    once after loading: a model's weights never change after it)."""

    pre: tuple[int | float, ...]        # input norm weight, eps, qkv w4, sz
    post: tuple[int | float, ...]       # o w4, sz, post norm weight, eps, gate_up w4, sz, down w4, sz


@dataclass
class LayerScratch:
    """A step's buffers (the module docstring), for T rows, and the calls' arguments that stay the same for every
    layer of the step."""

    x: torch.Tensor                                 # the residual stream [T, H] float32 (the step's, in place)
    r: tuple[torch.Tensor, torch.Tensor]            # the layers' outputs, in turn
    buffers: tuple[torch.Tensor, ...]               # what the pointers below point into
    pre: tuple[int, ...]                            # cos, sin, h, qkv, q, k, v, T, H, Hq, Hkv, D
    post: tuple[int, ...]                           # x, a, o, h, gu, act, T, H, QD, I
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # q, k, v: pre's outputs


class LayerHalves:
    """The halves of one build (kernels/cpu/library.py loads it), bound to that build's gemm_bf16 and fused
    kernels."""

    def __init__(self, lib: ctypes.CDLL, int4: ctypes.CDLL, fused: ctypes.CDLL) -> None:
        self._table = _Table(*(ctypes.cast(f, _P) for f in (
            int4.prefixserve_int4_gemm_bf16, fused.prefixserve_rms_norm, fused.prefixserve_add_rms_norm,
            fused.prefixserve_qkv_rope, fused.prefixserve_silu_mul)))
        self._pre = lib.prefixserve_layer_pre
        self._pre.argtypes = [_P, _P, _P, _P, _F, _P, _P, *[_P] * 7, *[_I] * 5]
        self._pre.restype = _I
        self._post = lib.prefixserve_layer_post
        self._post.argtypes = [_P, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P, *[_P] * 6, *[_I] * 4]
        self._post.restype = _I
        self._ptr = ctypes.addressof(self._table)

    @staticmethod
    def bind(model: Any) -> list[BoundLayer] | None:
        """Every layer of `model` (engine/models/llama.py) as the calls take it, or None where one does not take the
        halves on a wide step (a projection that is not int4 with gemm_bf16's packed weights, a bias, a norm
        weight that is not float32)."""
        bound = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(getattr(lin, "kind", None) != "int4" or not lin.w4.numel() or lin.bias is not None for lin in lins):
                return None
            n_in, n_post = layer.input_layernorm, layer.post_attention_layernorm
            if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in (n_in, n_post)):
                return None
            qkv, o, gu, dn = lins
            bound.append(BoundLayer(
                pre=(n_in.weight.data_ptr(), n_in.eps, qkv.w4.data_ptr(), qkv.sz4.data_ptr()),
                post=(o.w4.data_ptr(), o.sz4.data_ptr(), n_post.weight.data_ptr(), n_post.eps, gu.w4.data_ptr(),
                      gu.sz4.data_ptr(), dn.w4.data_ptr(), dn.sz4.data_ptr())))
        return bound

    @staticmethod
    def scratch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                inter: int) -> LayerScratch:
        """A step's buffers for x [T, H] float32 contiguous (updated in place by the calls) and cos, sin [T, D]
        float32 contiguous."""
        t, hidden = x.shape

        def e(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype)

        f32 = torch.float32
        h, qkv, a, o = e(t, hidden), e(t, (heads + 2 * kv_heads) * head_dim), e(t, heads * head_dim), e(t, hidden)
        q, k, v = e(t, heads, head_dim, dtype=f32), e(t, kv_heads, head_dim, dtype=f32), e(t, kv_heads, head_dim,
                                                                                             dtype=f32)
        gu, act = e(t, 2 * inter), e(t, inter)
        ptr = [b.data_ptr() for b in (cos, sin, h, qkv, q, k, v, x, a, o, gu, act)]
        return LayerScratch(x=x, r=(e(t, hidden), e(t, hidden)), buffers=(cos, sin, h, qkv, q, k, v, a, o, gu, act),
                            pre=(*ptr[:7], t, hidden, heads, kv_heads, head_dim),
                            post=(ptr[7], ptr[8], ptr[9], ptr[2], ptr[10], ptr[11], t, hidden, heads * head_dim, inter),
                            qkv=(q, k, v))

    def pre(self, s: LayerScratch, layer: BoundLayer, r: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """s.x += r (in place; r [T, H] bfloat16, None for the first layer), its norm, the qkv projection and RoPE
        -> q [T, Hq, D], k, v [T, Hkv, D] float32 (s's buffers)."""
        rc = self._pre(self._ptr, s.post[0], None if r is None else r.data_ptr(), *layer.pre, *s.pre)
        if rc != 0:
            raise ValueError(f"layer_pre: gemm_bf16 refused the qkv projection (code {rc})")
        return s.qkv

    def post(self, s: LayerScratch, layer: BoundLayer, out: torch.Tensor, r_out: torch.Tensor) -> None:
        """out: the attention's [T, Hq, D] float32 (contiguous) -> s.x += its o projection (in place); the MLP's
        output of the norm of that into r_out [T, H] bfloat16."""
        rc = self._post(self._ptr, out.data_ptr(), r_out.data_ptr(), *layer.post, *s.post)
        if rc != 0:
            raise ValueError(f"layer_post: gemm_bf16 refused a projection (code {rc})")


__all__ = ["BoundLayer", "LayerHalves", "LayerScratch"]
