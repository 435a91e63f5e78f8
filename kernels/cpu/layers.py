"""A decoder layer's work around its attention in two C++ calls, and a decode step's layers in one
(kernels/cpu/layers.cpp), for the quantized fast path's wide steps, in two kinds (`LayerHalves.gemm`): "bf16",
bfloat16 between the matmuls, whose projections take gemm_bf16; "q16" and "wide", float32 between them, whose
projections take gemm_q16 or gemm_wide (int4_gemm.py):

    pre            norm (x += r first, after the first layer), qkv projection, RoPE
    post           o projection, x += it, norm, MLP
    decode_layers  every layer of a decode step the CPU backend's decode kernel serves (`decode_plan`): pre, the
                   paged decode kernel (write the step's K / V, attend), post; the thread governor's check
                   (`between_layers`) comes before it instead of between its layers (a decode step is short)

They call the same kernels the op layer would call one by one from Python (int4_gemm.cpp gemm_bf16, fused.cpp,
paged_decode.cpp), in the same order on the same data, so a step's hidden states are the same bit for bit (tested
on the real model: tokens and log-probabilities), without a dozen Python launches, checks and allocations a layer.

    step scratch (`LayerScratch`, made once a step for its T rows, every layer reuses it):
        h, o [T, H], qkv [T, (Hq + 2 Hkv) D], a [T, Hq D], gu [T, 2 I], act [T, I] bfloat16 (float32: the
            f32 kinds, whose o projection reads the attention's output itself, a unused)
        q [T, Hq, D], k, v [T, Hkv, D] float32 (pre's outputs: the attention reads them before the next pre)
        r: two [T, H] buffers (the activations' dtype), one layer's output and the next one's, in turn

NOTE: why it pays. Measured on a 2-core Zen 4 (AVX-512 BF16), in process, 64 x 128 / 128 tokens: a decode step
spent ~8 ms and a prompt step ~24 ms outside the C++ kernels (Python, its launchers and torch's small ops), one core
computing while the other waited at the next parallel region for it. With the halves: 512 against 487 tok/s
(medians of three, alternating); the decode steps then in one call: their time 7.9 -> 7.1 s and 507 -> 550 tok/s
(medians of six pairs, alternating; the machine moved single runs by up to 20%).

The float32 kinds, on a 2-core AVX-512 Xeon without BF16 (Cascade Lake), where gemm_q16 takes the prompt chunks
and the decode steps (then from 8 rows): a 16-row decode step after a 3,072-token shared prompt spent a quarter of
the engine thread outside the kernels (perf: Python, ctypes, torch's allocator), the other core spinning in libgomp
for a third of its samples meanwhile. With them, in process, alternating: decode steps of 16 rows over 3,151 tokens
101.8 -> 89.9 ms, of 8 / 12 rows over 576 tokens 75.0 -> 39.9 / 78.0 -> 64.4 ms; and so every decode step takes
gemm_q16 now (kernels/quant_gemm.py Q16_FROM_ROWS). On --no-int16-activations (gemm_wide, the "wide" kind) and on
AVX2 / AVX-512 CPUs without VNNI the same holds for gemm_wide's decode steps (tested for bits, not timed).

Where it applies (`LayerHalves.bind`): every layer's four projections int4 with the kind's packed weights
(gemm_bf16's: a GGUF Q4 model on an AVX-512 BF16 CPU; pack's, kept for gemm_q16 / gemm_wide where the own wide
GEMMs serve: quant.py), no biases, float32 norm weights; and the step one whose projections take that GEMM
(`Ops.layer_halves`: for bf16, `Ops.bf16_gemm_step`, a prompt chunk or any decode step, on a CPU with AMX decode
steps below AMX_DENSE_FROM_ROWS rows only, with bfloat16 between its matmuls; for q16 / wide,
`Ops.own_wide_step` with float32 between them). Anything else keeps the op-by-op path.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kernels.cpu.paged_decode import DecodePlan, cache_args

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Table(ctypes.Structure):
    """layers.cpp PrefixserveLayerKernels: the kernels' entry points, in its order."""

    _fields_ = [("gemm_bf16", _P), ("rms_norm", _P), ("add_rms_norm", _P), ("qkv_rope", _P), ("silu_mul", _P),
                ("gemm_f32", _P)]


class _LayerWeights(ctypes.Structure):
    """layers.cpp PrefixserveBoundLayer."""

    _fields_ = [("w_in", _P), ("eps_in", _F), ("qkv_w", _P), ("qkv_sz", _P), ("o_w", _P), ("o_sz", _P),
                ("w_post", _P), ("eps_post", _F), ("gu_w", _P), ("gu_sz", _P), ("dn_w", _P), ("dn_sz", _P)]


