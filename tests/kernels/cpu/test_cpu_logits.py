"""The per-row logits reductions (kernels/cpu/logits.cpp) against torch's logsumexp, argmax and topk, on
strided rows, with every build this CPU runs (its generic, AVX2 or AVX-512 loops); and the sampler, which uses
them on the CPU, against torch's operators.

Agreement criterion (kernels/cpu/logits.py): argmax equal to torch.argmax's index exactly, the first of equal
maxima included; logsumexp within float32 rounding, with torch's special values for NaN / +inf / all -inf
rows; topk the same set of indices as torch.topk where the k-th and (k+1)-th values differ, the earlier
index where they tie, never a NaN; row_sample the token whose float64 CDF interval of softmax(x / temperature)
holds u (within 1e-6 of a boundary either neighbour), never a token of zero probability, and torch's path's
token on all but a rounding few of the draws.
"""
from __future__ import annotations

import pytest
import torch

from engine.sample.sampler import Sampler
from engine.sequence import SamplingParams
from kernels.cpu.library import CpuKernels
from kernels.ops import KernelConfig, Ops


def strided(rows: int, width: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + 40, generator=g) * scale)[:, 8:8 + width]


@pytest.mark.parametrize("width", [7, 16, 49152, 1001])
def test_row_stats_equal_torch(variant: CpuKernels, width: int) -> None:
    x = strided(13, width, seed=width)
    x[1, width // 2] = x[1].max() + 1
    x[1, width - 1] = x[1, width // 2]                      # a tie for the maximum: the first index wins
    x[2] = 5.0                                              # a row of equal values: index 0
    x[3, :] = float("-inf")
    x[4, width // 3] = float("inf")
    x[5, width - 1] = float("nan")
    x[6, 0] = float("-inf")
    lse, arg = variant.logits.row_stats(x)
    want_lse, want_arg = torch.logsumexp(x, dim=-1), x.argmax(dim=-1)
    plain = [r for r in range(13) if r != 5]                # a NaN row: only its lse is promised (NaN)
    assert arg[plain].tolist() == want_arg[plain].tolist()
    assert arg[1].item() == width // 2 and arg[2].item() == 0
    assert lse[3].item() == float("-inf") and lse[4].item() == float("inf") and torch.isnan(lse[5])
    finite = [r for r in plain if r not in (3, 4)]
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 16, 64])
def test_row_topk_equal_torch(variant: CpuKernels, dtype: torch.dtype, k: int) -> None:
    x = strided(9, 4099, seed=k).to(dtype)
    x[2, 100:300] = x[2].max() + 1                          # 200 equal maxima: the first k of them
    x[3, ::7] = float("nan")                                # NaN never displaces a number
    got = variant.logits.row_topk(x, k)
    assert got.shape == (9, k) and got.dtype == torch.int64
    for r in range(9):
        row, vals = got[r].tolist(), x[r].float().nan_to_num(float("-inf"))
        assert len(set(row)) == k
        kth = vals[row].min()
        above = (vals > kth).nonzero().flatten().tolist()
        tied = (vals == kth).nonzero().flatten().tolist()
        assert set(above) <= set(row)                                       # everything larger is in
        assert sorted(set(row) - set(above)) == tied[:k - len(above)]       # of the ties, the first ones
        assert torch.equal(vals[row].sort().values, vals.topk(k).values.sort().values)   # torch's values
    assert sorted(got[2].tolist()) == list(range(100, 100 + k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 40])
def test_refine_writes_exact_logits_at_the_chosen_entries_only(variant: CpuKernels, dtype: torch.dtype,
                                                               hidden: int) -> None:
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3000, hidden + 8, generator=g)[:, :hidden]).to(dtype)   # strided rows, as a slice would be
    x = strided(11, hidden, 6, scale=1.0)
    logits = torch.full((11, 3000), -7.0)
    top = torch.stack([torch.randperm(3000, generator=g)[:32] for _ in range(11)])
    got = variant.logits.refine(logits.clone(), top, x.contiguous(), w)
    exact = x @ w.float().T
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    untouched = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert (got[untouched] == -7.0).all()


