"""The C++ CPU paged decode kernel against the token-by-token float64 reference: GQA groups, head dims,
block sizes, float32 and bfloat16 caches, split counts; metamorphic block-size and split invariance;
its threads are torch's."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu.build import available, load
from kernels.cpu.paged_decode import paged_decode, pick_splits
from tests.kernels.batch import PagedBatch, make_batch, pairwise, rebuild
from tests.kernels.reference import default_scale, ref_attention

pytestmark = pytest.mark.skipif(not available("paged_decode"), reason="no C++ compiler to build the CPU kernels")

MIXED = [1, 17, 1025]


def run(b: PagedBatch, splits: int | None = None) -> torch.Tensor:
    out = torch.full(b.q.shape, float("nan"))           # poisoned: an element the kernel skips fails the check
    return paged_decode(b.q.float().contiguous(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens,
                        b.md.max_seq_len, default_scale(b.q.shape[2]), out=out, num_splits=splits)


def reference(b: PagedBatch) -> torch.Tensor:
    return ref_attention(b.q.float(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens_list,
                         b.md.query_lens_list, default_scale(b.q.shape[2]))


@pytest.mark.parametrize("group,head_dim,block_size,dtype,splits", pairwise(
    [1, 3, 4, 8], [32, 48, 64, 128], [1, 8, 16, 32], [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16],
    [1, 2, 3, 6]))
def test_cpu_decode_matches_reference(group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                                      splits: int) -> None:
    b = make_batch(MIXED, [1, 1, 1], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, seed=group * 1000 + head_dim + block_size, device="cpu")
    # The reference reads the same (bf16-rounded) cache values in float64; the kernel accumulates in float32:
    # only summation order and float32 rounding differ (~1e-6 relative), whatever the cache dtype.
    torch.testing.assert_close(run(b, splits).double(), reference(b), atol=2e-5, rtol=2e-5)


def test_cpu_decode_is_invariant_to_block_layout() -> None:
    # Metamorphic: the same contents under block sizes 1, 16 and 32, in other random block orders, with one
    # split, give bit-identical output when the blocks partition the tokens the same way... they do not
    # (block boundaries change the online-softmax rescaling points), so: equal within float32 rounding.
    b16 = make_batch(MIXED, [1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.bfloat16, seed=7, device="cpu")
    base = run(b16, 1)
    for block_size, seed in ((1, 1), (16, 2), (32, 3)):
        other = rebuild(b16, block_size, seed)
        assert other.tables != b16.tables
        torch.testing.assert_close(run(other, 1), base, atol=1e-5, rtol=1e-5)
    same = rebuild(b16, 16, 9)                                   # same block size, another order: identical
    torch.testing.assert_close(run(same, 1), base, atol=0, rtol=0)


@pytest.mark.parametrize("splits", [4, 17, 40])
def test_cpu_decode_many_splits_leave_no_trace(splits: int) -> None:
    # 17 and 40 splits leave most splits of the short sequences empty: they must weigh nothing (no NaN).
    b = make_batch([1, 17, 1025, 700], [1, 1, 1, 1], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                   dtype=torch.float32, seed=splits, device="cpu")
    torch.testing.assert_close(run(b, splits).double(), reference(b), atol=2e-5, rtol=2e-5)


def test_cpu_decode_reads_a_layer_slice_of_the_cache() -> None:
    """The engine passes key[layer] of a [layers, blocks, block_size, Hkv, D] cache: strided, not a copy."""
    b = make_batch([5, 40], [1, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.bfloat16,
                   seed=3, device="cpu")
    kc = torch.stack([torch.randn_like(b.key_cache, dtype=torch.float32).bfloat16(), b.key_cache])
    vc = torch.stack([torch.randn_like(b.value_cache, dtype=torch.float32).bfloat16(), b.value_cache])
    out = paged_decode(b.q.float().contiguous(), kc[1], vc[1], b.md.block_tables, b.md.seq_lens, b.md.max_seq_len,
                       default_scale(64))
    torch.testing.assert_close(out.double(), reference(b), atol=2e-5, rtol=2e-5)


def test_splits_fill_the_threads_and_the_kernel_uses_torchs() -> None:
    assert pick_splits(1, 3, 128, 2) == 4 and pick_splits(64, 3, 128, 2) == 1 and pick_splits(1, 3, 4, 2) == 1
    lib = load("paged_decode")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert lib.prefixserve_num_threads() == 1               # one OpenMP runtime: torch's
    finally:
        torch.set_num_threads(before)
    assert lib.prefixserve_num_threads() == before
