"""Tiny random Hugging Face checkpoints (one per architecture) for parity tests, built once per session."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.random_checkpoint import build_checkpoint, demo_corpus

# Large initializer_range so greedy logits are far apart (no argmax ties between implementations).
TINY = {
    # GQA 2:1, llama3 RoPE scaling
    "llama": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # head_dim (24) not hidden / heads, GQA 4:1, linear RoPE scaling
    "mistral": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=96, head_dim=24,
                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    # QKV bias, tied embeddings, no GQA
    "qwen2": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
                  tie_word_embeddings=True),
}


def build_tiny(root: Path, arch: str) -> Path:
    out = root / arch
    if (out / "config.json").exists():
        return out
    return build_checkpoint(out, arch, vocab_size=384, initializer_range=0.2, seed=1234,
                            max_position_embeddings=1024, corpus=demo_corpus(600, seed=1), **TINY[arch])
