"""Llama-family decoder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) over a paged KV cache.

Covers GQA, QKV bias (Qwen2), tied embeddings, any head_dim, and RoPE scaling types default, linear
and llama3. The batch is flattened: every tensor's leading dimension is the step's token count, and
attention reaches the past through the KV cache's block tables (kernels.AttentionMetadata).

One forward for every model and every device: the layers call the op layer (kernels/ops.py), which decides
which kernels run. A layer takes the residual stream x and the previous layer's output r, and starts with
their sum and its norm in one op (vLLM's fused residual form):

    x, h = add_rms_norm(x, r)            (the first layer: h = rms_norm(x))
    q, k, v = qkv_rope(qkv_proj(h))
    x, h = add_rms_norm(x, o_proj(attend(q, k, v)))
    r = down_proj(silu_mul(gate_up_proj(h)))         -> (r, x) to the next layer; the model ends with norm(x + r)

A quantized model runs it in mixed precision (`mixed`: bfloat16 between the matmuls, or float32 in a step
whose GEMMs are float32 (`Step.act`, kernels/ops.py step_act), a float32 residual stream); otherwise every op is
in the model's dtype, as transformers computes it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from kernels import Attention as AttentionOps
from kernels import AttentionMetadata
from kernels.cpu.layers import BoundModel, LayerHalves
from kernels.ops import Ops, default_ops

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# attend(q [T, H, D] rotated, k [T, Hkv, D] rotated, v [T, Hkv, D]) -> [T, H, D]: stores this step's K/V in
# the layer's cache, then attends over the cache (eager: the backend; compiled decode: one custom op).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Step:
    """What every layer of one step shares besides the tensors."""

    ops: Ops
    prefill: bool             # the step computes prompt tokens (quantized layers take their GEMM path by it)
    mixed: bool               # bfloat16 between the matmuls, a float32 residual stream (quantized models)
    act: torch.dtype = torch.bfloat16   # mixed: the dtype between the matmuls this step (Ops.step_act)


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    @property
    def context_weight(self) -> float:
        """A context token's attention work for one new token against that token's projections' (multiply-adds:
        scores and values, 2 x heads x head_dim a layer, against the q/k/v/o and MLP weights): 1 / 3,072 for
        SmolLM2-135M, so at 3,072 tokens of context a prompt token costs twice its projections."""
        q, kv, h, i = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size, \
            self.intermediate_size
        return 2 * q / (h * (q + 2 * kv) + q * h + 3 * h * i)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {
            "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        }.get(cfg.get("model_type", ""), cfg.get("model_type", "?"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        # transformers >= 5 nests theta and scaling in rope_parameters; older configs keep them apart.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        rope["rope_type"] = rope_type
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=window,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = args.rope_scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(args.rope_scaling["factor"])
    elif kind == "llama3":
        factor = float(args.rope_scaling["factor"])
        low = float(args.rope_scaling["low_freq_factor"])
        high = float(args.rope_scaling["high_freq_factor"])
        old_len = float(args.rope_scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RMSNorm(nn.Module):
    """The weight and eps of a norm; the op layer computes it (`Ops.rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Rotary(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.scale = args.head_dim ** -0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                step: Step) -> torch.Tensor:
        # h: [T, hidden] normed -> [T, hidden] in h's dtype
        t, ops = h.shape[0], step.ops
        qkv = ops.linear(self.qkv_proj, h, step.prefill)
        q, k, v = ops.qkv_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, step.mixed)
        out = attend(q, k, v)                                                  # [T, H, D], q's dtype
        return ops.linear(self.o_proj, out.reshape(t, self.q_size).to(h.dtype), step.prefill)


def backend_attend(backend: AttentionOps, md: AttentionMetadata, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The eager Attend: the backend writes this step's K/V, then attends (one fused call where it can)."""
    return backend.attend(q.contiguous(), k, v, key_cache, value_cache, md, scale)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        ops = step.ops
        return ops.linear(self.down_proj, ops.silu_mul(ops.linear(self.gate_up_proj, h, step.prefill), step.mixed),
                          step.prefill)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, r: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, hidden]; r: the previous layer's output to add to it (None: the first
        layer) -> (this layer's output, the residual stream). Mixed: x float32 may be updated in place."""
        ops, n_in, n_post = step.ops, self.input_layernorm, self.post_attention_layernorm
        if r is None:
            h = ops.rms_norm(x, n_in.weight, n_in.eps, step.mixed, step.act)
        else:
            x, h = ops.add_rms_norm(x, r, n_in.weight, n_in.eps, step.mixed)
        a = self.self_attn(h, cos, sin, attend, step)
        x, h = ops.add_rms_norm(x, a, n_post.weight, n_post.eps, step.mixed)
        return self.mlp(h, step), x


class LlamaForCausalLM(nn.Module):
    """One class for the three architectures: they differ only in config (bias, tying, window)."""

    def __init__(self, args: ModelArgs, ops: Ops | None = None) -> None:
        super().__init__()
        self.args = args
        self.scale = args.head_dim ** -0.5          # attention's softmax scale, every layer's
        # NOTE: weights are loaded after construction; an explicit (empty) weight skips the random init,
        # which for a large vocabulary takes seconds even on the meta device.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = Rotary(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # the op layer: the loader passes the engine's (a CUDA engine's loads no C++ CPU kernels); default_ops() for a
        # model made on its own (tests, tools)
        self.ops: Ops = ops if ops is not None else default_ops()
        self.mixed = False                          # quantized: bfloat16 between the matmuls (the loader sets it)
        # the layers as each kind of C++ halves takes them (bound at its first wide step; False: they do not fit)
        self._halves_layers: dict[str, BoundModel | bool] = {}

    def set_ops(self, ops: Ops) -> None:
        """The op layer this model (and its quantized modules, which hold one for their own forward) runs on."""
        self.ops = ops
        self._halves_layers = {}                    # bound again, by these ops' kernels, at the next wide step
        for module in self.modules():
            holder: Any = module
            if holder is not self and hasattr(holder, "ops"):
                holder.ops = ops

    @property
    def act_dtype(self) -> torch.dtype:
        """What the matmuls take and give: bfloat16 when mixed, else the model's dtype."""
        return torch.bfloat16 if self.mixed else self.embed_tokens.weight.dtype

    def step(self, md: AttentionMetadata, rows: int) -> Step:
        prefill = not md.is_decode_only
        act = self.ops.step_act(rows, prefill) if self.mixed else self.embed_tokens.weight.dtype
        return Step(self.ops, prefill=prefill, mixed=self.mixed, act=act)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, key_caches: torch.Tensor,
                value_caches: torch.Tensor, md: AttentionMetadata, backend: AttentionOps) -> torch.Tensor:
        # input_ids, positions: [T]; key_caches: [num_layers, num_blocks, block_size, Hkv, D] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        step = self.step(md, input_ids.shape[0])
        r: torch.Tensor | None = None
        between = self.ops.between_layers
        halves = self.ops.layer_halves(step.prefill, input_ids.shape[0], step.act) if step.mixed else None
        if halves is not None and halves.gemm not in self._halves_layers:
            self._halves_layers[halves.gemm] = halves.bind(self) or False
        bound = self._halves_layers.get(halves.gemm) if halves is not None else None
        if halves is not None and isinstance(bound, BoundModel) and x.dtype == torch.float32:
            return self._forward_halves(halves, bound, x, cos, sin, key_caches, value_caches, md, backend, between)
        for i, layer in enumerate(self.layers):
            r, x = layer(x, r, cos, sin, partial(backend_attend, backend, md, key_caches[i], value_caches[i],
                                                 self.scale), step)
            if between is not None:
                between()
        return self.ops.final_norm(x, r, self.norm.weight, self.norm.eps)

    def _forward_halves(self, halves: LayerHalves, bound: BoundModel, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, key_caches: torch.Tensor, value_caches: torch.Tensor, md: AttentionMetadata,
                        backend: AttentionOps, between: Callable[[], None] | None) -> torch.Tensor:
        """forward's layers as C++ halves around each attention (kernels/cpu/layers.py), or, on a decode step the
        backend's C++ decode kernel serves, all of them in one call: the same kernels in the same order as
        DecoderLayer.forward's op-by-op path on a wide quantized step, so the same hidden states."""
        a, t = self.args, x.shape[0]
        s = halves.scratch(x.contiguous(), cos.reshape(t, a.head_dim).contiguous(),
                           sin.reshape(t, a.head_dim).contiguous(), a.num_heads, a.num_kv_heads, a.head_dim,
                           a.intermediate_size)
        plan = backend.decode_plan(md, key_caches[0], a.num_heads, a.head_dim)
        if plan is not None:                # a decode step: every layer in one call (its steps are short: the
            if between is not None:         # thread governor looks before it, not between its layers)
                between()
            r_last = halves.decode_layers(s, bound, plan, key_caches, value_caches, self.scale)
            return self.ops.final_norm(s.x, r_last, self.norm.weight, self.norm.eps)
        r: torch.Tensor | None = None
        for i, layer in enumerate(bound.layers):
            q, k, v = halves.pre(s, layer, r)
            out = backend_attend(backend, md, key_caches[i], value_caches[i], self.scale, q, k, v).contiguous()
            r = s.r[i % 2]
            halves.post(s, layer, out, r)
            if between is not None:
                between()
        return self.ops.final_norm(s.x, r, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]: a plain head's linear, or a quantized head's (it calls Ops.logits)."""
        return self.lm_head(hidden).float()
