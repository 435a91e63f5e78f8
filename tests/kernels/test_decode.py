"""Paged decode kernel (and the torch backend's decode path) against the token-by-token reference."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import paged_decode, pick_num_splits
from kernels.torch_backend import TorchAttentionBackend
from kernels.triton_backend import TritonAttentionBackend
from tests.kernels.batch import TOL, PagedBatch, make_batch, pairwise, rebuild
from tests.kernels.reference import default_scale, ref_attention

MIXED = [1, 17, 1025]  # one token, a partial second block, many blocks and tiles


def run_decode(b: PagedBatch, num_splits: int | None) -> torch.Tensor:
    out = torch.full_like(b.q, float("nan"))  # poisoned: an element the kernel skips fails the check
    return paged_decode(b.q, b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens, b.md.max_seq_len,
                        default_scale(b.q.shape[2]), num_splits=num_splits, out=out)


def reference(b: PagedBatch) -> torch.Tensor:
    return ref_attention(b.q, b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens_list,
                         b.md.query_lens_list, default_scale(b.q.shape[2]))


@pytest.mark.parametrize("group,head_dim,block_size,dtype,num_splits", pairwise(
    [1, 2, 4, 8], [32, 48, 64, 128], [1, 8, 16, 32],
    [torch.float32, torch.float16, torch.bfloat16, torch.bfloat16], [1, 2, 3, 6]))
def test_decode_matches_reference(group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                                  num_splits: int) -> None:
    b = make_batch(MIXED, [1, 1, 1], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, seed=group * 1000 + head_dim + block_size)
    out = run_decode(b, num_splits)
    # Tolerance per dtype: see TOL in batch.py (output rounding, plus fp16/bf16 softmax weights on GPU).
    torch.testing.assert_close(out.cpu().double(), reference(b), **TOL[dtype])


@pytest.mark.parametrize("num_splits", [4, 17, 40])
def test_decode_split_counts(num_splits: int) -> None:
    # 17 and 40 splits leave most splits of the short sequences (and some of the long one) empty:
    # those write max=-inf, sum=0 and must weigh nothing in the reduction (no NaN, no bias).
    b = make_batch([1, 17, 1025, 700], [1, 1, 1, 1], num_heads=4, num_kv_heads=1, head_dim=64,
                   block_size=16, dtype=torch.float32, seed=num_splits)
    # fp32 throughout: only the summation order changes with the split count (~1e-6).
    torch.testing.assert_close(run_decode(b, num_splits).cpu().double(), reference(b), **TOL[torch.float32])


def test_decode_block_size_and_shuffle_invariance() -> None:
    # Metamorphic: the kernel tiles by tokens, not blocks, so the same contents under block size 1,
    # 16 or 32, in any block order, must give bit-identical output (atol = rtol = 0).
    b16 = make_batch(MIXED, [1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=80, block_size=16,
                     dtype=torch.float16, seed=7)
    base = run_decode(b16, num_splits=3)
    for block_size, seed in ((1, 1), (16, 2), (32, 3)):
        other = rebuild(b16, block_size, seed)
        assert other.tables != b16.tables
        torch.testing.assert_close(run_decode(other, num_splits=3), base, atol=0, rtol=0)


def test_decode_gqa_heads_see_their_own_kv_head() -> None:
    # Zero every KV head but one: only that head's query group may change when its values change.
    b = make_batch([40, 9], [1, 1], num_heads=8, num_kv_heads=4, head_dim=32, block_size=8,
                   dtype=torch.float32, seed=11)
    before = run_decode(b, num_splits=1)
    b.value_cache[:, :, 2] += 1.0  # shifts every output of KV head 2's group (heads 4, 5) by exactly 1
    after = run_decode(b, num_splits=1)
    expected = before.clone()
    expected[:, 4:6] += 1.0
    # fp32: a softmax-weighted average of (v + 1) is the average of v plus 1, up to rounding.
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


def test_triton_backend_decode_uses_heuristic_splits() -> None:
    b = make_batch([1, 300, 64], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=96, block_size=16,
                   dtype=torch.bfloat16, seed=5)
    out = TritonAttentionBackend().forward(b.q, b.key_cache, b.value_cache, b.md, default_scale(96))
    # bf16: see TOL in batch.py.
    torch.testing.assert_close(out.cpu().double(), reference(b), **TOL[torch.bfloat16])


def test_pick_num_splits() -> None:
    assert pick_num_splits(1, 8, 32768, torch.device("cpu")) == 1  # CPU / interpreter: no split
    if torch.cuda.is_available() and not torch.version.hip:
        dev = torch.device("cuda")
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        assert pick_num_splits(64, 8, 32768, dev) == 1               # already > 1 program per SM
        assert pick_num_splits(1, 8, 256, dev) == 1                  # too short to split
        long = pick_num_splits(1, 8, 32768, dev)
        assert 1 < long <= 64 and 8 * long >= sms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_backend_decode_matches_reference(dtype: torch.dtype) -> None:
    # Unowned slots hold a large finite value here; the NaN variant is the next test.
    b = make_batch(MIXED, [1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=48, block_size=16,
                   dtype=dtype, seed=3, poison=1e4)
    out = TorchAttentionBackend().forward(b.q, b.key_cache, b.value_cache, b.md, default_scale(48))
    # Same TOL as the kernels (the torch path also computes in fp32 and rounds the output).
    torch.testing.assert_close(out.cpu().double(), reference(b), **TOL[dtype])


def test_torch_backend_decode_ignores_nan_in_unowned_slots() -> None:
    # decode pads every context to max_seq_len: NaN in an unowned slot must not leak in as 0 * NaN
    b = make_batch([1, 17, 40], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                   dtype=torch.float32, seed=3)
    out = TorchAttentionBackend().forward(b.q, b.key_cache, b.value_cache, b.md, default_scale(32))
    torch.testing.assert_close(out.cpu().double(), reference(b), **TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,num_splits", [(torch.bfloat16, None), (torch.float16, 8)])
def test_decode_long_contexts(dtype: torch.dtype, num_splits: int | None) -> None:
    b = make_batch([16384, 4097, 1], [1, 1, 1], num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                   dtype=dtype, seed=17)
    torch.testing.assert_close(run_decode(b, num_splits).cpu().double(), reference(b), **TOL[dtype])
