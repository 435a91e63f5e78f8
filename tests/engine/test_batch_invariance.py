"""--batch-invariant on the built-in model (SmolLM2-135M-Instruct, int4 by default): a request's greedy tokens
and their log-probabilities (the sampled token's and the top 5) are bit for bit the same computed alone on a cold
cache, in a batch with others, over blocks other requests computed (a shared chat template, a pinned prefix, a
conversation whose earlier turn's generated tokens are in the cache), and with its prompt cut into chunks.

Without the mode these differ (README, "Batch invariance": measured, not asserted here: the default mode makes
no such promise)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.models.test_real_model import QUESTIONS, chat_ids

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, logprobs=5, ignore_eos=True)
Answer = tuple[list[int], list[dict[int, float]]]


def answers(llm: LLM, prompts: list[list[int]]) -> list[Answer]:
    outs = llm.generate(prompts, PARAMS)
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or [])) for o in outs]


@pytest.fixture(scope="module")
def invariant(real_model_path: Path) -> LLM:
    return LLM(str(real_model_path), batch_invariant=True, max_model_len=512, num_kv_blocks=256)


def test_tokens_and_logprobs_do_not_depend_on_batch_chunks_or_cache(invariant: LLM) -> None:
    llm, tok = invariant, invariant.tokenizer
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]
    prompts[3] = prompts[3] + chat_ids(tok, QUESTIONS[7])[1:]          # a longer one: several blocks more
    core = llm.engine.core
    alone: list[Answer] = []
    for p in prompts:                                                  # cold: nothing cached
        core.reset_prefix_cache()
        alone += answers(llm, [p])
    core.reset_prefix_cache()
    assert answers(llm, prompts) == alone                              # one batch, mixed prefill and decode steps
    assert answers(llm, prompts[::-1]) == alone[::-1]                  # cached: every prompt's full blocks hit
    hits = core.scheduler.prefix_hit_tokens
    assert hits > 0
    # a conversation: the second turn's prompt holds the first turn's generated tokens, whose blocks decode
    # steps wrote; cold, the same tokens are computed by a prefill
    turn = prompts[0] + alone[0][0] + chat_ids(tok, "And of Italy?")[1:]
    warm = answers(llm, [turn])
    core.reset_prefix_cache()
    assert answers(llm, [turn]) == warm
    # a pinned prefix: the prompts that start with it read its blocks
    system = {"role": "system", "content": "You answer briefly and politely, in one sentence, and you never guess."}
    head = tok.encode(tok.apply_chat_template([system], tokenize=False), add_special_tokens=False)
    with_system = [tok.encode(tok.apply_chat_template([system, {"role": "user", "content": q}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)
                   for q in QUESTIONS[:2]]
    assert all(p[:len(head)] == head for p in with_system) and len(head) >= 16
    core.reset_prefix_cache()
    cold = [answers(llm, [p])[0] for p in with_system]
    assert llm.pin_prefix(head).num_pinned_blocks >= 1
    assert answers(llm, with_system) == cold
    # chunked prefill: a step budget of 16 tokens cuts every prompt into chunks (the same engine, its budget cut)
    core.reset_prefix_cache()
    core.scheduler.max_num_batched_tokens = 16
    try:
        assert answers(llm, prompts) == alone
    finally:
        core.scheduler.max_num_batched_tokens = llm.engine.core.config.max_num_batched_tokens


@pytest.mark.parametrize("other,message", [
    ({"device": "cuda"}, "CPU only"), ({"cpu_kernels": "none"}, "needs the C\\+\\+ CPU kernels"),
    ({"attention_backend": "torch"}, "needs the cpu attention kernels"),
    ({"kv_backend": "vattention"}, "needs the paged KV backend"),
    ({"compile_decode": True}, "do not go together")])
def test_the_mode_is_refused_where_it_would_not_hold(other: dict, message: str) -> None:
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match=message):
        EngineConfig(batch_invariant=True, **other)
    EngineConfig(**other)                                      # the same without the mode is a valid config