def test_sampler_on_the_kernel_equals_torch(cpu: CpuKernels) -> None:
    """The sampler's tokens and log-probabilities with the kernel equal those of torch's operators."""
    logits = strided(40, 4096, seed=3)
    logits[7, 11] = logits[7].max() + 3
    logits[7, 12] = logits[7, 11]                           # a greedy tie: the first index, as torch.argmax
    logits[9, 5] = float("nan")                             # a broken row: reported, the others untouched
    params = [SamplingParams(temperature=0.0, logprobs=3) if i % 2 else SamplingParams(temperature=0.9, seed=i)
              for i in range(40)]

    def run(ops: Ops) -> tuple[list[int], list[float], list[dict[int, float]], list[int]]:
        out = Sampler(ops)(logits.clone(), params, [torch.Generator().manual_seed(i) for i in range(40)])
        return out.token_ids, out.logprobs, out.top_logprobs or [], out.failed

    with_kernel = Ops(KernelConfig(cpu_kernels=cpu.variant))
    assert with_kernel.row_stats(logits)[1] is not None                    # the kernel's argmax comes along
    ids, logprobs, tops, failed = run(with_kernel)
    assert ids[7] == 11 and failed == [9]
    want_ids, want_logprobs, want_tops, want_failed = run(Ops(KernelConfig(cpu_kernels="none")))   # torch's ops
    assert ids == want_ids and failed == want_failed
    good = [i for i in range(40) if i != 9]
    torch.testing.assert_close(torch.tensor(logprobs)[good], torch.tensor(want_logprobs)[good], rtol=0, atol=1e-5)
    for a, b in zip(tops, want_tops):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)


def _reference_draw(x: torch.Tensor, temperature: float, u: float) -> tuple[int, torch.Tensor]:
    """The sampler's torch path for one row (softmax, float64 cumsum, searchsorted) and the float64 CDF."""
    probs = torch.softmax(x / temperature, dim=-1)
    cdf = probs.double().cumsum(-1)
    total = cdf[-1:]
    choice = torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64) * total, right=True)
    choice = torch.minimum(choice, torch.searchsorted(cdf, total))
    exact = torch.softmax(x.double() / temperature, dim=-1).cumsum(-1)
    return int(choice), exact


@pytest.mark.parametrize("width", [7, 49152, 1001, 70001])
def test_row_sample_draws_by_the_cdf(variant: CpuKernels, width: int) -> None:
    x = strided(24, width, seed=width)
    x[3, : width // 2] = float("-inf")                      # masked tokens (a logit bias, a grammar): never drawn
    g = torch.Generator().manual_seed(width)
    u = torch.rand(24, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2**-53                          # both ends of [0, 1)
    temperature = torch.linspace(0.3, 1.7, 24)
    got = variant.logits.row_sample(x, temperature, u)
    same = 0
    for t in range(24):
        want, cdf = _reference_draw(x[t], float(temperature[t]), float(u[t]))
        c = int(got[t])
        assert 0 <= c < width and torch.isfinite(x[t, c])
        lo = float(cdf[c - 1]) if c else 0.0
        assert lo - 1e-6 <= float(u[t]) <= float(cdf[c]) + 1e-6, (t, c, lo, float(u[t]), float(cdf[c]))
        same += c == want
    assert same >= 23                                       # torch's token but for a rounding case at most
    assert int(got[3]) >= width // 2


def test_row_sample_draws_follow_the_distribution(variant: CpuKernels) -> None:
    """4,000 draws from one row of 6 tokens: each token's share within 4 sigma of its probability."""
    x = torch.tensor([[0.0, 1.0, 2.0, -1.0, float("-inf"), 0.5]]).expand(4000, 6).contiguous()
    u = torch.rand(4000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = variant.logits.row_sample(x, torch.full((4000,), 0.8), u)
    p = torch.softmax(x[0] / 0.8, dim=-1)
    counts = torch.bincount(got, minlength=6).double() / 4000
    assert counts[4] == 0
    assert ((counts - p.double()).abs() <= 4 * (p.double() * (1 - p.double()) / 4000).sqrt() + 1e-9).all()


def test_sampler_fused_draw_equals_torch_path(cpu: CpuKernels) -> None:
    """Temperature rows with no filter draw through the kernel; their tokens equal torch's path (but for a
    rounding case), filtered rows keep torch's path, and a request's stream does not depend on its batch."""
    logits = strided(48, 4096, seed=5)
    params = [SamplingParams(temperature=0.7 + i / 100, seed=i) if i % 3 else
              SamplingParams(temperature=0.9, top_p=0.8, seed=i) for i in range(48)]
    gens = [torch.Generator().manual_seed(i) for i in range(48)]
    fused = Sampler(Ops(KernelConfig(cpu_kernels=cpu.variant)))(logits.clone(), params, gens).token_ids
    gens = [torch.Generator().manual_seed(i) for i in range(48)]
    plain = Sampler(Ops(KernelConfig(cpu_kernels="none")))(logits.clone(), params, gens).token_ids
    assert sum(a == b for a, b in zip(fused, plain)) >= 47
    alone = Sampler(Ops(KernelConfig(cpu_kernels=cpu.variant)))(
        logits[5:6].clone(), params[5:6], [torch.Generator().manual_seed(5)]).token_ids
    assert alone == [fused[5]]
