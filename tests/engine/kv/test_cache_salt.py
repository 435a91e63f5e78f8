"""Cache salts put prompts apart in the prefix cache (what keeps one tenant's prompts a miss for another),
and each request reports the prompt tokens it wrote into the cache, exactly."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.kv.block_pool import hash_block, hash_blocks, root_hash
from engine.llm_engine import LLMEngine

BLOCK = 4


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def run(engine: LLMEngine, rid: str, prompt: list[int],
        salt: tuple[tuple[int, str], ...] = ()) -> tuple[int, int, list[int]]:
    """(cached tokens, written tokens, output) of one greedy request run to its end."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, cache_salt=salt))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return final.num_cached_tokens, final.num_written_tokens, final.outputs[0].token_ids


@pytest.fixture()
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=256))


def test_salt_goes_into_the_named_block_and_every_later_one() -> None:
    tokens = list(range(12))
    plain = hash_blocks("fp", tokens, BLOCK)
    at0 = hash_blocks("fp", tokens, BLOCK, salt=((0, "a"),))
    at1 = hash_blocks("fp", tokens, BLOCK, salt=((1, "a"),))
    assert at0[0] == hash_block(root_hash("fp"), tokens[:4], ("a",))
    assert all(x != y for x, y in zip(plain, at0))                       # block 0 and all after it differ
    assert at1[0] == plain[0] and at1[1] != plain[1] and at1[2] != plain[2]
    assert hash_blocks("fp", tokens, BLOCK, salt=((0, "b"),)) != at0


def test_the_same_prompt_misses_across_salts_and_hits_within_one(engine: LLMEngine) -> None:
    prompt = toks(18, 1)                     # 4 full blocks + 2 tokens
    cold = run(engine, "a1", prompt, ((0, "tenant-a"),))
    assert cold[:2] == (0, 16)               # wrote its 4 full prompt blocks
    other = run(engine, "b1", prompt, ((0, "tenant-b"),))
    assert other[:2] == (0, 16)              # a miss: it computed and cached its own copy
    plain = run(engine, "p1", prompt)
    assert plain[:2] == (0, 16)
    again = run(engine, "a2", prompt, ((0, "tenant-a"),))
    assert again[:2] == (16, 0)              # a hit, nothing new written
    assert cold[2] == other[2] == plain[2] == again[2]                   # a salt never changes the answer


def test_written_tokens_count_only_blocks_it_cached_first(engine: LLMEngine) -> None:
    prompt = toks(16, 2)                     # exactly 4 blocks: the last one is always recomputed
    assert run(engine, "x1", prompt)[:2] == (0, 16)
    assert run(engine, "x2", prompt)[:2] == (12, 0)       # recomputed the last block: not a write
    longer = prompt + toks(9, 3)             # 6 full blocks, the first 4 cached
    assert run(engine, "x3", longer)[:2] == (16, 8)


def test_a_salted_pin_is_hit_only_with_its_salt(engine: LLMEngine) -> None:
    prefix = toks(12, 4)
    salt = ((0, "published:sys"),)
    pinned = engine.pin_prefix(prefix, salt)
    assert pinned.num_pinned_blocks == 3
    assert engine.unpin_prefix(prefix) == 0              # the unsalted blocks are not the pinned ones
    question = prefix + toks(6, 5)
    assert run(engine, "q1", question, ((0, "tenant-a"),))[0] == 0
    # the prefix's salt at block 0, the tenant's from the first block past the prefix
    assert run(engine, "q2", question, ((0, "published:sys"), (3, "tenant-a")))[:2] == (12, 4)
    assert run(engine, "q3", question, ((0, "published:sys"), (3, "tenant-b")))[:2] == (12, 4)
    assert engine.unpin_prefix(prefix, salt) == 3
    assert engine.stats().kv_blocks_pinned == 0
