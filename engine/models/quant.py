"""Weight-only quantized linear layers: GGUF's 4- and 8-bit weights kept quantized on the CPU.

    int4   the projections of every layer as 4-bit weights with a scale and a zero per group of 32
           (torch's `_weight_int4pack_mm_for_cpu`, tinygemm's convention: w = (q - 8) * scale + zero).
           GGUF Q4_0 / Q4_1 blocks are exactly this form (Q4_1: q * d + m, so scale = d, zero = m + 8 d;
           Q4_0: (q - 8) * d, zero 0): their nibbles are taken as they are, not re-quantized; scale and zero
           are rounded from float16 to bfloat16, the kernel's format (so: the GGUF's weights up to that rounding).
           Other weights (K-quants, F16, F32) are quantized round-to-nearest, min/max per group.
    int8   8-bit weights with one scale per output row (`_weight_int8pack_mm`), round-to-nearest.

Steps decide the kernel: a step with a prefill chunk, or of `DENSE_FROM_ROWS` rows or more, takes the
bfloat16 GEMM (engine/models/llama.py `project` says why prefill always does). The CPU's int4 and int8
kernels read each weight row once per input row (a matrix-vector product per row), so they win while a
step has a few rows (decode of a few sequences: memory-bound, half or a quarter of bf16's bytes) and
lose to a bfloat16 GEMM (oneDNN, AVX-512 BF16) once a step has many (prefill chunks, wide decode batches:
compute-bound). Measured on this 2-core CPU over the 120 projections of SmolLM2 with weights cold in
memory, per step, casts included: int4 4.95 / 8.1 / 13.7 / 18.9 / 24.7 / 87 ms at 1 / 4 / 8 / 10 / 16 / 64
rows against bfloat16's 11.5 / 14.5 / 16.0 / 17.7 / 21.1 / 44.7 ms (the crossover moves by a row or two
from run to run). Every quantized layer therefore also keeps its weight in bfloat16 (2 bytes a
parameter: 212 MB for SmolLM2's layers), reordered once into oneDNN's blocked layout; the head keeps an
int8 copy instead (28 MB, Int8ActHead), or a bfloat16 one (56 MB) where oneDNN's int8 kernel is missing.
(8-bit activations would be twice as fast again on VNNI, but cost too much accuracy on this model:
measured 13-17 of 20 first tokens equal to float32's, against int4's 20.)

The output projection (lm_head, tied to the embedding in SmolLM2: 49,152 x 576, a fifth of the model)
is quantized as the layers are, with its top logits recomputed exactly from the float weight
(QuantLogits: 64 of the 4-bit rows; 32 of a wide step's int8 x int8 product), so greedy choices do not
depend on the rounding; the embedding lookup reads one
row per token and stays in the serving dtype.

NOTE: precision. The CPU kernels are fast with bfloat16 activations only (fp32 activations take a
slow path, 20x slower here), so a quantized layer casts its input to bfloat16 and its output back;
scales and zeros are bfloat16 too. Everything else (norms, attention, residuals, logits) stays in the
serving dtype. Greedy output is therefore close to, not equal to, the dequantized model's:
tests/engine/models/test_quant.py and test_real_model.py state the tolerance and measure the agreement.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from engine.config import QUANTIZATIONS
from kernels.cpu import logits as cpu_logits

GROUP = 32                       # GGUF's block size for Q4_0 / Q4_1 / Q8_0, and our int4 group
_ACT = torch.bfloat16
DENSE_FROM_ROWS = 10             # steps of this many rows or more use the bfloat16 weight (measured above)
# oneDNN's matmul on a weight reordered once into its blocked layout (what inductor's freezing does for
# CPU linears): measured 15.5 / 44.7 ms a step at 16 / 64 rows against 29.7 / 58.3 for F.linear, which
# reorders the weight on every call; equal results.
_PACKED = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight as the bfloat16 GEMM path reads it (oneDNN's layout where available)."""
    w = w.to(_ACT).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w, 64) if _PACKED else w