class _DecodeStep(ctypes.Structure):
    """layers.cpp PrefixserveDecodeStep: the paged decode kernel and what its calls share in a decode step."""

    _fields_ = [("decode", _P), ("rows", _P), ("bt", _P), ("bt_stride", _I64), ("lens", _P), ("B", _I),
                ("scale", _F), ("kc_blk", _I64), ("kc_tok", _I64), ("kc_head", _I64), ("vc_blk", _I64),
                ("vc_tok", _I64), ("vc_head", _I64), ("kv_dtype", _I), ("items", _P), ("n_items", _I),
                ("members", _P), ("kc", _P), ("vc", _P), ("kc_layer", _I64), ("vc_layer", _I64)]


@dataclass(frozen=True)
class BoundLayer:
    """One layer's weights as the two calls take them: pointers into the layer's own tensors (`LayerHalves.bind`,
    once after loading: a model's weights never change after it)."""

    pre: tuple[int | float, ...]        # input norm weight, eps, qkv w, sz
    post: tuple[int | float, ...]       # o w, sz, post norm weight, eps, gate_up w, sz, down w, sz


@dataclass(frozen=True)
class BoundModel:
    """A model's layers bound (`LayerHalves.bind`): each for the halves, all of them for the decode call."""

    layers: list[BoundLayer]
    array: ctypes.Array[_LayerWeights]


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
    """The halves of one build (kernels/cpu/library.py loads it), bound to that build's fused kernels and the GEMM
    of its kind (`gemm`: "bf16" gemm_bf16, bfloat16 activations; "q16" gemm_q16 or "wide" gemm_wide, float32)."""

    GEMMS = {"bf16": "prefixserve_int4_gemm_bf16", "q16": "prefixserve_int4_gemm_q16",
             "wide": "prefixserve_int4_gemm_wide"}

    def __init__(self, lib: ctypes.CDLL, int4: ctypes.CDLL, fused: ctypes.CDLL, decode: ctypes.CDLL,
                 gemm: str = "bf16") -> None:
        assert gemm in self.GEMMS, gemm
        self.gemm = gemm
        self.act = torch.bfloat16 if gemm == "bf16" else torch.float32
        f32 = getattr(int4, self.GEMMS[gemm]) if gemm != "bf16" else None
        self._table = _Table(*(ctypes.cast(f, _P) for f in (
            int4.prefixserve_int4_gemm_bf16, fused.prefixserve_rms_norm, fused.prefixserve_add_rms_norm,
            fused.prefixserve_qkv_rope, fused.prefixserve_silu_mul)), ctypes.cast(f32, _P) if f32 is not None else None)
        suffix = "" if gemm == "bf16" else "_f32"
        self._pre = getattr(lib, f"prefixserve_layer_pre{suffix}")
        self._pre.argtypes = [_P, _P, _P, _P, _F, _P, _P, *[_P] * 7, *[_I] * 5]
        self._pre.restype = _I
        self._post = getattr(lib, f"prefixserve_layer_post{suffix}")
        self._post.argtypes = [_P, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P, *[_P] * 6, *[_I] * 4]
        self._post.restype = _I
        self._ptr = ctypes.addressof(self._table)
        self._decode_fn = ctypes.cast(decode.prefixserve_paged_decode, _P)
        self._layers_decode = getattr(lib, f"prefixserve_layers_decode{suffix}")
        self._layers_decode.argtypes = [_P, _P, _P, _I, *[_P] * 15, *[_I] * 6]
        self._layers_decode.restype = _I

    def _weights(self, lin: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A projection's packed weights and scales as this kind's GEMM takes them, or None where it has none (not
        int4 with them, a bias): the op layer's own conditions for that GEMM (kernels/ops.py Ops.linear)."""
        if getattr(lin, "kind", None) != "int4" or lin.bias is not None:
            return None
        if self.gemm == "bf16":
            return (lin.w4, lin.sz4) if lin.w4.numel() else None
        return (lin.q8, lin.sz8) if lin.q8.numel() and lin.dense_is_int4 else None

    def bind(self, model: Any) -> BoundModel | None:
        """Every layer of `model` (engine/models/llama.py) as the calls take it, or None where one does not take the
        halves on a wide step (a projection without this kind's packed weights, a bias, a norm weight that is not
        float32)."""
        bound = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            packed = [self._weights(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in packed):
                return None
            n_in, n_post = layer.input_layernorm, layer.post_attention_layernorm
            if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in (n_in, n_post)):
                return None
            (qkv_w, qkv_sz), (o_w, o_sz), (gu_w, gu_sz), (dn_w, dn_sz) = packed     # type: ignore[misc]
            bound.append(BoundLayer(
                pre=(n_in.weight.data_ptr(), n_in.eps, qkv_w.data_ptr(), qkv_sz.data_ptr()),
                post=(o_w.data_ptr(), o_sz.data_ptr(), n_post.weight.data_ptr(), n_post.eps, gu_w.data_ptr(),
                      gu_sz.data_ptr(), dn_w.data_ptr(), dn_sz.data_ptr())))
        array = (_LayerWeights * len(bound))(*(_LayerWeights(*b.pre, *b.post) for b in bound))
        return BoundModel(bound, array)

    def scratch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int, inter: int) -> LayerScratch:
        """A step's buffers for x [T, H] float32 contiguous (updated in place by the calls) and cos, sin [T, D]
        float32 contiguous; between the matmuls, this kind's activations."""
        t, hidden = x.shape
        between = self.act

        def e(*shape: int, dtype: torch.dtype = between) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype)

        f32 = torch.float32
        a = e(t, heads * head_dim) if between == torch.bfloat16 else e(0)    # float32: o reads the output itself
        h, qkv, o = e(t, hidden), e(t, (heads + 2 * kv_heads) * head_dim), e(t, hidden)
        q, k, v = e(t, heads, head_dim, dtype=f32), e(t, kv_heads, head_dim, dtype=f32), e(t, kv_heads, head_dim,
                                                                                             dtype=f32)
        gu, act = e(t, 2 * inter), e(t, inter)
        ptr = [b.data_ptr() for b in (cos, sin, h, qkv, q, k, v, x, a, o, gu, act)]
        return LayerScratch(x=x, r=(e(t, hidden), e(t, hidden)), buffers=(cos, sin, h, qkv, q, k, v, a, o, gu, act),
                            pre=(*ptr[:7], t, hidden, heads, kv_heads, head_dim),
                            post=(ptr[7], ptr[8], ptr[9], ptr[2], ptr[10], ptr[11], t, hidden, heads * head_dim, inter),
                            qkv=(q, k, v))

    def pre(self, s: LayerScratch, layer: BoundLayer, r: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """s.x += r (in place; r [T, H] of this kind's activations, None for the first layer), its norm, the qkv
        projection and RoPE -> q [T, Hq, D], k, v [T, Hkv, D] float32 (s's buffers)."""
        rc = self._pre(self._ptr, s.post[0], None if r is None else r.data_ptr(), *layer.pre, *s.pre)
        if rc != 0:
            raise ValueError(f"layer_pre: gemm_{self.gemm} refused the qkv projection (code {rc})")
        return s.qkv

    def post(self, s: LayerScratch, layer: BoundLayer, out: torch.Tensor, r_out: torch.Tensor) -> None:
        """out: the attention's [T, Hq, D] float32 (contiguous) -> s.x += its o projection (in place); the MLP's
        output of the norm of that into r_out [T, H] (this kind's activations)."""
        rc = self._post(self._ptr, out.data_ptr(), r_out.data_ptr(), *layer.post, *s.post)
        if rc != 0:
            raise ValueError(f"layer_post: gemm_{self.gemm} refused a projection (code {rc})")

    def decode_layers(self, s: LayerScratch, model: BoundModel, plan: DecodePlan, key_caches: torch.Tensor,
                      value_caches: torch.Tensor, scale: float) -> torch.Tensor:
        """Every layer of a decode step in one call (layers.cpp layers_decode): pre, the paged decode kernel with
        `plan` over layer i's caches key_caches[i], value_caches[i] ([layers, blocks, block_size, Hkv, D], the
        step's K / V written first), post -> the last layer's output (one of s.r)."""
        kc, vc = key_caches, value_caches
        assert kc.dtype == vc.dtype and kc.shape == vc.shape and kc.stride(-1) == vc.stride(-1) == 1
        assert plan.rows is not None and kc.shape[0] >= len(model.layers)
        size = kc.element_size()
        step = _DecodeStep(self._decode_fn, plan.rows.data_ptr(), plan.block_tables.data_ptr(),
                           plan.block_tables.stride(0), plan.seq_lens.data_ptr(), kc.shape[2], scale,
                           *cache_args(kc[0], vc[0]), plan.items.ctypes.data, len(plan.items), plan.members.ctypes.data,
                           kc.data_ptr(), vc.data_ptr(), kc.stride(0) * size, vc.stride(0) * size)
        cos, sin, h, qkv, q, k, v = s.pre[:7]
        t, hidden, heads, kv_heads, head_dim = s.pre[7:]
        x, a, o, _, gu, act = s.post[:6]
        out = torch.empty(t, heads, head_dim, dtype=torch.float32)     # the attention output (the shape of pre's q)
        rc = self._layers_decode(self._ptr, ctypes.addressof(step), model.array, len(model.layers), x, cos, sin, h,
                                 qkv, q, k, v, out.data_ptr(), a, o, gu, act, s.r[0].data_ptr(), s.r[1].data_ptr(),
                                 t, hidden, heads, kv_heads, head_dim, s.post[9])
        if rc != 0:
            raise ValueError(f"layers_decode: a kernel refused the step (code {rc})")
        return s.r[(len(model.layers) - 1) % 2]


__all__ = ["BoundLayer", "BoundModel", "LayerHalves", "LayerScratch"]
