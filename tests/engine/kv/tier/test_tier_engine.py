"""The KV tier in the engine: evicted blocks come back from disk instead of being computed, a restarted engine
restores a pinned prefix from it, and whatever goes wrong on disk (a damaged, deleted or hung file, a vanished
or full directory) costs a recompute, never a wrong token. Tiny Llama, float32, greedy: every output is
compared with an engine that has no tier."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

B = 16          # block size (the tiny model's pages are whole OS pages at 16 tokens: vattention keeps it)


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def make(model: Path, tier: Path | None = None, shared: Path | None = None, blocks: int = 24,
         **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), max_model_len=256, num_kv_blocks=blocks, quantization="none",
                                  kv_tier_dir=str(tier) if tier else None,
                                  kv_tier_shared_dir=str(shared) if shared else None, **kw))


def run(engine: LLMEngine, prompt: list[int], salt: tuple[tuple[int, str], ...] = (),
        max_tokens: int = 6) -> RequestOutput:
    rid = f"r{time.perf_counter_ns()}"
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                   cache_salt=salt))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return final


def tier_stat(engine: LLMEngine, name: str) -> float:
    return engine.stats().kv_tier_stats[name].value


def evict(engine: LLMEngine, prompt: list[int], seed: int = 100, salt: tuple[tuple[int, str], ...] = (),
          drain: bool = True) -> None:
    """Runs other prompts until no block of `prompt` is cached any more, then lets the writes land."""
    first = engine.core.manager.block_hashes(prompt, salt=salt)[0]
    for _ in range(20):
        if first not in engine.core.pool.cached:
            break
        run(engine, toks(7 * B, seed), max_tokens=1)
        seed += 1
    assert first not in engine.core.pool.cached
    tier = engine.core.tier
    assert tier is not None and (not drain or tier.drain())


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> Iterator[Any]:
    """Greedy tokens of a prompt from an engine without a tier (plenty of blocks, cold)."""
    ref = make(tiny_llama_dir, blocks=128)
    memo: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            ref.core.reset_prefix_cache()
            memo[tuple(prompt)] = run(ref, prompt).outputs[0].token_ids
        return memo[tuple(prompt)]
    yield tokens
    ref.core.close()


@pytest.mark.parametrize("kv_backend", ["paged", "vattention"])
def test_an_evicted_prompt_loads_from_the_tier(tiny_llama_dir: Path, tmp_path: Path, expected: Any,
                                               kv_backend: str) -> None:
    engine = make(tiny_llama_dir, tmp_path / "tier", blocks=16, kv_backend=kv_backend)
    assert engine.core.block_size == B
    prompt = toks(6 * B + 5, 1)
    cold = run(engine, prompt)
    assert cold.num_cached_tokens == 0
    evict(engine, prompt)
    assert tier_stat(engine, "written_blocks") >= 6
    again = run(engine, prompt)
    assert again.num_cached_tokens == 6 * B                  # every full block but the last token's, from disk
    assert tier_stat(engine, "hit_blocks") == 6 and tier_stat(engine, "loads") == 1
    assert tier_stat(engine, "read_bytes") > 0 and tier_stat(engine, "load_seconds") > 0
    assert cold.outputs[0].token_ids == again.outputs[0].token_ids == expected(prompt)
    engine.core.close()


def test_a_block_evicted_a_moment_ago_is_a_hit_before_its_write_lands(tiny_llama_dir: Path, tmp_path: Path,
                                                                       expected: Any) -> None:
    """The tier counts a block queued for writing as held: the load waits for the write, then reads it."""
    engine = make(tiny_llama_dir, tmp_path, blocks=16)
    prompt = toks(6 * B + 5, 16)
    run(engine, prompt)
    evict(engine, prompt, drain=False)
    again = run(engine, prompt)
    assert again.num_cached_tokens == 6 * B and again.outputs[0].token_ids == expected(prompt)
    engine.core.close()


def test_loading_a_prompts_tail_does_not_evict_its_own_head(tiny_llama_dir: Path, tmp_path: Path,
                                                             expected: Any) -> None:
    """The multi-turn case: a prompt's tail was evicted (tails go first), its head is still cached but is now
    the least recently used; the blocks loaded for its tail must not be allocated by evicting that head."""
    engine = make(tiny_llama_dir, tmp_path, blocks=16)
    prompt = toks(6 * B + 5, 17)                              # 6 full blocks + a partial one
    run(engine, prompt)
    run(engine, toks(12 * B + 8, 18), max_tokens=1)           # 13 blocks: evicts the prompt's blocks 5, 4, 3
    cached = engine.core.manager.cached_blocks(prompt[:6 * B])
    assert [b is not None for b in cached] == [True] * 3 + [False] * 3
    assert engine.core.tier is not None and engine.core.tier.drain()
    again = run(engine, prompt)
    assert again.num_cached_tokens == 6 * B                   # 3 from the cache, 3 from the tier
    assert tier_stat(engine, "hit_blocks") == 3
    assert again.outputs[0].token_ids == expected(prompt)
    engine.core.close()


def test_a_restarted_engine_restores_a_pinned_prefix(tiny_llama_dir: Path, tmp_path: Path, expected: Any) -> None:
    prefix = toks(5 * B + 3, 2)
    first = make(tiny_llama_dir, tmp_path)
    first.pin_prefix(prefix)
    first.core.close()                                       # flushes the pinned blocks' writes
    assert len(list(tmp_path.rglob("*.kv"))) == 5
    second = make(tiny_llama_dir, tmp_path)
    pinned = second.pin_prefix(prefix)
    assert pinned.num_pinned_blocks == 5
    stats = second.stats()
    assert stats.prefix_cache_hit_tokens_total == 5 * B      # only the 3 tokens after the last block computed
    assert tier_stat(second, "hit_blocks") == 5
    question = prefix + toks(9, 3)
    out = run(second, question)
    assert out.num_cached_tokens == 5 * B and out.outputs[0].token_ids == expected(question)
    second.core.close()


@pytest.mark.parametrize("damage", ["corrupt", "delete", "foreign"])
def test_a_bad_file_costs_a_recompute_not_a_wrong_token(tiny_llama_dir: Path, tmp_path: Path, expected: Any,
                                                        damage: str) -> None:
    prefix = toks(5 * B + 3, 4)
    first = make(tiny_llama_dir, tmp_path)
    hashes = first.core.manager.block_hashes(prefix)
    first.pin_prefix(prefix)
    first.core.close()
    path = next(tmp_path.rglob(f"{hashes[2].hex()}.kv"))    # the third block
    if damage == "corrupt":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
    elif damage == "delete":
        path.unlink()
    else:                                                    # another block's file under its name
        shutil.copy(next(tmp_path.rglob(f"{hashes[3].hex()}.kv")), path)
    second = make(tiny_llama_dir, tmp_path)
    second.pin_prefix(prefix)
    assert second.stats().prefix_cache_hit_tokens_total == 2 * B          # blocks 0 and 1; the rest computed
    assert tier_stat(second, "hit_blocks") == 2
    fault = {"corrupt": "faults_corrupt", "delete": "miss_blocks", "foreign": "faults_foreign"}[damage]
    assert tier_stat(second, fault) >= 1
    question = prefix + toks(9, 5)
    assert run(second, question).outputs[0].token_ids == expected(question)
    second.core.close()


def test_a_vanished_directory_is_a_miss_and_comes_back(tiny_llama_dir: Path, tmp_path: Path, expected: Any) -> None:
    root = tmp_path / "tier"
    engine = make(tiny_llama_dir, root, blocks=16)
    prompt = toks(6 * B + 5, 6)
    run(engine, prompt)
    evict(engine, prompt)
    shutil.rmtree(root)
    again = run(engine, prompt)
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == expected(prompt)
    assert tier_stat(engine, "faults_missing") == 1 and tier_stat(engine, "hit_blocks") == 0
    evict(engine, prompt, seed=300)                          # written again: the directory is made again
    assert run(engine, prompt).num_cached_tokens == 6 * B
    engine.core.close()


def test_one_tenants_blocks_are_never_anothers_hit(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = make(tiny_llama_dir, tmp_path, blocks=16)
    prompt = toks(6 * B + 5, 7)
    a, b = ((0, "tenant-a"),), ((0, "tenant-b"),)
    run(engine, prompt, a)
    evict(engine, prompt, salt=a)
    assert run(engine, prompt, b).num_cached_tokens == 0
    assert tier_stat(engine, "hit_blocks") == 0
    assert run(engine, prompt, a).num_cached_tokens == 6 * B
    engine.core.close()


def test_a_deleted_prefix_leaves_the_tier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = make(tiny_llama_dir, tmp_path)
    prefix = toks(4 * B + 1, 8)
    engine.pin_prefix(prefix)
    tier = engine.core.tier
    assert tier is not None and tier.drain()
    names = {f"{h.hex()}.kv" for h in engine.core.manager.block_hashes(prefix)}
    assert names <= {p.name for p in tmp_path.rglob("*.kv")}
    assert engine.unpin_prefix(prefix, forget=True) == 4
    tier.capture()
    deadline = time.monotonic() + 10
    while names & {p.name for p in tmp_path.rglob("*.kv")} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not names & {p.name for p in tmp_path.rglob("*.kv")}
    assert run(engine, prefix + [5]).num_cached_tokens == 0  # and out of the cache: nothing of it left
    engine.core.close()


def test_a_shared_directory_serves_another_engines_blocks(tiny_llama_dir: Path, tmp_path: Path,
                                                          expected: Any) -> None:
    shared = tmp_path / "shared"
    writer = make(tiny_llama_dir, shared=shared)
    prefix = toks(5 * B + 3, 9)
    writer.pin_prefix(prefix)
    assert writer.core.tier is not None and writer.core.tier.drain()
    reader = make(tiny_llama_dir, tmp_path / "local", shared=shared)   # another replica: its own local tier too
    reader.pin_prefix(prefix)
    assert reader.stats().prefix_cache_hit_tokens_total == 5 * B
    assert tier_stat(reader, "hit_blocks") == 5
    question = prefix + toks(9, 10)
    assert run(reader, question).outputs[0].token_ids == expected(question)
    writer.core.close()
    reader.core.close()


def test_a_shared_directory_that_goes_down_costs_recomputes_only(tiny_llama_dir: Path, tmp_path: Path,
                                                                 expected: Any) -> None:
    shared = tmp_path / "shared"
    writer = make(tiny_llama_dir, shared=shared)
    prefix = toks(5 * B + 3, 11)
    writer.pin_prefix(prefix)
    writer.core.close()
    reader = make(tiny_llama_dir, tmp_path / "local", shared=shared, blocks=16)
    shared.rename(tmp_path / "unmounted")                   # the volume goes away
    question = prefix + toks(9, 12)
    out = run(reader, question)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == expected(question)
    assert tier_stat(reader, "faults_missing") >= 1
    evict(reader, question)                                 # writes: the local tier takes them, the shared one faults
    assert tier_stat(reader, "faults_io") >= 1 and not shared.exists()
    assert run(reader, question).num_cached_tokens == 5 * B
    reader.core.close()


def test_a_hung_file_costs_the_timeout_and_others_keep_running(tiny_llama_dir: Path, tmp_path: Path,
                                                               expected: Any) -> None:
    """A block file that never answers (a FIFO: open() blocks, as on a hung network file system): the request
    waits --kv-tier-load-timeout, then computes; another request runs meanwhile."""
    prefix = toks(5 * B + 3, 13)
    first = make(tiny_llama_dir, tmp_path)
    hashes = first.core.manager.block_hashes(prefix)
    first.pin_prefix(prefix)
    first.core.close()
    second = make(tiny_llama_dir, tmp_path, kv_tier_load_timeout=1.0)
    fifo = next(tmp_path.rglob(f"{hashes[0].hex()}.kv"))
    fifo.unlink()
    os.mkfifo(fifo, 0o600)
    try:
        question = prefix + toks(9, 14)
        second.add_request("waits", question, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        second.add_request("other", toks(20, 15), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        ended: dict[str, float] = {}
        outs: dict[str, RequestOutput] = {}
        start = time.monotonic()
        while second.has_unfinished():
            for out in second.step():
                if out.finished:
                    ended[out.request_id] = time.monotonic() - start
                    outs[out.request_id] = out
        assert ended["other"] < ended["waits"] and ended["waits"] >= 1.0
        assert outs["waits"].num_cached_tokens == 0 and outs["waits"].outputs[0].token_ids == expected(question)
        assert tier_stat(second, "timeouts") == 1
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)      # lets the stuck read end (an empty file: a miss)
        os.close(fd)
    second.core.close()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(mode=0o700)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_a_full_disk_costs_writes_only(tiny_llama_dir: Path, tmp_path: Path, expected: Any) -> None:
    """A real full file system (a 64 KiB tmpfs: a few block files): writes fail with ENOSPC and are counted;
    every answer stays right, and what did fit is still a hit."""
    root = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(root, "64k"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        engine = make(tiny_llama_dir, root, blocks=16)
        prompts = [toks(6 * B + 5, 20 + i) for i in range(3)]
        for p in prompts:
            assert run(engine, p).outputs[0].token_ids == expected(p)
        evict(engine, prompts[-1], seed=600)
        assert tier_stat(engine, "faults_nospace") >= 1
        for p in prompts:
            assert run(engine, p).outputs[0].token_ids == expected(p)
        engine.core.close()
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=10)
