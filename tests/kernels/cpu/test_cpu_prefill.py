"""The C++ CPU paged prefill kernel (bf16 caches) against the float64 reference, within its stated
criterion (0.5% of the largest |V|); chunk invariance bit for bit; mixed steps where only some
sequences prefill; sharp attention (large scores) where the online softmax rescales often."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import paged_prefill as pp
from kernels.cpu.library import CpuKernels, load, runnable_variants
from tests.kernels.batch import PagedBatch, make_batch, pairwise
from tests.kernels.reference import default_scale, ref_attention

BF16 = [v for v in runnable_variants() if load(v).prefill.available]
pytestmark = pytest.mark.skipif(not BF16, reason="no build with AVX-512 BF16 runs on this CPU")


@pytest.fixture(params=BF16 or [None])
def k(request: pytest.FixtureRequest) -> CpuKernels:
    return load(request.param)


def run(k: CpuKernels, b: PagedBatch, seqs: list[int] | None = None, scale: float | None = None) -> torch.Tensor:
    out = torch.full(b.q.shape, float("nan"))           # poisoned: a row the kernel skips stays NaN
    seqs = list(range(len(b.md.seq_lens_list))) if seqs is None else seqs
    res = k.prefill.prefill(b.q.float().contiguous(), b.key_cache, b.value_cache, b.md.block_tables,
                            b.md.seq_lens, b.md.query_start_loc, seqs, scale or default_scale(b.q.shape[2]), out)
    assert res is not None
    return res


def within_criterion(b: PagedBatch, out: torch.Tensor, scale: float | None = None) -> float:
    ref = ref_attention(b.q.float(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens_list,
                        b.md.query_lens_list, scale or default_scale(b.q.shape[2]))
    vmax = b.value_cache.float().nan_to_num(0).abs().amax().item()
    err = (out.double() - ref).abs().max().item() / vmax
    assert err <= 0.005, err
    return err


@pytest.mark.parametrize("group,head_dim,block_size", pairwise([1, 3, 4, 8], [32, 64, 128, 64], [1, 8, 16, 32]))
def test_cpu_prefill_matches_reference(k: CpuKernels, group: int, head_dim: int, block_size: int) -> None:
    # whole prompts, chunks over a cached context (cut mid-tile and mid-block), a one-token chunk
    b = make_batch([100, 1100, 70, 9], [100, 40, 1, 9], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                   block_size=block_size, dtype=torch.bfloat16, seed=group * 100 + head_dim + block_size, device="cpu")
    within_criterion(b, run(k, b))


def test_cpu_prefill_sharp_attention(k: CpuKernels) -> None:
    # scores of tens (a large scale): the running max moves tile after tile; rounding q to bf16 is what
    # the criterion allows for
    b = make_batch([300, 257], [300, 130], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=torch.bfloat16, seed=5, device="cpu")
    within_criterion(b, run(k, b, scale=1.0), scale=1.0)


def test_cpu_prefill_computes_only_the_listed_sequences(k: CpuKernels) -> None:
    b = make_batch([50, 80, 33], [1, 20, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=torch.bfloat16, seed=3, device="cpu")
    out = run(k, b, seqs=[1])
    starts = b.md.query_start_loc.tolist()
    assert out[starts[0]:starts[1]].isnan().all() and out[starts[2]:starts[3]].isnan().all()
    assert not out[starts[1]:starts[2]].isnan().any()


def test_cpu_prefill_is_chunk_invariant_bit_for_bit(k: CpuKernels) -> None:
    # One 300-token prompt computed whole, then as chunks over its cached context cut at 1, 37, 64, 200 and
    # 299 tokens: every token's output is identical bit for bit (the criterion the prefix cache relies on).
    length = 300
    whole = make_batch([length], [length], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, seed=11, device="cpu")
    full = run(k, whole)
    for cut in (1, 37, 64, 200, 299):
        # the same cache and queries; the step computes the tokens past `cut` only (and, as a second
        # sequence on the same blocks, the tokens up to `cut` as a prompt of their own)
        q = torch.cat([whole.q[cut:], whole.q[:cut]])
        md = whole.md
        tables = torch.cat([md.block_tables, md.block_tables])
        lens = torch.tensor([length, cut], dtype=torch.int32)
        starts = torch.tensor([0, length - cut, length], dtype=torch.int32)
        out = torch.full(q.shape, float("nan"))
        res = k.prefill.prefill(q.float().contiguous(), whole.key_cache, whole.value_cache, tables, lens, starts,
                                [0, 1], default_scale(64), out)
        assert res is not None
        assert torch.equal(res[:length - cut], full[cut:]), cut
        assert torch.equal(res[length - cut:], full[:cut]), cut


def test_cpu_prefill_declines_what_it_does_not_take(k: CpuKernels) -> None:
    b = make_batch([20], [20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                   seed=1, device="cpu")
    out = torch.empty(b.q.shape)
    assert k.prefill.prefill(b.q.float(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens,
                             b.md.query_start_loc, [0], 0.125, out) is None     # float32 cache: the flash path
    assert not pp.supports(4, 2, 48, torch.bfloat16)                          # head_dim % 32 != 0
