"""kv_backend="vattention": greedy output equals transformers' on the three architectures (cache cold and
warm, under preemption, with a pinned prefix, through the Triton kernels), forks and beams equal the paged
backend's, sharing is physical (one page at two addresses), pages are accounted for, and pages a decode
needs are mapped ahead of it."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv.backends.vattention.cache import VAttentionCache
from tests.engine.test_parity import run


def vattention(llm: LLM) -> VAttentionCache:
    cache = llm.engine.core.kv_cache
    assert isinstance(cache, VAttentionCache)
    return cache


def va_stats(llm: LLM) -> dict[str, float]:
    """The backend's own figures, as the metrics export them (prefixserve_vattention_<name>)."""
    st = llm.stats()
    assert st.kv_backend == "vattention"
    return {k: s.value for k, s in st.kv_backend_stats.items()}


def assert_idle_and_accounted(llm: LLM) -> None:
    """Nothing leaks: blocks back (used == pinned), no slot held, every mapping left is a stale one."""
    st = llm.stats()
    va = va_stats(llm)
    assert st.kv_blocks_used == st.kv_blocks_pinned and st.requests_running == st.requests_waiting == 0
    assert va["busy_slots"] == 0 and va["live_pages"] == 0
    cache = vattention(llm)
    assert va["mapped_pages"] == sum(b >= 0 for row in cache.slots.mapped for b in row)


def test_greedy_parity_cold_and_warm(reference: Any) -> None:
    path, prompts, expected = reference
    llm = LLM(str(path), kv_backend="vattention", num_kv_blocks=256, max_num_batched_tokens=64)
    assert run(llm, prompts) == expected                      # cold: shared steps, chunked prefill
    hits = llm.stats().prefix_cache_hit_tokens_total
    assert run(llm, prompts) == expected                      # warm: cached pages mapped into new slots
    assert llm.stats().prefix_cache_hit_tokens_total > hits
    assert_idle_and_accounted(llm)


def test_greedy_parity_under_preemption(reference: Any) -> None:
    path, prompts, expected = reference
    llm = LLM(str(path), kv_backend="vattention", block_size=1, num_kv_blocks=3, max_num_batched_tokens=32,
              max_model_len=256)
    bs = llm.engine.core.block_size                           # one page: as few tokens as whole OS pages allow
    small = LLM(str(path), kv_backend="vattention", block_size=bs, num_kv_blocks=96 // bs,
                max_num_batched_tokens=32, max_model_len=256)
    assert run(small, prompts) == expected
    assert small.stats().preemptions_total > 0, "the cache was meant to be small enough to force preemption"
    assert_idle_and_accounted(small)
    del llm


def test_greedy_parity_through_the_triton_kernels(reference: Any) -> None:
    """The contiguous Triton kernels on the mapped pages (TRITON_INTERPRET=1 on a CPU)."""
    path, prompts, expected = reference
    llm = LLM(str(path), kv_backend="vattention", num_kv_blocks=256, attention_backend="triton")
    few = [0, 3, 5, 8]
    assert run(llm, [prompts[i] for i in few]) == [expected[i] for i in few]
    assert run(llm, [prompts[9]]) == [expected[9]]            # warm: prefill over a mapped cached prefix


def test_a_pinned_prefix_is_shared_by_mapping_one_page_into_two_slots(tiny_llama_dir: Path) -> None:
    """Two running requests that start with a pinned prefix hold its pages at page 0.. of their own slots:
    the same physical pages (the slot table says so, and a write through one slot's virtual range is
    read through the other's and in the pool), and their greedy outputs equal the paged backend's."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(k)] for k in (3, 9)]
    paged = run(LLM(str(tiny_llama_dir), num_kv_blocks=128), prompts)
    llm = LLM(str(tiny_llama_dir), kv_backend="vattention", num_kv_blocks=128)
    pinned = llm.pin_prefix(prefix)
    assert pinned.num_pinned_blocks == 40 // llm.engine.core.block_size
    assert run(llm, prompts) == paged

    engine, cache = llm.engine, vattention(llm)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()                                             # both prefilled, from the pinned pages
    manager = engine.core.manager
    seqs = list(cache.slots.slot_of.items())
    assert len(seqs) == 2
    (sid_a, slot_a), (sid_b, slot_b) = seqs
    n = pinned.num_pinned_blocks
    shared = manager.block_table(sid_a)[:n]
    assert manager.block_table(sid_b)[:n] == shared and slot_a != slot_b
    assert cache.slots.mapped[slot_a][:n] == cache.slots.mapped[slot_b][:n] == shared
    key = cache.key_virtual[0]                                # layer 0, [slots, slot_len, Hkv, D]
    span = n * cache.block_size
    assert torch.equal(key[slot_a, :span], key[slot_b, :span]) and key[slot_a, :span].abs().sum() > 0
    saved = key[slot_a, 5].clone()
    key[slot_a, 5] = 1234.5                                   # through slot a's virtual range
    assert key[slot_b, 5].eq(1234.5).all()                    # seen through slot b's
    page, offset = divmod(5, cache.block_size)
    assert cache.key[0, shared[page], offset].eq(1234.5).all()   # and in the physical pool
    key[slot_a, 5] = saved
    while engine.has_unfinished():
        engine.step()
    llm.unpin_prefix(prefix)
    assert_idle_and_accounted(llm)


def test_forks_and_beams_equal_the_paged_backend(tiny_llama_dir: Path) -> None:
    """n > 1 (forks share the prompt's pages, copy-on-write of the partial page) and beam search give
    what the paged backend gives (itself tested against transformers), token for token; the forks
    outnumber max_num_seqs, so the slot table grows."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (13, 21)]
    sample = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=9, ignore_eos=True)
    beams = SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=8, temperature=0, ignore_eos=True)
    results = []
    for backend in ("paged", "vattention"):
        llm = LLM(str(tiny_llama_dir), kv_backend=backend, num_kv_blocks=128, max_num_seqs=4)
        results.append([[o.token_ids for o in out.outputs] for params in (sample, beams)
                        for out in llm.generate(prompts, params)])
        if backend == "vattention":
            assert vattention(llm).slots.num_slots > 4          # 8 samples at once in 4 slots: it doubled
            assert_idle_and_accounted(llm)
    assert results[0] == results[1]


