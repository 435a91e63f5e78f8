"""Fault injection: every syscall of the vAttention cache (mmap, munmap, madvise; reserve, map, unmap and
release are made of them) fails in turn, at every step of a workload that maps, shares, maps ahead,
grows the slot table and reclaims. Afterwards the cache is either consistent (the kernel's mappings are
what the slot table says, the rest of the reservation is PROT_NONE with no hole, the views see the right
pages, and later requests get the same tokens as before) or marked failed (EngineDead from then on)."""
from __future__ import annotations

import errno
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import EngineDead, KVRefused
from engine.kv.backends.vattention import vmm
from engine.kv.backends.vattention.cache import VAttentionCache
from engine.models.llama import ModelArgs
from tests.engine.kv.backends.vattention.test_vattention import assert_idle_and_accounted, vattention

ARGS = ModelArgs("LlamaForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4)      # a token: 256 bytes


class Faults:
    """Counts the cache's syscalls and fails the `at`-th (and, `persist`, every one after it) with ENOMEM.
    `hole`: a failing MAP_FIXED first empties its range, as kernels before 6.12 could leave it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.at: int | None = None
        self.persist = self.hole = False
        real = {name: getattr(vmm, name) for name in ("sys_mmap", "sys_munmap", "sys_madvise")}

        def failing(name: str) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                self.calls += 1
                if self.at is not None and (self.calls == self.at or self.persist and self.calls > self.at):
                    if name == "sys_mmap" and self.hole and args[3] & vmm.MAP_FIXED:
                        real["sys_munmap"](args[0], args[1])
                    raise OSError(errno.ENOMEM, f"injected: {name} call {self.calls}")
                return real[name](*args)
            return call
        for name in real:
            monkeypatch.setattr(vmm, name, failing(name))

    def arm(self, at: int | None, persist: bool = False, hole: bool = False) -> None:
        self.calls, self.at, self.persist, self.hole = 0, at, persist, hole


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    yield Faults(monkeypatch)


def _maps(lo: int, hi: int) -> list[tuple[int, int, str, int, str]]:
    """(start, end, perms, offset, path) of this process's mappings overlapping [lo, hi), in order."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start < hi and end > lo:
                out.append((start, end, parts[1], int(parts[2], 16), parts[5].strip() if len(parts) > 5 else ""))
    return out


def assert_consistent(cache: VAttentionCache) -> None:
    """The kernel maps exactly what the slot table says: page j of slot s is the pool's page mapped[s][j]
    (or PROT_NONE reserved address space where it is -1), no hole anywhere in the reservation, and the
    views read every mapped page's data."""
    pb, n = cache.page_bytes, cache.range.num_slots * cache.pages_per_slot
    lo = cache.range.addr
    maps = _maps(lo, lo + n * pb)
    assert maps[0][0] <= lo and maps[-1][1] >= lo + n * pb, "the reservation lost an end"
    for (_, end, *_), (start, *_) in zip(maps, maps[1:]):
        assert end == start, f"a hole in the reservation at {end:#x}"
    for i in range(n):
        addr = lo + i * pb
        start, _, perms, offset, path = next(m for m in maps if m[0] <= addr < m[1])
        block = cache.slots.mapped[i // cache.pages_per_slot][i % cache.pages_per_slot]
        if block >= 0:
            assert "prefixserve-kv" in path and perms.startswith("rw"), (i, perms, path)
            assert (offset + addr - start) // pb == block, (i, block)
        else:
            assert perms == "---p" and path == "", (i, perms, path)
    assert cache.slots.num_runs == sum(len(cache.slots.runs(s)) for s in range(cache.slots.num_slots))
    pages = cache.pages.view(cache.num_blocks, -1)
    saved = pages.clone()
    pages[:] = torch.arange(cache.num_blocks, dtype=pages.dtype)[:, None]
    virt = cache.key_virtual                                     # [L, slots, slot_len, Hkv, D]
    assert virt.data_ptr() >= lo and virt.shape[1] == cache.range.num_slots
    for s, row in enumerate(cache.slots.mapped[:cache.range.num_slots]):
        for j, b in enumerate(row):
            if b >= 0:
                assert virt[:, s, j * cache.block_size:(j + 1) * cache.block_size].eq(b).all(), (s, j, b)
    pages.copy_(saved)


def _workload(cache: VAttentionCache, first_id: int, low_limit: int = 9) -> tuple[int, int]:
    """Sharing, mapping ahead, forks past the slots (the table grows), stale slots reclaimed under a low limit,
    as the engine drives it; a refused sequence gives its slot back. Returns (steps done, sequences refused)."""
    ids = iter(range(first_id, first_id + 100))
    held: dict[int, list[int]] = {}

    def step(seqs: dict[int, tuple[list[int], int]]) -> None:
        sids = [s for s in seqs if s in held]
        if not sids:
            return
        tables = [seqs[s][0] for s in sids]
        lens = [seqs[s][1] for s in sids]
        try:
            cache.addressing(sids, tables, lens, np.arange(len(sids)), np.asarray(lens, dtype=np.int64) - 1,
                             [True] * len(sids))
        except KVRefused as exc:
            nonlocal refused
            refused += len(exc.seq_ids)
            for sid in exc.seq_ids:
                cache.slots.detach(sid)
                held.pop(sid, None)

    def attach(blocks: list[int], n: int) -> int:
        sid = next(ids)
        cache.slots.attach(sid, blocks[:n])
        held[sid] = blocks
        return sid

    refused = 0
    a = attach([0, 1, 2], 0)
    b = attach([0, 1, 5], 2)                                        # shares A's first two pages
    step({a: ([0, 1, 2], 40), b: ([0, 1, 5], 40)})
    step({a: ([0, 1, 2, 3], 48), b: ([0, 1, 5, 6], 48)})             # page 3 / 6 only ahead of need
    forks = [attach([0, 1, 2, 3], 4) for _ in range(3)]             # 5 sequences in 2 slots: the table grows
    step({s: ([0, 1, 2, 3], 49) for s in [a, b, *forks]})
    for s in [a, b, *forks]:
        cache.slots.detach(s)
        held.pop(s, None)
    cache.limit = low_limit                                         # 4 runs: the stale slots must go
    c = attach([20, 18, 16, 14], 0)
    step({c: ([20, 18, 16, 14], 64)})
    cache.slots.detach(c)
    return 4, refused


def _cache() -> VAttentionCache:
    return VAttentionCache(ARGS, 32, 16, torch.float32, "cpu", 64, 2, ahead_tokens=4, max_mappings=64)


def test_the_workload_runs_clean_and_counts_its_calls(faults: Faults) -> None:
    cache = _cache()
    faults.arm(None)
    assert _workload(cache, 0) == (4, 0)
    assert cache.failure is None and cache.slots.num_slots == 8 and cache.reclaimed_pages > 0 and cache.ahead_maps > 0
    assert faults.calls >= 20
    assert_consistent(cache)
    cache.close()


@pytest.mark.parametrize("mode", ["once", "once-hole", "from-then-on", "from-then-on-hole"])
def test_every_call_failing_leaves_the_cache_consistent_or_failed(faults: Faults, mode: str) -> None:
    faults.arm(None)
    clean = _cache()
    _workload(clean, 0)
    total = faults.calls
    clean.close()
    outcomes = {"consistent": 0, "failed": 0}
    for k in range(1, total + 1):
        cache = _cache()
        faults.arm(k, persist=mode.startswith("from"), hole=mode.endswith("hole"))
        try:
            _workload(cache, 0)
        except EngineDead:
            assert cache.failure is not None
        faults.arm(None)
        if cache.failure is not None:
            outcomes["failed"] += 1
            with pytest.raises(EngineDead, match="broken"):
                cache.addressing([0], [[0]], [1], np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), [False])
            cache.close()
            continue
        outcomes["consistent"] += 1
        assert_consistent(cache)
        cache.limit = 64
        leaked = cache.map_areas() - (2 * cache.slots.num_runs + 1)  # a range whose munmap failed stays counted
        assert _workload(cache, 1000, 9 + leaked)[1] == 0, f"call {k}: a later workload was refused"
        assert_consistent(cache)
        cache.close()
    if mode.startswith("once"):
        assert outcomes["failed"] == 0, outcomes                  # one failure is always recovered from
    else:
        assert outcomes["failed"] > 0, outcomes


def test_failing_at_startup_raises_and_leaves_nothing(faults: Faults) -> None:
    for k in (1, 2, 3):                                          # the pool's mmap, its madvise, the reservation
        faults.arm(k)
        with pytest.raises(OSError, match="injected"):
            _cache()


# -- through the engine: the same tokens after any failure ---------------------------------------------
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(12)
    p1 = [rng.randrange(3, 300) for _ in range(40)]
    return [p1, p1[:32] + [7, 8, 9]]


def test_any_failing_call_fails_one_request_at_most_and_the_next_get_the_same_tokens(
        tiny_llama_dir: Path, prompts: list[list[int]], faults: Faults) -> None:
    """n=3 forks of two prompts, shared prompt pages, pages mapped ahead; the k-th
    syscall fails (leaving a hole where it was a MAP_FIXED). The cache stays consistent, and greedy requests
    afterwards give the paged backend's tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    forks = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(prompts, greedy)]

    def make() -> LLM:
        return LLM(str(tiny_llama_dir), kv_backend="vattention", num_kv_blocks=64, max_num_seqs=3, max_model_len=128)
    faults.arm(None)
    llm = make()
    faults.arm(None)
    llm.generate(prompts, forks)
    total = faults.calls
    assert total >= 10      # (the slot table's growth fails at every step in the cache-level tests above)
    for k in range(1, total + 1):
        llm = make()
        faults.arm(k, hole=True)
        llm.generate(prompts, forks)                                 # a request may end with an error
        faults.arm(None)
        cache = vattention(llm)
        assert cache.failure is None, (k, cache.failure)
        assert_consistent(cache)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected, k
        assert_idle_and_accounted(llm)
