"""Weight-only quantized GEMMs on the CPU: torch's int4 and int8 kernels and oneDNN's bfloat16 and int8 x int8
GEMMs, with the packing each reads. The op layer (kernels/ops.py) decides which one a step runs; the engine's
quantized modules (engine/models/quant.py) hold the packed weights.

    int4   4-bit weights, a scale and a zero per group of 32 (`_weight_int4pack_mm_for_cpu`, tinygemm's
           convention: w = (q - 8) * scale + zero), bfloat16 activations in and out
    int8   int8 weights, one scale per output row (`_weight_int8pack_mm`), bfloat16 in and out
    dense  the same weight for the GEMM a wide step runs, reordered once into oneDNN's blocked layout (what
           inductor's freezing does for CPU linears: on AVX-512 BF16, measured 15.5 / 44.7 ms a step at 16 / 64
           rows against 29.7 / 58.3 for F.linear, which reorders the weight every call; equal results):
           in bfloat16 where oneDNN has a native bfloat16 GEMM (AVX-512 BF16, AMX); in float32 elsewhere
           (AVX2, AVX-512 without BF16), where a bfloat16 GEMM is emulated (`native_bf16`): measured on an AVX2
           Zen 3, SmolLM2's four projections of a layer at 64 / 256 / 1,024 rows took 23.9 / 92.0 / 366.6 ms
           through torch's bfloat16 linear against 3.6 / 12.1 / 45.7 ms in float32 through oneDNN (`DENSE_DTYPE`)
    Int8ActHead   int8 weights x int8 activations (oneDNN's VNNI kernel), for a wide step's output projection

The CPU's int4 and int8 kernels read each weight row once per input row (a matrix-vector product a row), so
they win while a step has a few rows (memory-bound) and lose to the bfloat16 GEMM once it has many
(compute-bound): DENSE_FROM_ROWS, measured in engine/models/quant.py's docstring.
"""
from __future__ import annotations

import torch

from kernels.cpu.library import cpu_flags

VNNI = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})    # an int8 dot product without saturation

GROUP = 32                       # the int4 group along the input dimension (GGUF's block size)
ACT = torch.bfloat16             # the activations' dtype in and out of every quantized GEMM

# The CPU flags of a native bfloat16 dot product, which oneDNN's bfloat16 GEMM needs to be fast.
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})


def native_bf16(flags: frozenset[str], onednn_bf16: bool) -> bool:
    """Whether the dense GEMM of wide steps is bfloat16: oneDNN takes bfloat16 (`onednn_bf16`, torch's
    `_is_mkldnn_bf16_supported`) and the CPU multiplies it natively. torch says yes on any AVX-512 CPU, where
    oneDNN emulates it: on an AVX-512 Xeon without BF16 (Cascade Lake, 2 cores) SmolLM2's 576 x 1,536 projection at
    1,024 rows ran at 48.6 GFLOPS through torch's bfloat16 linear against 232.8 in float32, and a 3,137-token
    prefill took 16.8 s in process with the bfloat16 dense GEMM."""
    return onednn_bf16 and bool(NATIVE_BF16 & flags)


