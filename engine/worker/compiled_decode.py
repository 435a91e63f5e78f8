"""The compiled decode step (`--compile-decode`): a decode-only batch runs its decoder layers through one
`torch.compile`d graph per batch bucket, compiled at startup; prefill, mixed batches, batches over the
largest bucket, and any failure of the compiled path run the eager model.

    decode batch of n ──pad to bucket B──► embed, RoPE (eager) ──► 30 x compiled layer [B] ──► norm ──► [:n]
                                                                        │
                                  prefixserve::decode_attention (one custom op per layer, opaque to the
                                  compiler: the backend's write_kv + attention over the first n rows)

Design, measured on SmolLM2-135M, int4, 2-core CPU (benchmarks/README.md, "decode"):
- one graph per *layer*, not per model: every layer has the same shapes, so with torch's default of
  lifting module parameters to graph inputs the 30 layers share one compiled graph per bucket. A bucket
  compiles in a few seconds instead of the 40-50 s of a 30-layer graph, and ran as fast (one whole-model
  graph measured within noise of the per-layer one, its start ten times longer).
- static shapes per bucket (1, 2, 4, 8, 16, 32, capped by max_num_seqs), the batch padded up; dynamic
  shapes specialize 1 anyway and recompile on the context length.
- the op layer (kernels/ops.py) runs its torch implementations in the whole engine when the decode step is
  compiled (`KernelConfig.traced`): a ctypes call cannot be traced, and prefill must compute what decode does.
- attention stays outside the graph: written inside it, the KV write is a mutation of a graph input,
  which inductor turned into a copy of the whole cache per layer (2.2 s per step, measured); the custom
  op reads the cache it is given and the step's metadata from a thread-local context (vLLM does the
  same with its forward context).

NOTE: the op's schema says it mutates nothing, while it writes this step's K/V rows into the cache it
is passed. Nothing else in a layer's graph reads or writes the cache, so no reordering can observe the
difference; declaring the mutation makes the compiler functionalize the cache (the copy above).
"""
from __future__ import annotations

import logging
import threading
import time

import torch
from torch import nn

from engine.models.llama import LlamaForCausalLM, Step
from kernels import Attention, AttentionMetadata

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 32)
_step = threading.local()       # .md, .backend of the step being run (one engine step at a time per thread)


@torch.library.custom_op("prefixserve::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows past the step's sequences are padding: their K/V are not stored and their output is zero."""
    md: AttentionMetadata = _step.md
    backend: Attention = _step.backend
    n = md.num_seqs
    out = q.new_zeros(q.shape)
    if n:
        backend.write_kv(key_cache, value_cache, k[:n], v[:n], md)
        out[:n] = backend.forward(q[:n].contiguous(), key_cache, value_cache, md, scale)
    return out


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
      scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def _layer(layer: nn.Module, x: torch.Tensor, r: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float, step: Step) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    return layer(x, r, cos, sin, lambda q, k, v: torch.ops.prefixserve.decode_attention(q, k, v, key_cache,
                                                                                        value_cache, scale), step)


class CompiledDecode:
    def __init__(self, model: LlamaForCausalLM, max_num_seqs: int) -> None:
        self.model = model
        self.buckets = [b for b in BUCKETS if b <= max_num_seqs] or [1]
        # NOTE: every bucket of every model in the process is one more compiled entry of _layer's code
        # (tests start several engines); the default limit (8) would turn the later ones into errors.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
        self._layer = torch.compile(_layer, fullgraph=True, dynamic=False)
        self.failed: str | None = None            # why the compiled path was given up (then: eager only)
        self.steps = 0                            # decode steps run compiled

    def fits(self, md: AttentionMetadata) -> bool:
        return self.failed is None and md.is_decode_only and md.num_seqs <= self.buckets[-1]

    @torch.inference_mode()
    def warm_up(self, key_caches: torch.Tensor, value_caches: torch.Tensor,
                backend: Attention) -> float:
        """Compiles every bucket (no sequence: nothing is written); returns the seconds it took."""
        t = time.perf_counter()
        dev = key_caches[0].device
        empty = AttentionMetadata(
            kv_rows=torch.zeros(0, dtype=torch.long, device=dev),
            block_tables=torch.zeros((0, 0), dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
            seq_lens_list=[], query_lens_list=[], max_query_len=1, max_seq_len=0)
        for b in self.buckets:
            zeros = torch.zeros(b, dtype=torch.long, device=dev)
            self._run(zeros, zeros, key_caches, value_caches, empty, backend)
        return time.perf_counter() - t

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, key_caches: torch.Tensor,
                 value_caches: torch.Tensor, md: AttentionMetadata, backend: Attention) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only batch of n <= the largest bucket."""
        n = input_ids.shape[0]
        b = next(x for x in self.buckets if x >= n)
        if b != n:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(b - n)])
            positions = torch.cat([positions, positions.new_zeros(b - n)])
        hidden = self._run(input_ids, positions, key_caches, value_caches, md, backend)
        self.steps += 1
        return hidden[:n]

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, key_caches: torch.Tensor,
             value_caches: torch.Tensor, md: AttentionMetadata, backend: Attention) -> torch.Tensor:
        model = self.model
        _step.md, _step.backend = md, backend
        try:
            x = model.embed_tokens(input_ids)
            cos, sin = model.rotary(positions, x.dtype)
            step = model.step(md, input_ids.shape[0])
            # the first layer adds a zero output (x + 0 is x, bit for bit): every layer is one graph
            r = x.new_zeros(x.shape, dtype=step.act if model.mixed else model.act_dtype)
            for i, layer in enumerate(model.layers):          # key_caches: [num_layers, ...]
                r, x = self._layer(layer, x, r, cos, sin, key_caches[i], value_caches[i], model.scale, step)
            return model.ops.final_norm(x, r, model.norm.weight, model.norm.eps)
        finally:
            _step.md = _step.backend = None
