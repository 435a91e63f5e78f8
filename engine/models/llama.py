"""Llama-family decoder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) over a paged KV cache.

Covers GQA, QKV bias (Qwen2), tied embeddings, any head_dim, and RoPE scaling types default, linear
and llama3. The batch is flattened: every tensor's leading dimension is the step's token count, and
attention reaches the past through the KV cache's block tables (kernels.AttentionMetadata).
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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# attend(q [T, H, D] rotated, k [T, Hkv, D] rotated, v [T, Hkv, D]) -> [T, H, D]: stores this step's K/V in
# the layer's cache, then attends over the cache (eager: the backend; compiled decode: one custom op).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def project(layer: nn.Module, x: torch.Tensor, wide: bool) -> torch.Tensor:
    """One projection. Quantized layers (engine/models/quant.py) also take `wide`: the step carries a prefill
    chunk, so they use their bfloat16 GEMM whatever the row count.

    NOTE: why per step and not per row count alone: a prompt's tokens must go through the same kernel
    whether they are computed in one prefill or in two (a registered prefix, then the request's own
    tokens), or a named prefix would not give the inline request's answer."""
    return layer(x, wide) if getattr(layer, "takes_wide", False) else layer(x)


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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                wide: bool = False) -> torch.Tensor:
        # x: [T, hidden]
        t = x.shape[0]
        q, k, v = project(self.qkv_proj, x, wide).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v)                                                  # [T, H, D]
        return project(self.o_proj, out.reshape(t, self.q_size), wide)


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

    def forward(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x, wide).split([self.inter, self.inter], dim=-1)
        return project(self.down_proj, nn.functional.silu(gate) * up, wide)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                wide: bool = False) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, wide)
        return x + self.mlp(self.post_attention_layernorm(x), wide)


class LlamaForCausalLM(nn.Module):
    """One class for the three architectures: they differ only in config (bias, tying, window)."""

    def __init__(self, args: ModelArgs) -> None:
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
        self.fast = False                           # the quantized CPU path (enable_fast_path)

    def enable_fast_path(self) -> bool:
        """The quantized CPU path: every projection takes and gives bfloat16 (forward_bf16) and a layer's
        elementwise work runs fused in C++ (kernels/cpu/fused.cpp); True if it could be turned on."""
        from kernels.cpu.build import available
        layers: list[Any] = list(self.layers)
        projections = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.fast = (all(hasattr(m, "forward_bf16") for m in projections) and self.embed_tokens.weight.dtype ==
                     torch.float32 and self.embed_tokens.weight.device.type == "cpu" and available("fused"))
        return self.fast

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, key_caches: torch.Tensor,
                value_caches: torch.Tensor, md: AttentionMetadata, backend: AttentionOps) -> torch.Tensor:
        # input_ids, positions: [T]; key_caches: [num_layers, num_blocks, block_size, Hkv, D] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        wide = not md.is_decode_only                     # a prefill chunk: quantized layers take their GEMM
        if self.fast:
            return self._forward_fast(x, cos, sin, key_caches, value_caches, md, backend, wide)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, partial(backend_attend, backend, md, key_caches[i], value_caches[i], self.scale),
                      wide)
        return self.norm(x)

    def _forward_fast(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_caches: torch.Tensor,
                      value_caches: torch.Tensor, md: AttentionMetadata, backend: AttentionOps,
                      wide: bool) -> torch.Tensor:
        """The same model with bfloat16 between the quantized matmuls and the elementwise work fused (one C++
        pass a row per step of the layer): x, the residual stream, stays float32 and is updated in place.

            h = rms_norm(x)                               bf16, the matmul input
            q, k, v = qkv_rope(qkv_proj(h))               float32, rotated
            x += o_proj(attend(q, k, v)); h = rms_norm(x) one pass
            x += down(silu_mul(gate_up(h))); h = next layer's rms_norm(x)
        """
        from kernels.cpu import fused

        args = self.args
        t = x.shape[0]
        layers: list[Any] = list(self.layers)            # their projections are quantized modules by now
        h = fused.rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj.forward_bf16(h, wide)
            q, k, v = fused.qkv_rope(qkv, cos, sin, args.num_heads, args.num_kv_heads, args.head_dim)
            o = backend.attend(q, k, v, key_caches[i], value_caches[i], md, self.scale)       # [T, H, D] f32
            a = attn.o_proj.forward_bf16(o.reshape(t, attn.q_size).to(torch.bfloat16), wide)
            h = fused.add_rms_norm(x, a, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            d = mlp.down_proj.forward_bf16(fused.silu_mul(mlp.gate_up_proj.forward_bf16(h, wide)), wide)
            if i + 1 < len(layers):
                nxt = layers[i + 1].input_layernorm
                h = fused.add_rms_norm(x, d, nxt.weight, nxt.eps)
            else:
                x += d.float()
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