def _mm_bf16(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.to(_ACT)
    return torch.ops.mkldnn._linear_pointwise(x, dense, b, "none", [], "") if _PACKED else \
        torch.nn.functional.linear(x, dense, b)


def dense_linear(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bfloat16 GEMM path: x [T, in] (any float dtype) @ W^T (+ b), W as `pack_dense` made it -> x's dtype."""
    xb = x.to(_ACT)
    b = None if bias is None else bias.to(_ACT)
    y = torch.ops.mkldnn._linear_pointwise(xb, dense, b, "none", [], "") if _PACKED else \
        torch.nn.functional.linear(xb, dense, b)
    return y.to(x.dtype)


def int4_fits(w: torch.Tensor) -> bool:
    """The int4 kernel's shape rules: whole groups along the input, output rows a multiple of 16."""
    return w.shape[1] % GROUP == 0 and w.shape[0] % 16 == 0


class Int4Linear(nn.Module):
    """y = x @ W^T (+ b) with W as 4-bit groups; x: [T, in] in any float dtype, y in x's dtype."""

    dense: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dense: torch.Tensor | None = None) -> None:
        # q: [out, in] int32 in 0..15; scale, zero: [out, in // GROUP]; dense: the float weight the wide
        # path uses (default: these 4-bit values, dequantized)
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2))
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()         # [in // GROUP, out, 2]
        self.register_buffer("scale_zero", sz.to(_ACT))
        if dense is None:    # (q - 8) * scale + zero, with the kernel's bfloat16 scale and zero
            s, z = scale.to(_ACT).float(), zero.to(_ACT).float()
            dense = ((q.float() - 8).view(self.out_features, -1, GROUP) * s[..., None] + z[..., None]).view(q.shape)
        self.register_buffer("dense", pack_dense(dense))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    takes_wide = True

    def forward_bf16(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """The fast path's form: x [T, in] bfloat16 -> [T, out] bfloat16, bias included (in bfloat16)."""
        if wide or x.shape[0] >= DENSE_FROM_ROWS:
            return _mm_bf16(x, self.dense, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)
        return y if self.bias is None else y.add_(self.bias.to(_ACT))

    def forward(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        if wide or x.shape[0] >= DENSE_FROM_ROWS:
            return dense_linear(x, self.dense, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(_ACT), self.packed, GROUP, self.scale_zero).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        """Round-to-nearest, asymmetric, min/max per group of 32 (as GGUF's Q4_1 quantizes)."""
        out, inp = w.shape
        g = w.float().reshape(out, inp // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        d = (hi - lo) / 15
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q = torch.clamp(torch.round((g - lo[..., None]) / safe[..., None]), 0, 15).reshape(out, inp)
        return cls(q.to(torch.int32), d, lo + 8 * d, bias, dense=w)


class Int8Linear(nn.Module):
    """y = x @ W^T (+ b) with W as int8 rows, one scale per output row."""

    dense: torch.Tensor
    weight_q: torch.Tensor
    scale: torch.Tensor

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("weight_q", torch.round(w.float() / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(_ACT))
        self.register_buffer("dense", pack_dense(self.weight_q.float() * self.scale.float()[:, None]))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    takes_wide = True

    def forward_bf16(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """The fast path's form: x [T, in] bfloat16 -> [T, out] bfloat16, bias included (in bfloat16)."""
        if wide or x.shape[0] >= DENSE_FROM_ROWS:
            return _mm_bf16(x, self.dense, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight_q, self.scale)
        return y if self.bias is None else y.add_(self.bias.to(_ACT))

    def forward(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        if wide or x.shape[0] >= DENSE_FROM_ROWS:
            return dense_linear(x, self.dense, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x.to(_ACT), self.weight_q, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8ActHead:
    """The output projection of a wide step as an int8 x int8 product on oneDNN's VNNI kernel: int8 weights
    with one scale per vocabulary row, the step's activations as int8 with one scale per row (applied to the
    output row: oneDNN takes one activation scale a call). Twice the bfloat16 GEMM's rate on this CPU
    (measured 5.1 against 9.5 ms for SmolLM2's 49,152 x 576 head at 64 rows); its logits are off by up to a
    few units, which is why QuantLogits recomputes the top ones exactly. `make` gives None where oneDNN's
    quantized linear is missing or fails here."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.packed = torch.ops.onednn.qlinear_prepack(torch.round(w / self.scale[:, None]).to(torch.int8), None)
        self.zeros = torch.zeros(w.shape[0], dtype=torch.int64)

    @classmethod
    def make(cls, weight: torch.Tensor) -> Int8ActHead | None:
        if weight.device.type != "cpu" or not _PACKED or not hasattr(torch.ops.onednn, "qlinear_pointwise"):
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


class QuantLogits(nn.Module):
    """The output projection: coarse logits for the whole vocabulary, then the top ones of each row
    recomputed exactly, in float32, from the serving weight (the embedding table when tied: no copy).

        steps of fewer than DENSE_FROM_ROWS rows   the quantized rows (int4 or int8, as the layers); top 64
        wider steps                                int8 weights x int8 activations (Int8ActHead); top 32
                                                   (without oneDNN's int8 kernel: the bfloat16 GEMM; top 16)

    NOTE: why. The quantized kernels return bfloat16, whose step at a logit of 16 is 0.125, and 4-bit
    rows move a logit by a few tenths: greedy choices between logits that close would be decided by
    rounding (SmolLM2 answering "What is the capital of France?" has "The" 0.08 above "L" at its first
    token). The top candidates are exact again; the rest keep the coarse value, which moves sampling
    probabilities of the tail only. Agreement criterion: a row's greedy choice is the exact head's
    whenever the exact argmax is among the coarse top k (measured on SmolLM2's real hidden states: the
    exact argmax ranks within the int8 head's top 7 on 1,340 rows, tests/engine/models/test_real_model.py).
    int4 rows read half the bytes of int8 and the CPU's int4 kernel is the faster one (measured here on
    SmolLM2's 49,152 x 576 head: 0.86 ms against 2.5 ms at batch 1, 6.2 ms against 12.5 ms at 16 rows), so
    int4 weights get an int4 head."""

    WIDE_REFINE = 32

    def __init__(self, weight: torch.Tensor, mode: str = "int8", refine: int = 64) -> None:
        super().__init__()
        int4 = mode == "int4" and int4_fits(weight)
        self.dense: nn.Module = Int4Linear.from_float(weight, None) if int4 else Int8Linear(weight, None)
        self.weight = weight                        # float, [vocab, hidden]; shared with the embedding if tied
        self.refine = min(refine, weight.shape[0])
        self.wide = Int8ActHead.make(weight)
        if self.wide is not None:                   # the bfloat16 copy only the wide path read
            self.dense.register_buffer("dense", torch.empty(0, dtype=_ACT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().contiguous()
        if x.shape[0] < DENSE_FROM_ROWS:
            logits, k = self.dense(x).float(), self.refine                      # [T, V] coarse
        elif self.wide is not None:
            logits, k = self.wide(xf), min(self.refine, self.WIDE_REFINE)
        else:
            # rows from the bfloat16 GEMM are off by bfloat16 rounding only: their top 16 are refined
            logits, k = self.dense(x).float(), min(self.refine, 16)
        top = _topk(logits, k)                                                  # [T, k]
        if cpu_logits.available() and logits.device.type == "cpu" and self.weight.dtype in (torch.float32,
                                                                                           torch.bfloat16):
            return cpu_logits.refine(logits, top, xf, self.weight.contiguous())
        exact = torch.einsum("tkh,th->tk", self.weight[top].float(), xf)
        return logits.scatter_(1, top, exact)


def _topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest logits (which k of equal values: either; only refined ones change).
    On the CPU one pass of kernels/cpu/logits.py (0.3 ms against 1.9-2.9 ms for torch.topk at 64 rows)."""
    if logits.device.type == "cpu" and logits.stride(-1) == 1 and k <= cpu_logits.MAX_K and cpu_logits.available():
        return cpu_logits.row_topk(logits, k)
    return logits.topk(k, dim=-1).indices


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


def quantize_model(model: Any, mode: str, gguf_q4_weights: dict[str, tuple[torch.Tensor, ...]] | None = None) -> None:
    """Replaces the model's projections (and lm_head) with quantized layers, in place. `gguf_q4_weights`:
    our parameter name -> the exact 4-bit form of that weight (fused projections already concatenated)."""
    assert mode in ("int8", "int4")
    exact = gguf_q4_weights or {}
    for i, layer in enumerate(model.layers):
        for owner, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            lin: nn.Linear = getattr(owner, attr)
            w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            name = f"layers.{i}.{'self_attn' if owner is layer.self_attn else 'mlp'}.{attr}.weight"
            if mode == "int8" or not int4_fits(w):
                setattr(owner, attr, Int8Linear(w, b))
            elif name in exact:
                q, scale, zero = exact[name]
                setattr(owner, attr, Int4Linear(q, scale, zero, b))
            else:
                setattr(owner, attr, Int4Linear.from_float(w, b))
    model.lm_head = QuantLogits(model.lm_head.weight.detach(), mode)


__all__ = ["QUANTIZATIONS", "Int4Linear", "Int8ActHead", "Int8Linear", "QuantLogits", "gguf_q4", "quantize_model"]