# oneDNN has a native bfloat16 GEMM on this CPU (AVX-512 BF16 / AMX); elsewhere the wide path computes in float32.
# Constants, read by the compiled decode graph too.
ONEDNN = torch.backends.mkldnn.is_available()
ONEDNN_BF16 = native_bf16(cpu_flags(), ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
DENSE_DTYPE = torch.bfloat16 if ONEDNN_BF16 else torch.float32
# Steps of this many rows or more use the dense weight (by default): where the int4 kernel (a matrix-vector
# product a row) and the dense GEMM cost the same over SmolLM2's 120 projections, weights cold. AVX-512 BF16
# (Zen 4): int4 18.9 / 24.7 ms at 10 / 16 rows against bfloat16's 17.7 / 21.1 ms. AVX2 (Zen 3), float32: int4
# 22.5 / 43.4 / 85.3 ms at 8 / 16 / 32 rows against 31.8 / 43.4 / 68.5 ms.
DENSE_FROM_ROWS = 10 if ONEDNN_BF16 else 16
# Where a GGUF int4 layer's wide steps take our int4 x bfloat16 GEMM instead (kernels/cpu/int4_gemm.py gemm_bf16:
# AVX-512 BF16 without AMX), every decode step is wide: over SmolLM2's 120 projections, weights cold, the two
# alternating on a Zen 4, torch's int4 kernel takes 4.70 / 7.21 / 11.68 / 12.25 / 17.46 ms at 1 / 4 / 5 / 8 / 10
# rows against gemm_bf16's 7.63 / 8.60 / 8.55 / 10.68 / 12.10 ms, so the GEMMs alone cross at 5 rows; but a wide
# decode step runs its layers in one C++ call (kernels/cpu/layers.py) where a narrow one goes op by op from
# Python, and whole decode steps, the thresholds alternating step by step in one process, took 9.45 / 10.34 /
# 11.63 / 13.06 / 17.63 ms at 1 / 2 / 4 / 6 / 8 rows wide against 11.01 / 12.48 / 15.71 / 19.24 / 24.13 narrow.
# The head's int8 x int8 product (Int8ActHead) against the int4 rows, top candidates recomputed in both: 1.79 /
# 1.50 / 1.54 / 1.81 / 2.20 ms at 1 / 2 / 4 / 5 / 8 rows against 1.17 / 1.20 / 1.69 / 3.13 / 3.32 ms
# (kernels/ops.py Ops.wide_rows, Ops.head_wide_rows).
BF16_GEMM_FROM_ROWS = 1
# On a CPU with AMX, oneDNN's bfloat16 GEMM runs on the tile units, which gemm_bf16 (vdpbf16ps) does not use: prompt
# chunks and decode steps of this many rows or more keep it (the dense copy), and gemm_bf16 with the layers in one
# C++ call takes the narrower decode steps, whose alternative was torch's int4 kernel op by op (no tile units
# either: the AMX Xeon's profile in issue 36 found it 40% of the engine thread in the shared-prefix load). On a
# Zen 4 given AMX's flags (this dispatch, its own kernels), in process, greedy decode after a 64-token prompt: 1 / 4
# / 8 streams at 127.9 / 400.3 / 579.1 tok/s against 93.9 / 268.2 / 336.8 with torch's int4 kernel op by op (medians
# of four, alternating). The crossover is not measured on an AMX CPU (none here): the bfloat16 dense GEMM's
# DENSE_FROM_ROWS (10; an AMX CPU has a native bfloat16 GEMM), where a step starts to be compute-bound rather than
# bound by the weights' bytes (Ops.bf16_gemm_step).
AMX_DENSE_FROM_ROWS = 10
# Where gemm_wide has its AVX-512 loops (kernels/cpu/int4_gemm.py `wide_path`: an AVX-512 CPU without BF16, whose
# dense GEMM is float32), a GGUF int4 layer's decode steps take it from this many rows, and the narrower ones torch's
# int4 kernel (AVX-512 code there) instead of our row-blocked gemm (AVX2 loops: 4.42 against 3.41 ms at one row over
# 8 layers' projections). Over SmolLM2's 120 projections with the weights cold (`prefixserve bench gemm --rows
# 8,10,12,14 --reps 7`, an AVX-512 Xeon without BF16, 2 threads): torch's int4 kernel 17.58 / 25.53 / 25.62 / 33.63 ms
# at 8 / 10 / 12 / 14 rows, gemm_wide 19.22 / 25.93 / 26.06 / 26.30 (its rows come in blocks of 8), oneDNN's float32
# GEMM 40.76 / 42.31 / 43.07 / 47.37 (Ops.own_wide_from).
WIDE512_FROM_ROWS = 12
# Where gemm_q16 runs (int4 weights x int16 activations, kernels/cpu/int4_gemm.py: an AVX-512 CPU with VNNI and no
# BF16), a GGUF int4 layer's decode steps take it from this many rows: every decode step. Over SmolLM2's 120
# projections alone, weights cold (`prefixserve bench gemm --rows 2,4,6,8 --reps 9`, an AVX-512 Xeon without BF16,
# Cascade Lake, 2 threads), torch's int4 kernel is the faster below 8 rows: 13.39 / 17.96 / 29.51 / 26.18 ms at 2 /
# 4 / 6 / 8 rows, gemm_q16 23.18 / 24.10 / 23.07 / 25.33 (and at 12 / 64 / 512 rows 25.92 / 70.06 / 417.61 ms
# against gemm_wide's 40.59 / 99.03 / 728.68 and oneDNN's float32 GEMM's 47.60 / 108.47 / 564.08). But a step whose
# layers take gemm_q16 runs them as the float32 C++ halves, a decode step in one call (kernels/cpu/layers.py), where
# torch's kernel goes op by op from Python: whole decode steps after 576-token prompts, in process, the two
# thresholds alternating (medians of five), 24.6 / 28.2 / 33.5 / 38.6 ms at 1 / 2 / 4 / 6 rows from 1 row against
# 28.2 / 32.8 / 46.5 / 63.0 from 8 (the halves then took the steps from 8 rows only).
Q16_FROM_ROWS = 1
INT8_HEAD_FROM_ROWS = 4
# Where gemm_q16 serves the layers (AVX-512 VNNI without BF16), the head's int8 x int8 product (Int8ActHead, oneDNN with
# VNNI) takes its steps from this many rows: a whole `Ops.logits` call (the coarse product, then the top candidates
# recomputed) on SmolLM2's 49,152 x 576 head, a Cascade Lake Xeon, 2 threads, the two alternating (medians of five):
# the int4 rows 2.19 / 1.88 / 2.41 / 4.04 / 5.02 / 5.55 / 7.71 / 14.69 ms at 1 / 2 / 3 / 4 / 6 / 8 / 12 / 15 rows,
# the int8 head 2.11 / 1.91 / 2.03 / 2.33 / 2.28 / 2.52 / 2.82 / 4.34. It had DENSE_FROM_ROWS (16) there, never
# measured: a decode step of 8 streams spent ~3 ms more on its head than it had to, one of 15 ~10 ms.
INT8_HEAD_Q16_FROM_ROWS = 3


def onednn_bf16() -> bool:
    return ONEDNN_BF16


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q [out, in] 0..15, scale, zero [out, in // GROUP] (float32) -> the float32 weight (q - 8) * scale + zero."""
    return ((q.float() - 8).view(q.shape[0], -1, GROUP) * scale[..., None] + zero[..., None]).view(q.shape)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, in] 0..15, scale, zero [out, in // GROUP] -> (the int4 kernel's packed weight, [in // GROUP, out, 2]
    bfloat16 scale and zero)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(ACT)
    return packed, sz


def int4_fits(w: torch.Tensor) -> bool:
    """The int4 kernel's shape rules: whole groups along the input, output rows a multiple of 16."""
    return w.shape[1] % GROUP == 0 and w.shape[0] % 16 == 0


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight as the dense GEMM reads it: DENSE_DTYPE, oneDNN's layout where oneDNN is there."""
    w = w.to(DENSE_DTYPE).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w, 64) if ONEDNN else w


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [T, in] bfloat16 -> [T, out] bfloat16."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


