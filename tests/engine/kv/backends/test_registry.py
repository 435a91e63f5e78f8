"""The KV-backend seam: a backend registered from outside the engine (a test folder, one `register` call)
serves the engine's parity test, and the engine and the metrics carry its figures without naming it.

The test backend, "mirrored", stores block b at row num_blocks - 1 - b of its tensors and prefers high
block ids for the blocks it is given: addressing, block copies and placement are all its own, so a
mistake in any of the seams shows up as wrong tokens, a leak, or blocks not where it asked.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv import backends
from engine.kv.backends.base import Addressing, CacheSpec, KVBackend, KVStat, KVStore, StepTables
from engine.kv.backends.paged.cache import PagedKVCache
from engine.models.llama import ModelArgs
from kernels import Attention
from kernels.ops import Ops
from tests.engine.test_parity import run


class _HighFirst:
    """Placement: asks for the highest block ids (the pool's LRU would hand out low ones first)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.attached: set[int] = set()

    def attach(self, seq_id: int, block_ids: list[int]) -> int:
        self.attached.add(seq_id)
        return 0

    def detach(self, seq_id: int) -> None:
        self.attached.discard(seq_id)

    def preferred(self, seq_id: int, index: int) -> int | None:
        return self.num_blocks - 1 - index


class MirroredCache(PagedKVCache):
    """A paged cache whose block b lives at row num_blocks - 1 - b."""

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.placement = _HighFirst(spec.num_blocks)
        self.steps = 0

    def _row(self, block_ids: np.ndarray) -> np.ndarray:
        return self.num_blocks - 1 - block_ids

    def addressing(self, seq_ids: list[int], tables: StepTables, seq_lens: list[int],
                   seq_of_token: np.ndarray, positions: np.ndarray, decoding: list[bool]) -> Addressing:
        self.steps += 1
        mirrored = StepTables.from_lists([self._row(np.asarray(t, dtype=np.int64)).tolist() for t in tables])
        return super().addressing(seq_ids, mirrored, seq_lens, seq_of_token, positions, decoding)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks([(self.num_blocks - 1 - s, self.num_blocks - 1 - d) for s, d in pairs])

    def stats(self, blocks_of: Callable[[int], int]) -> dict[str, KVStat]:
        return {"steps": KVStat("counter", self.steps, "Steps addressed by the mirrored cache")}


def _create(spec: CacheSpec) -> KVStore:
    return MirroredCache(spec)


def _attention(kernels: str, ops: Ops) -> Attention:
    return backends.get("paged").attention(kernels, ops)


def _block_size(args: ModelArgs, dtype: torch.dtype, requested: int) -> int:
    return max(requested, 2)                       # its own rule: never below 2


@pytest.fixture
def mirrored() -> Iterator[str]:
    backends.register(KVBackend("mirrored", _create, _attention, _block_size))
    try:
        yield "mirrored"
    finally:
        backends.unregister("mirrored")


def test_a_registered_backend_passes_the_parity_test(reference, mirrored: str) -> None:
    path, prompts, expected = reference
    llm = LLM(str(path), kv_backend=mirrored, block_size=1, num_kv_blocks=2048, max_num_batched_tokens=64)
    assert llm.engine.core.block_size == 2                                 # the backend's block-size rule
    assert run(llm, prompts) == expected                                   # cold
    hits = llm.stats().prefix_cache_hit_tokens_total
    assert run(llm, prompts) == expected                                   # warm: prefix-cache hits
    st = llm.stats()
    assert st.prefix_cache_hit_tokens_total > hits
    assert st.kv_blocks_used == 0
    assert st.kv_backend == "mirrored" and st.kv_backend_stats["steps"].value > 0


def test_a_registered_backend_places_blocks_and_copies_on_write(tiny_llama_dir: Path, mirrored: str) -> None:
    """n > 1 forks share a partial block and copy it on the first write (copy_blocks through the backend);
    the samples equal the paged backend's, and the blocks come from the top of the pool as it asked."""
    prompt = list(range(5, 14))
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=9, ignore_eos=True)
    paged = LLM(str(tiny_llama_dir), block_size=2, num_kv_blocks=64)
    llm = LLM(str(tiny_llama_dir), kv_backend=mirrored, block_size=2, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("r", prompt, params)
    engine.step()
    table = engine.core.manager.block_table(next(iter(engine.core.scheduler.running)).seq_id)
    assert min(table) >= 64 - 16, table                                    # placement was honoured
    while engine.has_unfinished():
        engine.step()
    want = [o.token_ids for o in paged.generate([prompt], params)[0].outputs]
    got = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
    assert got == want
    assert llm.stats().kv_blocks_used == 0


def test_unknown_and_builtin_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV backend"):
        backends.get("nope")
    with pytest.raises(ValueError, match="built in"):
        backends.register(KVBackend("paged", _create, _attention, _block_size))
    with pytest.raises(ValueError, match="kv_backend must be one of"):
        LLM(None, kv_backend="nope")
