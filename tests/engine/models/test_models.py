"""Model loading: supported architectures and RoPE types, clear errors for the rest, dtypes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.llama import ModelArgs, rope_inv_freq
from engine.models.loader import load_model


def _copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_architecture_is_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = _copy_with_config(tiny_llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(str(bad))


def test_unsupported_rope_type_is_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = _copy_with_config(tiny_llama_dir, tmp_path / "yarn",
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="default, linear, llama3"):
        load_model(str(bad))


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nowhere" / "at" / "all"))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_rope_inverse_frequencies_equal_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=dict(rope))
    args = ModelArgs.from_hf_config({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    if rope["rope_type"] == "default":
        expected = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(args), expected)   # bit-exact inputs: same float32 formula


def test_bfloat16_cache_and_weights(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=8, num_kv_blocks=64)
    assert llm.engine.core.kv_cache.key.dtype == torch.bfloat16
    assert llm.engine.loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6
    fp32 = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=64)
    first = fp32.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    assert out.outputs[0].token_ids[0] == first.outputs[0].token_ids[0]   # logits far apart (init range 0.2)


def test_the_fingerprint_covers_the_weights(tiny_llama_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, item 20 (d): a checkpoint directory's fingerprint hashed its config and tokenizer only, so two
    fine-tunes of one base shared prefix-cache hashes and one Redis namespace. The weights' digest is in it now:
    other weights, another fingerprint; the same files elsewhere, the same one; the digest is cached."""
    from safetensors.torch import load_file, save_file
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    same = shutil.copytree(tiny_llama_dir, tmp_path / "same")
    tuned = shutil.copytree(tiny_llama_dir, tmp_path / "tuned")
    (weights,) = sorted(tuned.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3                        # a fine-tune: same shapes, other values
    save_file(tensors, str(weights), metadata={"format": "pt"})
    prints = {d.name: load_model(str(d)).fingerprint for d in (tiny_llama_dir, same, tuned)}
    assert prints[tiny_llama_dir.name] == prints["same"] != prints["tuned"], prints
    from engine.models.loader import weights_digest
    cache = json.loads((tmp_path / "cache" / "prefixserve" / "weights-digests.json").read_text())
    assert str(weights.resolve()) in cache
    assert weights_digest(tuned) == weights_digest(tuned, tmp_path / "elsewhere")   # cached or not: one digest


def test_context_weight_is_attention_against_the_projections_multiply_adds(tiny_llama_dir: Path) -> None:
    """The scheduler's prefill cost (engine/sched/scheduler.py) weighs a context token by this: one new token's
    attention multiply-adds over one context token (scores and values: 2 x heads x head_dim a layer) against
    that token's projection multiply-adds, counted here from the model's own weights."""
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=64)
    args, model = llm.engine.loaded.args, llm.engine.loaded.model
    projections = sum(p.numel() for name, p in model.named_parameters()
                      if name.endswith("proj.weight") and ".layers." in f".{name}")
    attention = 2 * args.num_heads * args.head_dim * args.num_layers
    assert projections > 0
    assert args.context_weight == pytest.approx(attention / projections, rel=1e-12)
    assert llm.engine.core.scheduler.context_weight == args.context_weight
    assert llm.engine.core.scheduler.decode_prefill_cost == 288
    assert ModelArgs("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e4).context_weight == 1 / 3072


def test_the_loader_builds_the_model_on_the_engines_op_layer_only(tiny_llama_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A model loaded for an engine runs on that engine's op layer from its construction: no default one is made
    on the side (it loaded the C++ CPU kernels, and ran their AMX start check, in a CUDA engine's process)."""
    import engine.models.llama as llama
    import engine.models.loader as loader
    from kernels.ops import KernelConfig, Ops

    def refused(device: str = "cpu") -> Ops:
        raise AssertionError("default_ops() called while loading for an engine")

    monkeypatch.setattr(llama, "default_ops", refused)
    monkeypatch.setattr(loader, "default_ops", refused)
    ops = Ops(KernelConfig(cpu_kernels="none"))
    loaded = load_model(str(tiny_llama_dir), ops=ops)
    assert loaded.model.ops is ops
