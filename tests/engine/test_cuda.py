"""The engine on a CUDA GPU, through the Triton kernels end to end (skipped without a GPU; they ran on an H200:
benchmarks/results/h200-amx-first-run/).

Agreement criteria:
- float32 (`--quantization none`, the default dtype): greedy tokens equal transformers' `generate` token for
  token behind a pinned prefix here; prefix cache cold and warm, block sizes 16, 8 and 1, and under preemption in
  tests/engine/test_parity.py (its `cuda` cases). The fp32 kernels use IEEE dots (no TF32), so only summation order
  differs from transformers.
- bfloat16: vLLM's criterion for half-precision parity (its tests' `check_logprobs_close`): our greedy tokens equal
  transformers' bf16 greedy tokens up to the first position where they differ, and there each side's token is in
  the other's top 5. Both round every matmul to bf16, in different orders, so near-ties may flip.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_parity import GREEDY, MAX_NEW
from tests.helpers.random_checkpoint import build_checkpoint, demo_corpus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOP = 5


def cuda_llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    llm = LLM(str(path), device="cuda", **kwargs)
    assert llm.engine.core.attention_backend == "triton"      # the default on CUDA
    assert llm.engine.core.ops.report.ops["paged decode"] == "triton"
    return llm


def test_fp32_pinned_prefix_is_served_from_the_cache(reference) -> None:
    path, prompts, expected = reference
    llm = cuda_llm(path, block_size=8, num_kv_blocks=256)
    prefix = prompts[9][:16]                                  # the shared 20-token prefix's first two blocks
    pinned = llm.pin_prefix(prefix)
    assert (pinned.num_tokens, pinned.num_pinned_blocks) == (16, 2)
    outs = llm.generate([prompts[8], prompts[9]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [expected[8], expected[9]]
    assert [o.num_cached_tokens for o in outs] == [16, 16]
    assert llm.stats().kv_blocks_pinned == 2
    assert llm.unpin_prefix(prefix) == 2
    assert llm.stats().kv_blocks_pinned == 0


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[list[int]]]:  # type: ignore[no-untyped-def]
    """transformers' greedy tokens for `prompt` and its top-TOP token ids at each step."""
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].topk(TOP).indices.tolist() for step in out.logits]


def assert_close_greedy(ours: list[int], our_top: list[dict[int, float]], ref: list[int],
                        ref_top: list[list[int]]) -> bool:
    """vLLM's check_logprobs_close on one sequence; True when every token agrees."""
    for t, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert a in ref_top[t] and b in our_top[t], (t, a, b, ref_top[t], our_top[t])
            return False
    assert len(ours) == len(ref)
    return True


@pytest.fixture(scope="module")
def smollm_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random checkpoint with SmolLM2-135M's attention layout (9 query heads over 3 KV heads, head_dim 64) and
    8 layers: the built-in model's kernel shapes (its GGUF does not travel to the GPU machine)."""
    return build_checkpoint(tmp_path_factory.mktemp("smollm") / "m", "llama", hidden_size=576, num_layers=8,
                            num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=512,
                            initializer_range=0.05, seed=3, max_position_embeddings=4096,
                            corpus=demo_corpus(600, seed=2))


@pytest.mark.parametrize("model", ["tiny", "smollm_shaped"])
def test_bf16_greedy_close_to_transformers(request: pytest.FixtureRequest, tiny_llama_dir: Path, model: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir if model == "tiny" else request.getfixturevalue("smollm_shaped")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to("cuda")
    rng = random.Random(5)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(300)]    # a cached prefix of many blocks and key tiles
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 70)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(k)] for k in (1, 17, 40)]
    llm = cuda_llm(path, dtype="bfloat16", block_size=16, num_kv_blocks=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP)
    whole = 0
    for _ in range(2):                                        # cold, then warm (the shared prefix cached)
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            ref, ref_top = hf_greedy(hf, prompt)
            seq = out.outputs[0]
            assert seq.logprobs is not None
            whole += assert_close_greedy(seq.token_ids, seq.logprobs, ref, ref_top)
    assert llm.stats().prefix_cache_hit_tokens_total >= 2 * (300 // 16) * 16
    assert whole >= len(prompts), f"only {whole} of {2 * len(prompts)} sequences agree all the way"
