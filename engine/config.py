"""EngineConfig: every engine knob in one validated dataclass, passed explicitly."""
from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16", "float16")
_BACKENDS = ("torch", "triton")


@dataclass
class EngineConfig:
    model: str | None = None            # checkpoint directory or hub id; None = built-in demo model
    block_size: int = 16
    num_kv_blocks: int | None = None    # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0     # budget used when num_kv_blocks is None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None    # None: from the checkpoint's max_position_embeddings
    max_num_waiting: int = 1024         # admission queue cap (service answers 429 beyond it)
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str | None = None  # None: triton on CUDA, torch elsewhere
    enable_prefix_caching: bool = True
    pinned_fraction: float = 0.5        # cap on pinned blocks, as a share of all blocks
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.max_num_waiting < 1:
            raise ValueError("max_num_waiting must be >= 1")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        if not 0.0 <= self.pinned_fraction <= 1.0:
            raise ValueError("pinned_fraction must be within [0, 1]")
