"""The compiled decode step (engine/worker/compiled_decode.py): the same tokens and log-probabilities as the
eager model, padded rows that write nothing, eager fallback past the buckets and on failure."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.compiled_decode import CompiledDecode
from kernels import AttentionMetadata

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 3]]


@pytest.fixture(scope="module")
def compiled(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), compile_decode=True, max_num_seqs=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def eager(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_num_seqs=4, num_kv_blocks=64)


def test_compiled_decode_equals_eager(compiled: LLM, eager: LLM) -> None:
    runner = compiled.engine.core.runner
    assert runner.compiled is not None and runner.compiled.buckets == [1, 2, 4]
    assert runner.compiled.failed is None
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    before = runner.compiled.steps
    for batch in (PROMPTS, PROMPTS[:1]):                      # 3 rows padded to bucket 4, then bucket 1
        got, want = compiled.generate(batch, params), eager.generate(batch, params)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert lg.keys() == lw.keys()
                assert max(abs(lg[t] - lw[t]) for t in lg) < 1e-4
    assert runner.compiled.steps - before >= 2 * 11           # every decode step of both batches ran compiled
    pool = compiled.engine.core.pool
    assert pool.num_free == pool.num_blocks_total             # nothing leaked


def test_padded_rows_write_no_kv(compiled: LLM) -> None:
    """A batch of 3 runs in bucket 4: exactly the real rows are written, the padding row nowhere."""
    core = compiled.engine.core
    core.reset_prefix_cache()                                 # no cached block: every prompt row is written
    key, value = core.kv_cache.layers()
    key.fill_(123.0)
    value.fill_(123.0)
    compiled.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    written = ((key != 123.0) | (value != 123.0)).flatten(3).any(-1)           # [layers, blocks, block_size]
    # each prompt's rows at prefill, then one decode step (compiled, bucket 4) stores each first token
    assert written.sum(dim=(1, 2)).tolist() == [sum(len(p) + 1 for p in PROMPTS)] * key.shape[0]
    assert core.runner.compiled is not None and core.runner.compiled.failed is None


def test_fits_only_decode_batches_within_the_buckets(compiled: LLM) -> None:
    cd = compiled.engine.core.runner.compiled
    assert cd is not None

    def md(query_lens: list[int]) -> AttentionMetadata:
        n = len(query_lens)
        return AttentionMetadata(torch.zeros(n, dtype=torch.long), torch.zeros((n, 1), dtype=torch.int32),
                                 torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32),
                                 [5] * n, query_lens, max(query_lens), 5)
    assert cd.fits(md([1, 1, 1, 1]))
    assert not cd.fits(md([1] * 5))                           # over the largest bucket: eager
    assert not cd.fits(md([1, 4]))                            # a prefill chunk in the batch: eager


def test_a_failing_compiled_step_falls_back_to_eager(tiny_llama_dir: Path, eager: LLM) -> None:
    llm = LLM(str(tiny_llama_dir), compile_decode=True, max_num_seqs=1, num_kv_blocks=64)
    cd = llm.engine.core.runner.compiled
    assert isinstance(cd, CompiledDecode) and cd.buckets == [1]

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("injected compiler failure")
    cd._layer = broken
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert got == eager.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert cd.failed is not None and "injected" in cd.failed and cd.steps == 0


def test_compile_decode_is_refused_off_the_cpu(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="CPU only"):
        LLM(str(tiny_llama_dir), compile_decode=True, device="cuda")
