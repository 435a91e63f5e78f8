"""Weight-only quantized linear layers: GGUF's 4- and 8-bit weights kept quantized on the CPU.

    int4   the projections of every layer as 4-bit weights with a scale and a zero per group of 32
           (torch's `_weight_int4pack_mm_for_cpu`, tinygemm's convention: w = (q - 8) * scale + zero).
           GGUF Q4_0 / Q4_1 blocks are exactly this form (Q4_1: q * d + m, so scale = d, zero = m + 8 d;
           Q4_0: (q - 8) * d, zero 0): their nibbles are taken as they are, not re-quantized; scale and zero
           are rounded from float16 to bfloat16, the kernel's format (so: the GGUF's weights up to that rounding).
           Other weights (K-quants, F16, F32) are quantized round-to-nearest, min/max per group.
    int8   8-bit weights with one scale per output row (`_weight_int8pack_mm`), round-to-nearest.

This module holds the weights; the op layer (kernels/ops.py, `Ops.linear` and `Ops.logits`) runs them, and it
decides the kernel by the step: a step with a prefill chunk, or of `DENSE_FROM_ROWS` rows or more, takes the
dense GEMM or its 4-bit twin (`Ops.linear` says why prefill always does); in the batch-invariant mode every step
takes the quantized kernel. The CPU's int4 and int8 kernels read each weight row once per input row (a
matrix-vector product per row), so they win while a
step has a few rows (decode of a few sequences: memory-bound, a fraction of the dense weight's bytes) and
lose to a dense GEMM through oneDNN once a step has many (prefill chunks, wide decode batches:
compute-bound). Measured on a 2-core AVX-512 BF16 CPU over the 120 projections of SmolLM2 with weights cold
in memory, per step, casts included: int4 4.95 / 8.1 / 13.7 / 18.9 / 24.7 / 87 ms at 1 / 4 / 8 / 10 / 16 / 64
rows against bfloat16's 11.5 / 14.5 / 16.0 / 17.7 / 21.1 / 44.7 ms (the crossover moves by a row or two
from run to run); on an AVX2 CPU, whose bfloat16 GEMM is emulated (8x slower than float32), the dense GEMM
is float32 and the crossover 16 rows (kernels/quant_gemm.py, DENSE_DTYPE and DENSE_FROM_ROWS); there a GGUF
Q4 layer's wide decode steps take our own int4 GEMM instead (kernels/cpu/int4_gemm.py gemm_wide: a panel of
the 4-bit weights decoded to float32 in L1 for all of a step's rows, 1.2x oneDNN's float32 GEMM at 64 rows
with the weights cold), and only prompt chunks read the dense copy. So too on an AVX-512 CPU without BF16 (a Cascade
Lake Xeon: oneDNN's bfloat16 is emulated there too), where gemm_wide runs AVX-512 loops and takes decode steps from
12 rows, torch's int4 kernel the narrower ones (kernels/quant_gemm.py WIDE512_FROM_ROWS). On an AVX-512 BF16 CPU
without AMX a GGUF Q4 layer's
wide steps, prompt chunks included, and every decode step whatever its rows (kernels/quant_gemm.py
BF16_GEMM_FROM_ROWS) take kernels/cpu/int4_gemm.py gemm_bf16 instead of oneDNN: each block of 32
outputs decoded from the 4-bit values into exactly the dense copy's bfloat16 weights (in L2), then vdpbf16ps over
all of the step's rows; the weights come from memory at a third of the bytes (4 bits and bfloat16 scales).
Measured on a Zen 4 over SmolLM2's 120 projections, weights cold, the two alternating: 14.0 / 41.5 / 68.7 /
126.5 / 250.2 / 1,023 ms at 16 / 64 / 128 / 256 / 512 / 2,048 rows against oneDNN's 19.2 / 49.2 / 77.6 / 134.3
/ 261.9 / 1,069 (products and weights the same; sums in another order: outputs within an ulp of bfloat16).
Such a layer keeps no dense copy. On a CPU with AMX, oneDNN's GEMM runs on the tile units and keeps a GGUF Q4
layer's prompt chunks and its decode steps from AMX_DENSE_FROM_ROWS rows (the layer keeps its dense copy), and
gemm_bf16 takes its narrower decode steps, in place of torch's int4 kernel (kernels/ops.py Ops.bf16_gemm_step).
Every other quantized layer keeps its weight dense (bfloat16, 2 bytes a
parameter: 212 MB for SmolLM2's layers; float32 on AVX2, 424 MB), reordered once into oneDNN's blocked layout;
the head keeps an int8 copy instead (28 MB, Int8ActHead), or a dense one where oneDNN's int8 kernel is missing.
(8-bit activations would be twice as fast again on VNNI, but cost too much accuracy on this model:
measured 13-17 of 20 first tokens equal to float32's, against int4's 20; and rounded per group of 32 of a row
(as llama.cpp's Q8 activations), int4 weights exact, in every wide step: 9 of the 20 greedy answers of
tests/engine/models/test_real_model.py equal to transformers' and 74% of their tokens before the first
divergence, against 17 and 90% for this module's path; "Paris" lost.)

The output projection (lm_head, tied to the embedding in SmolLM2: 49,152 x 576, a fifth of the model)
is quantized as the layers are, with its top logits recomputed exactly from the float weight
(QuantLogits: 64 of the 4-bit rows; 32 of a wide step's int8 x int8 product), so greedy choices do not
depend on the rounding; the embedding lookup reads one
row per token and stays in the serving dtype.

NOTE: precision. The CPU kernels are fast with bfloat16 activations only (fp32 activations take a
slow path, 20x slower here), so a quantized model runs in mixed precision (kernels/ops.py): bfloat16
between the matmuls, scales and zeros bfloat16 too; the residual stream, attention and logits stay in
the serving dtype. Greedy output is therefore close to, not equal to, the dequantized model's:
tests/engine/models/test_quant.py and test_real_model.py state the tolerance and measure the agreement.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from kernels.cpu import int4_gemm
from kernels.ops import Ops, default_ops
from kernels.quant_gemm import (
    ACT,
    DENSE_DTYPE,
    DENSE_FROM_ROWS,
    GROUP,
    dequantize_int4,
    int4_fits,
    pack_dense,
    pack_int4,
)


class Int4Linear(nn.Module):
    """y = x @ W^T (+ b) with W as 4-bit groups (Ops.linear runs it: bfloat16 in and out). Called as a module,
    x is any float dtype and y comes back in it."""

    kind = "int4"
    dense: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dense: torch.Tensor | None = None, ops: Ops | None = None) -> None:
        # q: [out, in] int32 in 0..15; scale, zero: [out, in // GROUP]; dense: the float weight the wide
        # path uses (default: these 4-bit values, dequantized)
        super().__init__()
        self.ops = ops or default_ops()
        self.out_features, self.in_features = q.shape
        packed, scale_zero = pack_int4(q, scale, zero)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        s, z = scale.to(ACT).float(), zero.to(ACT).float()        # the kernels' bfloat16 scale and zero
        # the dense weight is these 4-bit values (a GGUF Q4 layer): then wide steps may decode them instead
        # (kernels/ops.py Ops.linear); a float weight kept from from_float is the better of the two, and read
        self.dense_is_int4 = dense is None
        # where the dense GEMM is bfloat16 (AVX-512 BF16), a GGUF Q4 layer's wide steps (prompt chunks and decode
        # steps of BF16_GEMM_FROM_ROWS rows or more) run the int4 x bfloat16 GEMM (int4_gemm.py gemm_bf16): the same
        # 4-bit values and bfloat16 scales, decoded into exactly the dense copy's weights; that copy is then never read
        # and not kept (212 MB for SmolLM2), except on a CPU with AMX, where gemm_bf16 takes the narrow decode steps
        # and the dense copy the rest (oneDNN's GEMM on the tile units: kernels/ops.py Ops.bf16_gemm_step)
        self.w4: torch.Tensor
        self.sz4: torch.Tensor
        if self.dense_is_int4 and self.ops.wide_int4_bf16 and int4_gemm.fits_bf16(self.out_features, self.in_features):
            w4, sz4 = int4_gemm.pack_bf16(q, s, z)
        else:
            w4, sz4 = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.bfloat16)
        self.register_buffer("w4", w4)
        self.register_buffer("sz4", sz4)
        # likewise where gemm_q16 serves its prompt chunks and wide decode steps (kernels/ops.py Ops.wide_int4_q16)
        q16 = self.dense_is_int4 and self.ops.wide_int4_q16 and int4_gemm.fits(self.out_features, self.in_features)
        if (w4.numel() and not self.ops.int4_bf16_keeps_dense) or q16:
            self.register_buffer("dense", torch.empty(0, dtype=DENSE_DTYPE))
        else:
            if dense is None:
                dense = dequantize_int4(q, s, z)
            self.register_buffer("dense", pack_dense(dense))
        # the C++ int4 GEMMs' packing (kernels/cpu/int4_gemm.py gemm, gemm_wide) where wide steps are float32 GEMMs
        self.q8: torch.Tensor
        self.sz8: torch.Tensor
        if DENSE_DTYPE == torch.float32 and int4_gemm.fits(self.out_features, self.in_features):
            q8, sz8 = int4_gemm.pack(q, s, z)
        else:
            q8, sz8 = torch.empty(0, dtype=torch.int32), torch.empty(0)
        self.register_buffer("q8", q8)
        self.register_buffer("sz8", sz8)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        return self.ops.linear(self, x.to(ACT), wide).to(x.dtype)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None, ops: Ops | None = None) -> Int4Linear:
        """Round-to-nearest, asymmetric, min/max per group of 32 (as GGUF's Q4_1 quantizes)."""
        q, scale, zero = int4_gemm.quantize(w)
        return cls(q, scale, zero, bias, dense=w, ops=ops)


class Int8Linear(nn.Module):
    """y = x @ W^T (+ b) with W as int8 rows, one scale per output row (Ops.linear runs it)."""

    kind = "int8"
    dense: torch.Tensor
    weight_q: torch.Tensor
    scale: torch.Tensor

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, ops: Ops | None = None) -> None:
        super().__init__()
        self.ops = ops or default_ops()
        self.out_features, self.in_features = w.shape
        scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("weight_q", torch.round(w.float() / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(ACT))
        self.register_buffer("dense", pack_dense(self.weight_q.float() * self.scale.float()[:, None]))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        return self.ops.linear(self, x.to(ACT), wide).to(x.dtype)


class QuantLogits(nn.Module):
    """The output projection: coarse logits for the whole vocabulary, then the top ones of each row
    recomputed exactly, in float32, from the serving weight (the embedding table when tied: no copy).
    `Ops.logits` runs it:

        steps under `Ops.head_wide_rows` rows      the quantized rows (int4 or int8, as the layers); top 64
        (DENSE_FROM_ROWS; 4 where gemm_bf16 serves the layers, 3 where gemm_q16 does: kernels/quant_gemm.py)
        wider steps                                int8 weights x int8 activations (kernels/quant_gemm.py
                                                   Int8ActHead, oneDNN with VNNI); top 32; where the dense
                                                   GEMM is float32 (AVX2), int4 weights x int8 activations
                                                   (kernels/cpu/int4_gemm.py Q8Head); top 64 (neither: the
                                                   dense GEMM; top 16)
        the batch-invariant mode                   the quantized rows at every row count; top 64

    NOTE: why. The quantized kernels return bfloat16, whose step at a logit of 16 is 0.125, and 4-bit
    rows move a logit by a few tenths: greedy choices between logits that close would be decided by
    rounding (SmolLM2 answering "What is the capital of France?" has "The" 0.08 above "L" at its first
    token). The top candidates are exact again; the rest keep the coarse value, which moves sampling
    probabilities of the tail only. Agreement criterion: a row's greedy choice is the exact head's
    whenever the exact argmax is among the coarse top k (measured on SmolLM2's real hidden states: the
    exact argmax ranks within the int8 head's top 7 on 1,340 rows, tests/engine/models/test_real_model.py).
    It is a criterion, not a promise: a row whose exact argmax falls outside the coarse top k gets the
    best of the k. int4 rows read half the bytes of int8 and the CPU's int4 kernel is the faster one
    (measured here on SmolLM2's 49,152 x 576 head: 0.86 ms against 2.5 ms at batch 1, 6.2 ms against 12.5
    ms at 16 rows), so int4 weights get an int4 head."""

    kind = "head"

    def __init__(self, weight: torch.Tensor, mode: str = "int8", refine: int = 64, ops: Ops | None = None) -> None:
        super().__init__()
        self.ops = ops or default_ops()
        int4 = mode == "int4" and int4_fits(weight)
        self.coarse: nn.Module = Int4Linear.from_float(weight, None, self.ops) if int4 else \
            Int8Linear(weight, None, self.ops)
        self.weight = weight                        # float, [vocab, hidden]; shared with the embedding if tied
        self.refine = min(refine, weight.shape[0])
        self.wide = self.ops.wide_head(weight)
        if self.wide is not None:                   # the dense copy only the wide path read
            self.coarse.register_buffer("dense", torch.empty(0, dtype=ACT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.logits(self, x)


# -- GGUF blocks, nibbles as they are ------------------------------------------------------------------
def gguf_q4(raw: np.ndarray, type_name: str, rows: int, cols: int) -> tuple[torch.Tensor, ...] | None:
    """(q [rows, cols] 0..15, scale, zero [rows, cols // 32]) of a Q4_0 / Q4_1 tensor's raw blocks, or
    None for other types. Block layouts (ggml): Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]};
    element j < 16 is the low nibble of qs[j], element j + 16 the high nibble."""
    head = {"Q4_0": 2, "Q4_1": 4}.get(type_name)
    if head is None:
        return None
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if head == 4 else None
    qs = blocks[..., head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols).astype(np.int32)
    zero = m + 8 * d if m is not None else np.zeros_like(d)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero)


def quantize_model(model: Any, mode: str, gguf_q4_weights: dict[str, tuple[torch.Tensor, ...]] | None = None,
                   ops: Ops | None = None) -> None:
    """Replaces the model's projections (and lm_head) with quantized layers, in place. `gguf_q4_weights`:
    our parameter name -> the exact 4-bit form of that weight (fused projections already concatenated)."""
    assert mode in ("int8", "int4")
    ops = ops or default_ops()
    exact = gguf_q4_weights or {}
    for i, layer in enumerate(model.layers):
        for owner, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            lin: nn.Linear = getattr(owner, attr)
            w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            name = f"layers.{i}.{'self_attn' if owner is layer.self_attn else 'mlp'}.{attr}.weight"
            if mode == "int8" or not int4_fits(w):
                setattr(owner, attr, Int8Linear(w, b, ops))
            elif name in exact:
                q, scale, zero = exact[name]
                setattr(owner, attr, Int4Linear(q, scale, zero, b, ops=ops))
            else:
                setattr(owner, attr, Int4Linear.from_float(w, b, ops))
    model.lm_head = QuantLogits(model.lm_head.weight.detach(), mode, ops=ops)


__all__ = ["DENSE_FROM_ROWS", "GROUP", "Int4Linear", "Int8Linear", "QuantLogits", "gguf_q4",
           "quantize_model"]
