"""Greedy output equals transformers' `generate`, token for token, whatever the engine does underneath:
shared steps, block sizes 16 / 8 / 1, prefix cache cold and warm, and preemption under a small cache."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.errors import KVRefused
from engine.llm_engine import LLMEngine

MAX_NEW = 12


def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(20)]          # a common prefix for warm hits
    lens = [1, 3, 9, 16, 17, 33, 40, 57]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(k)] for k in (1, 12)]
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# some parity tests run on the CPU, and on a CUDA GPU where there is one (the Triton kernels; tests/engine/test_cuda.py
# has the GPU's other tests)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


def shared_prefix_case(model_dir: Path, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts with a common 72-token prefix, then 5, 9 and 1 tokens of their own; transformers' greedy
    tokens for each."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = random.Random(seed)
    vocab = hf.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(72)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(k)] for k in (5, 9, 1)]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in prompts]
    return prompts, expected


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 8, 1])
def test_greedy_parity_cold_and_warm(reference, block_size: int, device: str) -> None:
    path, prompts, expected = reference
    llm = LLM(str(path), block_size=block_size, num_kv_blocks=4096 // block_size, max_num_batched_tokens=64,
              device=device)
    assert run(llm, prompts) == expected                      # cold: prompts share steps, chunked prefill
    hits_before = llm.stats().prefix_cache_hit_tokens_total
    assert run(llm, prompts) == expected                      # warm: the same prompts hit the cache
    assert llm.stats().prefix_cache_hit_tokens_total > hits_before
    assert llm.stats().kv_blocks_used == 0


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_parity_under_preemption(reference, device: str) -> None:
    path, prompts, expected = reference
    llm = LLM(str(path), block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, device=device)
    assert run(llm, prompts) == expected
    stats = llm.stats()
    assert stats.preemptions_total > 0, "the cache was meant to be small enough to force preemption"
    assert stats.kv_blocks_used == stats.kv_blocks_pinned == 0


def test_greedy_parity_without_prefix_caching(reference) -> None:
    path, prompts, expected = reference
    llm = LLM(str(path), block_size=8, num_kv_blocks=512, enable_prefix_caching=False)
    assert run(llm, prompts) == expected
    assert run(llm, prompts) == expected
    assert llm.stats().prefix_cache_hit_tokens_total == 0


def test_greedy_parity_with_triton_backend(reference) -> None:
    """The same parity through the Triton kernels (TRITON_INTERPRET=1 on a CPU)."""
    path, prompts, expected = reference
    llm = LLM(str(path), block_size=8, num_kv_blocks=512, attention_backend="triton")
    few = [0, 3, 5, 8]                                   # short and long prompts, with a shared prefix
    got = [o.outputs[0].token_ids for o in llm.generate([prompts[i] for i in few], GREEDY)]
    assert got == [expected[i] for i in few]
    got = [o.outputs[0].token_ids for o in llm.generate([prompts[9]], GREEDY)]  # warm: prefill over cached prefix
    assert got == [expected[9]]


@pytest.mark.parametrize("kv_backend", ["paged", "vattention"])
def test_greedy_parity_sharing_a_prefix_in_the_step_that_computes_it(tiny_model_dir: Path, kv_backend: str) -> None:
    """In-step sharing: prompts with a common prefix of several blocks, submitted together, all have their first
    token after one step (the later ones attend to the prefix blocks the first one writes in that very step),
    and every token is transformers' greedy one."""
    prompts, expected = shared_prefix_case(tiny_model_dir, 11)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_backend=kv_backend, block_size=8,
                                    num_kv_blocks=256, max_num_batched_tokens=256))
    bs = engine.core.block_size
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    outs = {o.request_id: o for o in engine.step()}
    assert sorted(outs) == ["0", "1", "2"] and all(len(o.outputs[0].token_ids) == 1 for o in outs.values())
    assert [outs[str(i)].num_cached_tokens for i in range(3)] == [0, 72 // bs * bs, 72 // bs * bs]
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].merge(o)
    assert [outs[str(i)].outputs[0].token_ids for i in range(3)] == expected
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("kv_backend", ["paged", "vattention"])
def test_a_refused_step_with_sharers_runs_them_again_and_they_answer_as_transformers(
        tiny_model_dir: Path, kv_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Failure injected at the step that computes a shared prefix: the KV backend refuses the writer (KVRefused,
    nothing of the step runs). Its request ends with that error; the two prompts that shared its blocks in that
    step go back to the queue (`undo_joins`), compute the prefix themselves in the next step, and answer as
    transformers does; no block is left behind."""
    prompts, expected = shared_prefix_case(tiny_model_dir, 12)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_backend=kv_backend, block_size=8,
                                    num_kv_blocks=256, max_num_batched_tokens=256))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    runner = engine.core.runner
    real = runner.execute
    refused: list[list[int]] = []

    def refuse_once(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append([s.num_new for s in batch])
            raise KVRefused("injected", [batch[0].seq.seq_id])
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", refuse_once)
    outs = {o.request_id: o for o in engine.step()}
    bs = engine.core.block_size
    assert refused == [[77, 9 + 72 % bs, 1 + 72 % bs]]            # the writer and two in-step sharers
    assert outs["0"].finished and isinstance(outs["0"].error, KVRefused)
    assert "1" not in outs and "2" not in outs
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in outs:
                outs[o.request_id].merge(o)
            else:
                outs[o.request_id] = o
    assert [outs[str(i)].outputs[0].token_ids for i in (1, 2)] == expected[1:]
    # in their order again: 1 writes the prefix, 2 shares it (the hits the clients are told: of the step that ran)
    assert [outs[str(i)].num_cached_tokens for i in (1, 2)] == [0, 72 // bs * bs]
    assert outs["1"].num_written_tokens == len(prompts[1]) // bs * bs                # its full blocks, the prefix's too
    assert engine.stats().kv_blocks_used == 0
