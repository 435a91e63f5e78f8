"""Paged prefill kernel, the backends end to end, and the torch backend, against the reference."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import paged_decode
from kernels.paged_prefill import paged_prefill
from kernels.torch_backend import TorchAttentionBackend
from kernels.triton_backend import TritonAttentionBackend
from tests.kernels.batch import TOL, PagedBatch, make_batch, pairwise, rebuild
from tests.kernels.reference import default_scale, ref_attention

# (context incl. new tokens, new tokens): a one-token prompt, a fresh 17-token prompt, a prefix hit
# (1016 cached + 9 new, crossing a block and a key-tile boundary) and a decode row in the same batch.
SEQ_LENS = [1, 17, 1025, 40]
QUERY_LENS = [1, 17, 9, 1]


def run_prefill(b: PagedBatch) -> torch.Tensor:
    out = torch.full_like(b.q, float("nan"))  # poisoned: an element the kernel skips fails the check
    return paged_prefill(b.q, b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens,
                         b.md.query_start_loc, b.md.max_query_len, default_scale(b.q.shape[2]), out=out)


def reference(b: PagedBatch) -> torch.Tensor:
    return ref_attention(b.q, b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens_list,
                         b.md.query_lens_list, default_scale(b.q.shape[2]))


@pytest.mark.parametrize("group,head_dim,block_size,dtype,num_kv_heads", pairwise(
    [1, 2, 4, 8], [32, 48, 64, 128], [1, 8, 16, 32],
    [torch.float32, torch.float16, torch.bfloat16, torch.bfloat16], [1, 2, 1, 3]))
def test_prefill_matches_reference(group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                                   num_kv_heads: int) -> None:
    b = make_batch(SEQ_LENS, QUERY_LENS, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, block_size=block_size, dtype=dtype, seed=group * 1000 + head_dim)
    # Tolerance per dtype: see TOL in batch.py (output rounding, plus fp16/bf16 softmax weights on GPU).
    torch.testing.assert_close(run_prefill(b).cpu().double(), reference(b), **TOL[dtype])


def test_prefill_long_fresh_prompt() -> None:
    # 513 new tokens with no cached prefix: many query tiles, each with its own causal bound.
    b = make_batch([513, 17], [513, 5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                   dtype=torch.float16, seed=21)
    # fp16: see TOL in batch.py.
    torch.testing.assert_close(run_prefill(b).cpu().double(), reference(b), **TOL[torch.float16])


def test_prefill_block_size_and_shuffle_invariance() -> None:
    # Metamorphic: tiles are token ranges, so block size 1 / 16 and any block order must give
    # bit-identical output (atol = rtol = 0).
    b = make_batch([300, 17, 70], [20, 17, 1], num_heads=4, num_kv_heads=2, head_dim=96, block_size=16,
                   dtype=torch.bfloat16, seed=4)
    base = run_prefill(b)
    for block_size, seed in ((1, 1), (16, 2)):
        other = rebuild(b, block_size, seed)
        assert other.tables != b.tables
        torch.testing.assert_close(run_prefill(other), base, atol=0, rtol=0)


def test_prefill_kernel_agrees_with_decode_kernel_on_decode_batch() -> None:
    b = make_batch([1, 17, 200], [1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                   dtype=torch.float32, seed=9)
    decode = paged_decode(b.q, b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens, b.md.max_seq_len,
                          default_scale(64), num_splits=2)
    # fp32 (ieee dots): the two kernels differ only in summation order, ~1e-7.
    torch.testing.assert_close(run_prefill(b), decode, atol=1e-5, rtol=1e-5)


def _end_to_end(backend, dtype: torch.dtype, seq_lens: list[int], query_lens: list[int]) -> None:
    b = make_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=48, block_size=8,
                   dtype=dtype, seed=13)
    expected = reference(b)
    kc, vc = b.key_cache.clone(), b.value_cache.clone()
    # The new tokens are not in the cache yet: their slots hold NaN until write_kv fills them.
    kc.view(-1, 2, 48)[b.md.kv_rows] = float("nan")
    vc.view(-1, 2, 48)[b.md.kv_rows] = float("nan")
    backend.write_kv(kc, vc, b.key, b.value, b.md)
    out = backend.forward(b.q, kc, vc, b.md, default_scale(48))
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    # Tolerance per dtype: see TOL in batch.py.
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype])


@pytest.mark.parametrize("seq_lens,query_lens", [([1, 17, 130], [1, 17, 20]), ([5, 17, 130], [1, 1, 1])])
def test_triton_backend_write_then_attend(seq_lens: list[int], query_lens: list[int]) -> None:
    _end_to_end(TritonAttentionBackend(), torch.float16, seq_lens, query_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_backend_write_then_attend(dtype: torch.dtype) -> None:
    _end_to_end(TorchAttentionBackend(), dtype, [1, 17, 130, 40], [1, 17, 20, 1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,seq_lens,query_lens", [
    (torch.bfloat16, [4096 + 256, 1024 + 64], [256, 64]), (torch.float16, [1024 + 64], [64])])
def test_prefill_prefix_hit_llama_shapes(dtype: torch.dtype, seq_lens: list[int], query_lens: list[int]) -> None:
    # 4K cached prefix + 256 new tokens and 1K + 64, Llama-3-8B head layout (~4 min interpreted).
    b = make_batch(seq_lens, query_lens, num_heads=32, num_kv_heads=8, head_dim=128,
                   block_size=16, dtype=dtype, seed=23)
    torch.testing.assert_close(run_prefill(b).cpu().double(), reference(b), **TOL[dtype])
