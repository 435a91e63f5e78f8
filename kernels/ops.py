"""The op layer: the engine's one door to compute. Which implementation runs each op is decided here, once, when
`Ops` is made, from the device, the CPU's instruction set and the configuration; the engine calls the ops and
never asks which device it is on or whether a kernel is available.

    op                      implementations (the first that applies)
    rms_norm, add_rms_norm  C++ (kernels/cpu/fused.cpp) for the mixed-precision path; torch
    qkv_rope, silu_mul      C++ for the mixed-precision path; torch
    linear                  quantized weights: torch's int4 / int8 kernel (or, where wide steps are float32
                            GEMMs, C++ int4 GEMM kernels/cpu/int4_gemm.cpp) or the dense GEMM (oneDNN), by
                            the step's shape; plain weights: torch's linear
    logits                  a quantized head: coarse logits, then the top ones exact (C++ top-k and refine, or
                            torch); a plain head: torch's linear
    row_stats, topk,        C++ (kernels/cpu/logits.cpp); torch (sample_softmax: None, the sampler's torch path)
    sample_softmax
    attention               the KV backend's kernels, by family: "cpu" (C++ paged decode and paged prefill, torch's
                            flash attention without the C++ kernels), "torch", "triton" (kernels/cpu_backend.py,
                            torch_backend.py, triton_backend.py); `attention_family` picks the default

Two precisions. `mixed=False` is the reference: every op in the model's dtype, as transformers computes it (the
parity tests hold the float32 model to transformers token for token). `mixed=True` is the quantized model's:
bfloat16 between the matmuls, a float32 residual stream, float32 math inside each op, one rounding at its end;
the C++ kernels implement it and the torch fallbacks compute the same formula. Where a step's quantized layers
take a float32 dense GEMM (no native bfloat16 on the CPU: AVX2, AVX-512 without BF16), its activations between
the matmuls are float32 instead (`step_act`): no rounding, and no bfloat16 round trip around every GEMM (a 64-row
decode step 222 -> 197 ms on a Zen 3).

Batch invariance (`KernelConfig.batch_invariant`): every choice that depends on the step's shape is fixed: the
quantized layers and head take one kernel for every row count and every step (the int4 / int8 kernel: each
output row a function of its input row only), the decode kernel cuts every sequence into splits of a fixed
number of blocks and never cascades. What holds then, and what does not by default: README, "Batch invariance".
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kernels import quant_gemm as qg
from kernels.cpu.build import variants
from kernels.cpu.int4_gemm import Q8Head, fits
from kernels.cpu.layers import LayerHalves
from kernels.cpu.library import CpuKernels, KernelUnavailable, cpu_flags
from kernels.cpu.library import load as load_cpu_kernels
from kernels.cpu.logits import MAX_K
from kernels.cpu.paged_prefill import I16_PATHS
from kernels.cpu_backend import INVARIANT_SPLIT_TOKENS

BF16_HEAD_REFINE = 16            # a bfloat16 head's rows are off by bfloat16 rounding only: its top 16


@dataclass(frozen=True)
class KernelConfig:
    """What the op layer is told; everything else it finds out."""

    device: str = "cpu"
    cpu_kernels: str = "auto"     # the C++ build to run: auto (the best the CPU has), none, or a variant's name
    batch_invariant: bool = False
    traced: bool = False          # the decode step's layers run in a torch.compile graph: elementwise ops in torch
    # with AMX: the decode rows from which GGUF 4-bit layers take oneDNN's GEMM, not gemm_bf16 (Ops.bf16_gemm_step)
    amx_dense_from_rows: int = qg.AMX_DENSE_FROM_ROWS
    # on an AVX-512 CPU with VNNI and no BF16: GGUF 4-bit layers' prompt chunks and wide decode steps take gemm_q16
    # (Ops.own_wide_step); False: the float32 GEMMs (oneDNN's, gemm_wide)
    int16_activations: bool = True


@dataclass
class KernelReport:
    """Which implementation runs each op, for the start log, /get_server_info and /metrics."""

    device: str
    cpu_variant: str | None                 # the C++ build running (None: none, see cpu_reason)
    cpu_reason: str                         # why that one, or why none
    ops: dict[str, str] = field(default_factory=dict)      # op -> implementation
    batch_invariant: bool = False

    def lines(self) -> list[str]:
        """The start log: the C++ build and why, then one line an op."""
        head = (f"C++ CPU kernels {self.cpu_variant} ({self.cpu_reason})" if self.cpu_variant is not None else
                f"no C++ CPU kernels: {self.cpu_reason}")
        if self.batch_invariant:
            head += "; batch-invariant mode"
        return [head] + [f"{op}: {impl}" for op, impl in self.ops.items()]

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "cpu_variant": self.cpu_variant, "cpu_reason": self.cpu_reason,
                "ops": dict(self.ops), "batch_invariant": self.batch_invariant}


class Ops:
    """Made once per engine; every call routes to the implementation chosen here."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        # called by the model after each layer of an eager forward (the engine's thread governor: a long step
        # may change its thread count between layers); None: nothing
        self.between_layers: Callable[[], None] | None = None
        self.device = torch.device(config.device)
        self.cpu: CpuKernels | None = None
        on_cpu = self.device.type == "cpu"
        if not on_cpu:
            reason = f"not used on {self.device.type}"
        elif config.cpu_kernels == "none":
            reason = "turned off (cpu_kernels none)"
        else:
            try:
                self.cpu = load_cpu_kernels(config.cpu_kernels)
                reason = _why(self.cpu.variant, config.cpu_kernels == "auto")
            except KernelUnavailable as exc:
                if config.cpu_kernels != "auto":
                    raise        # a variant forced by name that cannot run here: refuse to start, never SIGILL
                reason = str(exc)
        self._fused = None if self.cpu is None or config.traced else self.cpu.fused
        self._logits = None if self.cpu is None else self.cpu.logits
        # the narrow steps' int4 GEMM (kernels/cpu/int4_gemm.py), where wide steps are float32 GEMMs: not inside a
        # traced graph (a ctypes call), not in the batch-invariant mode (its int4 kernel is torch's, tested so)
        self._int4 = None if self.cpu is None or config.traced or config.batch_invariant or \
            qg.DENSE_DTYPE != torch.float32 else self.cpu.int4
        # its wide kernel has AVX-512 loops: it takes decode steps from WIDE512_FROM_ROWS rows and torch's int4 kernel
        # the narrower ones (kernels/quant_gemm.py)
        self._wide512 = self._int4 is not None and self._int4.wide_path == "avx512"
        # ... and with AVX-512 VNNI, its int4 x int16 GEMM (gemm_q16: twice a float32 FMA's products an instruction)
        # takes such a layer's prompt chunks and wide decode steps (kernels/quant_gemm.py Q16_FROM_ROWS)
        self._q16 = self._wide512 and self._int4 is not None and self._int4.has_q16 and config.int16_activations
        # the int4 x bfloat16 GEMM (kernels/cpu/int4_gemm.py gemm_bf16), where the dense GEMM is oneDNN's bfloat16
        # one and the build has AVX-512 BF16: not traced, not batch-invariant (as above)
        self._int4_bf16 = None if self.cpu is None or config.traced or config.batch_invariant or \
            qg.DENSE_DTYPE != torch.bfloat16 or not self.cpu.int4.has_bf16 else self.cpu.int4
        # on a CPU with AMX, oneDNN's bfloat16 GEMM runs on the tile units: it keeps the prompt chunks and the decode
        # steps from this many rows, and gemm_bf16 serves the narrower decode steps only (--amx-dense-from-rows)
        self._amx_dense_from: int | None = config.amx_dense_from_rows \
            if self._int4_bf16 is not None and "amx_bf16" in cpu_flags() else None
        self.quantized_gemms = on_cpu            # torch's int4 / int8 kernels are CPU kernels
        ops: dict[str, str] = {}
        variant = f"c++ {self.cpu.variant}" if self.cpu is not None else "torch"
        if self.cpu is not None:
            ops["elementwise (mixed precision)"] = (
                "torch (inside the compiled decode graph)" if config.traced else f"c++ {self.cpu.variant} "
                f"({self.cpu.paths['fused']})")
            ops["logits reductions"] = f"c++ {self.cpu.variant} ({self.cpu.paths['logits']})"
            ops["paged decode"] = f"c++ {self.cpu.variant} ({self.cpu.paths['paged_decode']})"
            ops["paged prefill"] = _prefill_impl(self.cpu)
            if config.batch_invariant:
                ops["paged decode"] += f", {INVARIANT_SPLIT_TOKENS}-token splits, no cascade"
                ops["paged prefill"] = "the paged decode kernel, a row at a time (batch-invariant)"
        else:
            ops["elementwise (mixed precision)"] = ops["logits reductions"] = variant
            ops["paged decode"] = "triton" if self.device.type == "cuda" else "torch"
        if on_cpu:
            wide_int4 = ("" if self._int4_bf16 is None else
                         f"c++ int4 x bf16 gemm from {self.wide_rows} decode rows (GGUF int4 layers); other layers: "
                         if self._amx_dense_from is None else
                         f"c++ int4 x bf16 gemm for decode steps below {self._amx_dense_from} rows, bfloat16 "
                         "(oneDNN, AMX) for prompt chunks and wider steps (GGUF int4 layers); other layers: ")
            decode_steps = "every decode step" if self.own_wide_from <= 1 else \
                f"decode steps from {self.own_wide_from} rows"
            own_int4 = ("" if self._int4 is None else
                        f"c++ int4 x int16 gemm_q16 (avx512 vnni) for prompt chunks and {decode_steps} "
                        "(GGUF int4 layers); " if self._q16 else
                        f"c++ int4 gemm_wide ({self._int4.wide_path}) from {self.own_wide_from} decode rows (GGUF int4 "
                        "layers); " + ("c++ int4 gemm (int4 layers) or " if self.narrow_int4 else ""))
            ops["quantized gemm"] = ("int4 / int8 kernel at every row count (batch-invariant)"
                                     if config.batch_invariant else
                                     f"{wide_int4}{own_int4}"
                                     f"int4 / int8 kernel below {qg.DENSE_FROM_ROWS} decode rows, else "
                                     f"{str(qg.DENSE_DTYPE).removeprefix('torch.')} "
                                     f"({'oneDNN' if qg.ONEDNN else 'torch linear'})")
            if not config.batch_invariant:
                if qg.ONEDNN and qg.VNNI & cpu_flags():
                    head = f"int8 x int8 (oneDNN), top {qg.Int8ActHead.refine} exact"
                elif self._int4 is not None:
                    head = f"c++ int4 x int8 gemm ({self._int4.path}), top {Q8Head.refine} exact"
                else:
                    head = f"{str(qg.DENSE_DTYPE).removeprefix('torch.')} GEMM, top {BF16_HEAD_REFINE} exact"
                ops[f"output layer, from {self.head_wide_rows} rows"] = head
            if self._int4_bf16 is not None and self._fused is not None and self.cpu is not None:
                steps = ("wide steps" if self._amx_dense_from is None else
                         f"decode steps below {self._amx_dense_from} rows")
                ops[f"decoder layers, {steps}"] = (f"c++ {self.cpu.variant} halves around the attention "
                                                   "(GGUF int4 layers: kernels/cpu/layers.py)")
            elif self._int4 is not None and self._fused is not None and self.cpu is not None:
                steps = ("prompt chunks and " if self._q16 else "") + decode_steps
                ops[f"decoder layers, {steps}"] = (f"c++ {self.cpu.variant} float32 halves around the attention "
                                                   "(GGUF int4 layers: kernels/cpu/layers.py)")
        self.report = KernelReport(str(self.device), self.cpu.variant if self.cpu is not None else None, reason, ops,
                                   config.batch_invariant)

    # -- choices the engine asks for by what it wants, never by device ------------------------------------------
    def attention_family(self, kv_cache_dtype: torch.dtype) -> str:
        """The default attention kernels: triton on CUDA; on the CPU, cpu (C++) for a bfloat16 cache or in the
        batch-invariant mode, torch for float32 (the exact path: the parity tests)."""
        if self.device.type == "cuda":
            return "triton"
        return "cpu" if kv_cache_dtype == torch.bfloat16 or self.config.batch_invariant else "torch"

    def default_kv_cache_dtype(self, dtype: str, quantized: bool) -> str:
        """bfloat16 when the weights are quantized (already approximate): half the bytes every decode step reads;
        float32 caches stay for the exact path."""
        return "bfloat16" if quantized and self.quantized_gemms else dtype

    # -- elementwise ------------------------------------------------------------------------------------------------
    @property
    def wide_int4_bf16(self) -> bool:
        """Whether a GGUF int4 layer's steps run the C++ int4 x bfloat16 GEMM (its weights packed by
        engine/models/quant.py for it): its wide steps (prompt chunks, decode steps of `wide_rows` rows or more), or
        on a CPU with AMX its narrow decode steps (`bf16_gemm_step`)."""
        return self._int4_bf16 is not None

    @property
    def int4_bf16_keeps_dense(self) -> bool:
        """Whether a GGUF int4 layer that gemm_bf16 serves keeps its dense copy too: on a CPU with AMX, whose
        prompt chunks and wide decode steps read it (oneDNN's GEMM on the tile units)."""
        return self._amx_dense_from is not None

    def bf16_gemm_step(self, prefill: bool, rows: int) -> bool:
        """Whether a step's GGUF int4 projections take gemm_bf16: every step from `wide_rows` rows, prompt chunks
        included (AVX-512 BF16 without AMX: it beats oneDNN's GEMM there at every width, engine/models/quant.py);
        on a CPU with AMX, the decode steps below `KernelConfig.amx_dense_from_rows` rows only (--amx-dense-from-rows,
        default AMX_DENSE_FROM_ROWS: there the alternative was torch's int4 kernel op by op, no tile units either:
        kernels/quant_gemm.py)."""
        if self._int4_bf16 is None:
            return False
        if self._amx_dense_from is not None:
            return not prefill and rows < self._amx_dense_from
        return prefill or rows >= self.wide_rows

    @property
    def wide_rows(self) -> int:
        """The decode rows from which a step's layers are wide: where gemm_bf16 serves GGUF int4 layers, from
        BF16_GEMM_FROM_ROWS (every step: its layers in one call beat torch's int4 kernel op by op,
        kernels/quant_gemm.py); else DENSE_FROM_ROWS (the dense GEMM's crossover). Prompt chunks are wide at any
        size."""
        return qg.BF16_GEMM_FROM_ROWS if self._int4_bf16 is not None else qg.DENSE_FROM_ROWS

    @property
    def head_wide_rows(self) -> int:
        """The rows from which a quantized head takes its wide product (the int8 x int8 one): INT8_HEAD_FROM_ROWS
        where gemm_bf16 serves the layers, INT8_HEAD_Q16_FROM_ROWS where gemm_q16 does (each its crossover with the
        int4 rows, measured there: kernels/quant_gemm.py); else DENSE_FROM_ROWS."""
        if self._int4_bf16 is not None:
            return qg.INT8_HEAD_FROM_ROWS
        return qg.INT8_HEAD_Q16_FROM_ROWS if self._q16 else qg.DENSE_FROM_ROWS

    @property
    def narrow_int4(self) -> bool:
        """Whether narrow steps' int4 layers run the C++ int4 GEMM (float32 activations) instead of torch's kernel:
        where wide steps are float32 GEMMs, but not where gemm_wide has AVX-512 loops (torch's int4 kernel is the
        faster there below WIDE512_FROM_ROWS rows: kernels/quant_gemm.py)."""
        return self._int4 is not None and not self._wide512

    @property
    def own_wide_from(self) -> int:
        """The decode rows from which a GGUF int4 layer takes gemm_wide, where wide steps are float32 GEMMs:
        WIDE512_FROM_ROWS with its AVX-512 loops (Q16_FROM_ROWS where gemm_q16 takes them), else DENSE_FROM_ROWS (its
        crossover with the row-blocked gemm and the dense GEMM on an AVX2 CPU)."""
        if self._q16:
            return qg.Q16_FROM_ROWS
        return qg.WIDE512_FROM_ROWS if self._wide512 else qg.DENSE_FROM_ROWS

    def own_wide_step(self, prefill: bool, rows: int) -> bool:
        """Whether a step's GGUF int4 projections take gemm_wide (float32 activations): decode steps from
        `own_wide_from` rows, where wide steps are float32 GEMMs; with gemm_q16 (`wide_int4_q16`), prompt chunks
        too, at any size (a prompt's tokens through the same kernel however they are chunked)."""
        if self._int4 is None:
            return False
        return (prefill and self._q16) or (not prefill and rows >= self.own_wide_from)

    @property
    def wide_int4_q16(self) -> bool:
        """Whether a GGUF int4 layer's prompt chunks and wide decode steps run gemm_q16 (an AVX-512 CPU with VNNI and
        no BF16; --int16-activations): its dense copy is then never read, and not kept (engine/models/quant.py)."""
        return self._q16

    def layer_halves(self, prefill: bool, rows: int, act: torch.dtype) -> LayerHalves | None:
        """The C++ halves of a decoder layer (kernels/cpu/layers.py) for a step, where its projections take one GEMM
        the halves call and the fused kernels run: gemm_bf16 (`bf16_gemm_step`, bfloat16 between the matmuls), or
        gemm_q16 / gemm_wide (`own_wide_step`, float32 between them: the GEMM `linear` picks); None: op by op.
        Whether the model's layers fit is the model's to ask (`LayerHalves.bind`)."""
        if self._fused is None or self.cpu is None:
            return None
        if act == torch.bfloat16:
            return self.cpu.layers if self.bf16_gemm_step(prefill, rows) else None
        if act == torch.float32 and self._int4 is not None and self.own_wide_step(prefill, rows):
            return self.cpu.layers_f32.get("q16" if self._q16 else "wide")
        return None

    def step_act(self, rows: int, prefill: bool) -> torch.dtype:
        """The activations between a mixed step's matmuls: float32 where its quantized layers take the dense GEMM
        and that GEMM is float32 (no oneDNN bfloat16 here: kernels/quant_gemm.py DENSE_DTYPE), so no bfloat16
        round trip costs passes over memory around every GEMM; bfloat16 otherwise (the int4 / int8 kernels
        take bfloat16; the C++ int4 GEMMs, where they serve the step, float32)."""
        if self.narrow_int4 or self.own_wide_step(prefill, rows):
            return torch.float32
        if qg.DENSE_DTYPE == torch.float32 and not self.config.batch_invariant and \
                (prefill or rows >= qg.DENSE_FROM_ROWS):
            return torch.float32
        return qg.ACT

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, mixed: bool,
                 act: torch.dtype = qg.ACT) -> torch.Tensor:
        """x [T, H] -> normalized: mixed, act(w * x * rsqrt(mean(x^2) + eps)) from a float32 x; else in x's
        dtype as transformers' LlamaRMSNorm (w * (x * r).to(dtype))."""
        if not mixed:
            x32 = x.float()
            return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        if self._fused is not None and x.dtype == weight.dtype == torch.float32:
            return self._fused.rms_norm(x, weight, eps, act)
        x32 = x.float()
        return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(act)

    def add_rms_norm(self, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                     mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, rms_norm(x + r)). Mixed: x float32 is updated in place by the C++ kernel (r bfloat16 or
        float32, the norm in r's dtype)."""
        if mixed and self._fused is not None and x.dtype == weight.dtype == torch.float32 and \
                r.dtype in (torch.bfloat16, torch.float32) and not x.requires_grad:
            return x, self._fused.add_rms_norm(x, r, weight, eps)
        x = x + r.to(x.dtype)
        return x, self.rms_norm(x, weight, eps, mixed, r.dtype if mixed else qg.ACT)

    def final_norm(self, x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The model's last norm, into the model's dtype (what the head reads): rms_norm(x + r) as transformers."""
        if r is not None:
            x = x + r.to(x.dtype)
        return self.rms_norm(x, weight, eps, mixed=False)

    def qkv_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a [T, (H + 2 Hkv) D] projection into q [T, H, D], k, v [T, Hkv, D] and rotate q and k by cos, sin
        (NeoX halves). Mixed: a bfloat16 or float32 projection gives float32 q, k, v; else they keep qkv's dtype."""
        t = qkv.shape[0]
        if mixed and self._fused is not None and qkv.dtype in (torch.bfloat16, torch.float32) and \
                cos.dtype == torch.float32:
            return self._fused.qkv_rope(qkv, cos.contiguous(), sin.contiguous(), num_heads, num_kv_heads, head_dim)
        if mixed:
            qkv = qkv.float()
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = _rotate(q.view(t, num_heads, head_dim), cos, sin)
        k = _rotate(k.view(t, num_kv_heads, head_dim), cos, sin)
        return q, k, v.reshape(t, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, mixed: bool) -> torch.Tensor:
        """silu(gate) * up of a [T, 2I] = [gate | up] projection: mixed, float32 math rounded once to gate_up's
        dtype (bfloat16 or float32); else in gate_up's dtype."""
        if mixed and self._fused is not None and gate_up.dtype in (torch.bfloat16, torch.float32):
            return self._fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if mixed:
            return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)
        return F.silu(gate) * up

    # -- GEMMs ------------------------------------------------------------------------------------------------------
    def linear(self, layer: Any, x: torch.Tensor, prefill: bool) -> torch.Tensor:
        """A projection: an nn.Linear, or a quantized layer (engine/models/quant.py: `kind` "int4" with `packed`
        and `scale_zero`, or "int8" with `weight_q` and `scale`; `dense`, the weight as quant_gemm.pack_dense
        made it (bfloat16, or float32 where oneDNN has no bfloat16 GEMM), empty if never read; `bias`), out in x's
        dtype (the step's activations: `step_act`). A quantized layer takes the dense GEMM for a step with a
        prefill chunk or of DENSE_FROM_ROWS rows and more, its int4 / int8 kernel otherwise; where wide steps are
        float32 GEMMs (AVX2), an int4 layer's narrow steps take our row-blocked int4 GEMM (`gemm`) and, where its
        dense weight is its 4-bit values (GGUF Q4), its wide decode steps our panel-decoding one (`gemm_wide`,
        the same weights at 1.2x the dense GEMM's speed); where wide steps are bfloat16 GEMMs (AVX-512 BF16, no
        AMX), such a layer's wide steps, prompt chunks included, take our int4 x bfloat16 GEMM (`gemm_bf16`: the
        dense copy's weights decoded a block at a time, none kept), its decode steps too at every row count
        (BF16_GEMM_FROM_ROWS: with the layers in one C++ call they beat the int4 kernel op by op,
        kernels/quant_gemm.py); on a CPU with AMX, gemm_bf16 takes such a layer's narrow decode steps only and
        oneDNN's GEMM on the tile units the rest (`bf16_gemm_step`); in the batch-invariant mode, torch's
        int4 / int8 kernel always.

        NOTE: why per step and not per row count alone: a prompt's tokens must go through the same kernel
        whether they are computed in one prefill or in two (a registered prefix, then the request's own
        tokens), or a named prefix would not give the inline request's answer."""
        kind = getattr(layer, "kind", None)
        if kind is None:
            return F.linear(x, layer.weight, layer.bias)
        bf16_gemm = self._int4_bf16 if kind == "int4" and layer.w4.numel() else None
        wide = prefill or x.shape[0] >= qg.DENSE_FROM_ROWS
        if bf16_gemm is not None and self.bf16_gemm_step(prefill, x.shape[0]):
            # the dense copy's bfloat16 weights decoded from 4 bits a block at a time (a third of its bytes from
            # memory; kernels/cpu/int4_gemm.py gemm_bf16, measured in engine/models/quant.py)
            y = bf16_gemm.gemm_bf16(x.to(torch.bfloat16).contiguous(), layer.w4, layer.sz4)
            return y.to(x.dtype) if layer.bias is None else (y.float() + layer.bias.float()).to(x.dtype)
        own = self._int4 if kind == "int4" and layer.q8.numel() else None
        if own is not None and layer.dense_is_int4 and self.own_wide_step(prefill, x.shape[0]):
            # a wide decode step: our int4 GEMM that decodes a panel for every row (1.2x oneDNN's float32 GEMM
            # over SmolLM2's projections at 64 rows, weights cold, on an AVX2 Zen 3; its AVX-512 loops from 12
            # rows: kernels/quant_gemm.py WIDE512_FROM_ROWS); with AVX-512 VNNI, the int4 x int16 one, prompt
            # chunks included (kernels/quant_gemm.py Q16_FROM_ROWS)
            return self._own_int4(own.gemm_q16 if self._q16 else own.gemm_wide, layer, x)
        if wide and not self.config.batch_invariant and layer.dense.numel():
            return qg.dense_mm(x, layer.dense, layer.bias)
        if own is not None and self.narrow_int4:
            return self._own_int4(own.gemm, layer, x)
        xa = x.to(qg.ACT)
        y = qg.int4_mm(xa, layer.packed, layer.scale_zero) if kind == "int4" else \
            qg.int8_mm(xa, layer.weight_q, layer.scale)
        y = y if layer.bias is None else y.add_(layer.bias.to(qg.ACT))
        return y.to(x.dtype)

    @staticmethod
    def _own_int4(gemm: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
        y = gemm(x.float().contiguous(), layer.q8, layer.sz8)
        y = y if layer.bias is None else y.add_(layer.bias.float())
        return y.to(x.dtype)

    def logits(self, head: Any, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> float32 [T, vocab]. A quantized head (engine/models/quant.py QuantLogits: `kind` "head",
        `coarse` a quantized layer, `weight` the exact [vocab, hidden] rows, `refine` how many, `wide` the int8 x
        int8 head or None): coarse logits for the whole vocabulary, then each row's top ones recomputed exactly in
        float32 from the float weight."""
        if getattr(head, "kind", None) != "head":
            return F.linear(x, head.weight, head.bias).float()
        xf = x.float().contiguous()
        rows = x.shape[0]
        if self.config.batch_invariant or rows < self.head_wide_rows:
            logits, k = self.linear(head.coarse, x.to(self.step_act(rows, False)), prefill=False).float(), head.refine
        elif head.wide is not None:
            logits, k = head.wide(xf), min(head.refine, head.wide.refine)
        else:
            coarse = self.linear(head.coarse, x.to(self.step_act(rows, True)), prefill=True)
            logits, k = coarse.float(), min(head.refine, BF16_HEAD_REFINE)
        top = self.topk(logits, k)
        if self._logits is not None and head.weight.dtype in (torch.float32, torch.bfloat16):
            return self._logits.refine(logits, top, xf, head.weight.contiguous())
        exact = torch.einsum("tkh,th->tk", head.weight[top].float(), xf)
        return logits.scatter_(1, top, exact)

    def wide_head(self, weight: torch.Tensor) -> qg.Int8ActHead | Q8Head | None:
        """The coarse head of wide steps: oneDNN's int8 x int8 product where it has VNNI; where the dense GEMM is
        float32 (AVX2), the C++ int4 x int8 one (kernels/cpu/int4_gemm.py Q8Head); None otherwise, and in the
        batch-invariant mode (never read there)."""
        if self.config.batch_invariant:
            return None
        head = qg.Int8ActHead.make(weight)
        if head is None and self._int4 is not None and weight.device.type == "cpu" and fits(*weight.shape):
            return Q8Head(self._int4, weight)
        return head

    # -- logits reductions ------------------------------------------------------------------------------------------
    def row_stats(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logsumexp [N], argmax [N] or None): one pass with the C++ kernel (torch.argmax's index exactly, the
        log-normalizer within float32 rounding); torch's logsumexp (and no argmax) otherwise."""
        if self._logits is not None and logits.dim() == 2 and logits.stride(1) == 1 and \
                logits.device.type == "cpu" and logits.dtype == torch.float32:
            return self._logits.row_stats(logits)
        return torch.logsumexp(logits, dim=-1), None

    def sample_softmax(self, logits: torch.Tensor, temperature: torch.Tensor,
                       u: torch.Tensor) -> torch.Tensor | None:
        """[N] tokens, one draw per row from softmax(logits / temperature) by inverse CDF with u [N] float64
        (kernels/cpu/logits.py row_sample, its agreement criterion there); None where the C++ kernel is not
        here (the sampler's torch path serves)."""
        if self._logits is not None and logits.dim() == 2 and logits.stride(1) == 1 and \
                logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[1] < 2**31:
            return self._logits.row_sample(logits, temperature.contiguous(), u.contiguous())
        return None

    def topk(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """The indices of each row's k largest logits, in no particular order (which of equal values: either)."""
        if self._logits is not None and logits.device.type == "cpu" and logits.stride(-1) == 1 and k <= MAX_K:
            return self._logits.row_topk(logits, k)
        return logits.topk(k, dim=-1).indices


def _prefill_impl(cpu: CpuKernels) -> str:
    """The prefill kernel's loops for each cache dtype (kernels/cpu/paged_prefill.py: bf16 or float32 products)."""
    bf16, f32 = cpu.prefill.path(torch.bfloat16), cpu.prefill.path(torch.float32)
    products = "int16" if bf16 in I16_PATHS else "bf16"
    loops = (f"{bf16} {products} products over bf16 caches, {f32} float32 products over float32 caches" if bf16 != f32
             else f"{f32} float32 products")
    return f"c++ {cpu.variant} ({loops}; shared prefixes walked once (cascade))"


def _why(variant: str, auto: bool) -> str:
    """Why this build: forced, or the best this CPU runs and what the next one needs that it lacks."""
    if not auto:
        return "forced by cpu_kernels"
    names = [v.name for v in variants()]
    better = variants()[names.index(variant) + 1:]
    if not better:
        return "the most demanding build, and this CPU has its flags"
    missing = sorted(better[0].requires - cpu_flags())
    if not missing:
        return f"the best build this CPU runs; {better[0].name} was not built (the compiler did not take it)"
    return f"the best build this CPU runs; {better[0].name} needs {', '.join(missing)}, which it lacks"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, 1, D] (NeoX halves), in x's dtype (transformers' formula)."""
    return _rotate(x, cos, sin)




@functools.cache
def default_ops(device: str = "cpu") -> Ops:
    """The op layer with the default configuration: for layers made outside an engine (tests, tools)."""
    return Ops(KernelConfig(device=device))


__all__ = ["KernelConfig", "KernelReport", "Ops", "apply_rotary", "default_ops"]