def test_aborts_leave_nothing_behind(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), kv_backend="vattention", num_kv_blocks=64)
    engine = llm.engine
    rng = random.Random(5)
    for i in range(6):
        engine.add_request(f"a{i}", [rng.randrange(3, 300) for _ in range(20 + i)],
                           SamplingParams(n=2, temperature=1.0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert va_stats(llm)["busy_slots"] > 0
    for i in range(6):
        engine.abort(f"a{i}")
    assert_idle_and_accounted(llm)


def test_pages_a_decode_needs_are_mapped_ahead_of_it(tiny_llama_dir: Path) -> None:
    """With mapping ahead, no decode step waits for a page mapping (the mapper thread made them during
    earlier forward passes); with it off, decodes crossing into a new page map it synchronously."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 16, 30, 47)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stats = {}
    outs = {}
    for ahead in (4, 0):
        llm = LLM(str(tiny_llama_dir), kv_backend="vattention", num_kv_blocks=128, map_ahead_tokens=ahead)
        outs[ahead] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats[ahead] = va_stats(llm)
    assert outs[4] == outs[0]
    assert stats[4]["decode_stalls"] == 0 and stats[4]["ahead_maps"] > 0
    assert stats[0]["decode_stalls"] > 0 and stats[0]["ahead_maps"] == 0


def test_a_recycled_slot_reuses_its_mapped_pages(tiny_llama_dir: Path) -> None:
    """Deferred reclamation: without prefix caching every freed page is unhashed, so a second wave of
    requests lands in the slots of the first and gets the very blocks mapped there: no new mapping."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), kv_backend="vattention", num_kv_blocks=128, enable_prefix_caching=False)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    before = va_stats(llm)
    assert before["sync_maps"] > 0
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    after = va_stats(llm)
    assert first == second
    assert (after["sync_maps"], after["ahead_maps"]) == (before["sync_maps"], before["ahead_maps"])
    assert after["reused_pages"] > before["reused_pages"]


def test_stale_mappings_are_reclaimed_when_mappings_run_short(tiny_llama_dir: Path) -> None:
    """Four requests leave their slots' mappings behind; with the mapping limit then cut (as if the process
    had few VMAs left), the next requests, one at a time, fit by undoing those stale mappings: nobody
    is refused, and the tokens are the paged backend's."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(8)]
    llm = LLM(str(tiny_llama_dir), kv_backend="vattention", num_kv_blocks=128, max_num_seqs=4)
    paged = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_num_seqs=4)
    assert run(llm, prompts[:4]) == run(paged, prompts[:4])
    cache = vattention(llm)
    assert cache.slots.num_runs >= 4 and va_stats(llm)["reclaimed_pages"] == 0
    cache.limit = 11                                          # 5 runs
    for p in prompts[4:]:
        assert run(llm, [p]) == run(paged, [p])
        assert cache.map_areas() <= 11
    va = va_stats(llm)
    assert va["reclaimed_pages"] > 0 and va["refused_seqs"] == 0
    assert_idle_and_accounted(llm)


def test_block_size_rounds_up_to_whole_os_pages(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_backend="vattention", block_size=1, num_kv_blocks=8)
    cache = vattention(llm)
    assert cache.page_bytes % 4096 == 0 and llm.engine.core.block_size == cache.block_size >= 1
    smaller = cache.block_size - 1
    if smaller:
        row = cache.page_bytes // cache.block_size
        assert (smaller * row) % 4096 != 0                   # nothing smaller would do


def test_vattention_is_refused_off_the_cpu(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="CPU only"):
        LLM(str(tiny_llama_dir), kv_backend="vattention", device="meta", num_kv_blocks=8)