def int8_mm(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, in] bfloat16 -> [T, out] bfloat16."""
    return torch.ops.aten._weight_int8pack_mm(x, weight_q, scale)


def dense_mm(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] (bfloat16 or float32) @ W^T (+ b), W as `pack_dense` made it -> [T, out] in x's dtype (computed
    in W's dtype: a float32 W takes x exactly; no conversion where x is already in it). A row's result depends on
    that row only: oneDNN sums a lone row in another order than a row among others (its float32 kernel for one row
    of SmolLM2's 1,536-input down projection, on an AVX-512 Xeon without BF16: up to 3.3e-6 apart; 2 to 2,048 rows
    gave the same bits), so a single row goes in with a zero row beside it. That keeps a prompt's tokens the same
    whether its last one is computed alone (the rest cached) or with others (the README's named-prefix promise)."""
    xw = x.to(dense.dtype)
    lone = xw.shape[0] == 1
    if lone:
        xw = torch.cat([xw, torch.zeros_like(xw)])
    b = None if bias is None else bias.to(dense.dtype)
    y = torch.ops.mkldnn._linear_pointwise(xw, dense, b, "none", [], "") if ONEDNN else \
        torch.nn.functional.linear(xw, dense, b)
    return (y[:1] if lone else y).to(x.dtype)


class Int8ActHead:
    """The output projection of a wide step as an int8 x int8 product on oneDNN's VNNI kernel: int8 weights
    with one scale per vocabulary row, the step's activations as int8 with one scale per row (applied to the
    output row: oneDNN takes one activation scale a call). Twice the bfloat16 GEMM's rate on an AVX-512 CPU
    (measured 5.1 against 9.5 ms for SmolLM2's 49,152 x 576 head at 64 rows); its logits are off by up to a
    few units, which is why the quantized head recomputes the top ones exactly. `make` gives None where
    oneDNN's quantized linear is missing or fails here, and on CPUs without VNNI (AVX2 alone): there oneDNN
    multiplies u8 x s8 pairs with `vpmaddubsw`, whose 16-bit sums saturate, and the coarse logits are wrong
    by hundreds (on a Zen 3 the exact argmax ranked 361st), so the dense head serves instead."""

    refine = 32              # its top 32 logits recomputed exactly (measured: the exact argmax within its top 7)

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.packed = torch.ops.onednn.qlinear_prepack(torch.round(w / self.scale[:, None]).to(torch.int8), None)
        self.zeros = torch.zeros(w.shape[0], dtype=torch.int64)

    @classmethod
    def make(cls, weight: torch.Tensor) -> Int8ActHead | None:
        if weight.device.type != "cpu" or not ONEDNN or not hasattr(torch.ops.onednn, "qlinear_pointwise"):
            return None
        if not VNNI & cpu_flags():
            return None
        try:
            head = cls(weight)
            x = torch.linspace(-1.0, 1.0, DENSE_FROM_ROWS * weight.shape[1]).view(DENSE_FROM_ROWS, -1)  # no RNG
            if not torch.isfinite(head(x)).all():
                return None
        except (RuntimeError, NotImplementedError):
            return None
        return head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] float32 -> [T, vocab] float32."""
        s = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(x / s).add_(128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, self.packed, self.scale, self.zeros, None, 1.0, 0,
                                               torch.float32, "none", [], "")
        return y.mul_(s)


__all__ = ["ACT", "BF16_GEMM_FROM_ROWS", "DENSE_DTYPE", "DENSE_FROM_ROWS", "GROUP", "INT8_HEAD_FROM_ROWS",
           "INT8_HEAD_Q16_FROM_ROWS", "Q16_FROM_ROWS", "WIDE512_FROM_ROWS", "Int8ActHead", "dense_mm", "int4_fits",
           "int4_mm", "int8_mm", "onednn_bf16", "pack_dense", "pack_int4"]
