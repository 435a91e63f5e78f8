"""The CPU attention backend on mixed steps (decode rows, prefill chunks with and without a cached
context) against the token-by-token float64 reference, float32 and bfloat16 caches, with the C++
kernels and with their torch fallback."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import paged_decode
from kernels.cpu.library import CpuKernels, KernelUnavailable, load
from kernels.cpu.paged_prefill import BF16_PATHS, I16_PATHS
from kernels.cpu_backend import CpuAttentionBackend, extend_attention
from kernels.torch_backend import TorchAttentionBackend
from tests.kernels.batch import make_batch
from tests.kernels.reference import default_scale, ref_attention

CASES = [  # (seq_lens, query_lens): decode only, prefill only, a chunk over a cached context, all mixed
    ([1, 17, 300], [1, 1, 1]),
    ([40], [40]),
    ([70, 33], [30, 33]),
    ([1, 90, 17, 301, 64], [1, 1, 17, 45, 3]),
]


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cpu_backend_matches_reference(case: int, dtype: torch.dtype, compiled: bool) -> None:
    seq_lens, query_lens = CASES[case]
    b = make_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                   seed=case, device="cpu")
    try:
        backend = CpuAttentionBackend(load() if compiled else None)
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    q = b.q.float()
    out = backend.forward(q, b.key_cache, b.value_cache, b.md, default_scale(64))
    expected = ref_attention(q, b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens_list,
                             b.md.query_lens_list, default_scale(64))
    # float32 products over the same cache values (bf16-rounded where the cache is bf16): float32 rounding
    # only; except over a bf16 cache with the C++ kernels on a build with AVX-512 BF16 (or AMX): prefill rows
    # (kernels/cpu/paged_prefill.py) and decode rows (kernels/cpu/paged_decode.py) take bf16 products, within 0.5%
    # of the largest |V| (BF16_PATHS: an AMX build's decode too, whose path is "amx"); and prefill rows on an
    # AVX-512 VNNI build, int16 products, within the same
    prefill = torch.tensor([b.md.is_prefill(i) for i, q_len in enumerate(query_lens) for _ in range(q_len)])
    tight = torch.ones_like(prefill)
    if compiled and load().prefill.path(dtype) in BF16_PATHS + I16_PATHS:
        tight &= ~prefill
    if compiled and dtype == torch.bfloat16 and load().decode.path in BF16_PATHS:
        tight &= prefill
    torch.testing.assert_close(out.double()[tight], expected[tight], atol=2e-5, rtol=2e-5)
    vmax = b.value_cache.float().nan_to_num(0).abs().amax().item()
    assert (out.double() - expected).abs().max().item() <= 0.005 * vmax


def test_a_chunk_attends_as_if_its_prompt_were_computed_whole() -> None:
    """Metamorphic: the last rows of a prompt attended as a chunk over the cached context are bit-identical
    to the same rows of the whole prompt attended in one call, for every split point (what lets a request
    that hits another's blocks get the answer it would have computed itself)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(50, 8, 32, generator=gen)
    k, v = torch.randn(50, 2, 32, generator=gen), torch.randn(50, 2, 32, generator=gen)
    whole = extend_attention(q, k, v, 0.2)
    mask = torch.arange(50)[None, :] <= torch.arange(50)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1), v.repeat_interleave(4, 1).transpose(0, 1),
        attn_mask=mask, scale=0.2).transpose(0, 1)
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
    for n in range(1, 51):
        torch.testing.assert_close(extend_attention(q[-n:], k, v, 0.2), whole[-n:], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_layer_in_one_call_equals_write_then_attend(cpu: CpuKernels, dtype: torch.dtype) -> None:
    """The fused decode call (write this step's K/V rows in C++, then attend) leaves the caches bit-identical
    to torch's write (bf16 rounding to nearest even included) and gives the same output; K and V may be
    strided views (V is a slice of the fused QKV projection in the model)."""
    backend = CpuAttentionBackend(cpu)
    b = make_batch([5, 17, 300], [1, 1, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                   seed=11, poison=0.0, device="cpu")
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 6 * 64 + 2 * 2 * 64, generator=gen)
    q = qkv[:, :384].reshape(3, 6, 64).contiguous()
    k = qkv[:, 384:512].reshape(3, 2, 64) * 1.5           # a new tensor (rotated K in the model)
    v = qkv[:, 512:].view(3, 2, 64)                        # a strided view of the projection
    assert v.stride(0) != k.stride(0)
    kc1, vc1, kc2, vc2 = (c.clone() for c in (b.key_cache, b.value_cache, b.key_cache, b.value_cache))
    fused = backend.attend(q, k, v, kc1, vc1, b.md, 0.125)
    b.md.scratch.clear()
    TorchAttentionBackend.write_kv(backend, kc2, vc2, k, v, b.md)                  # torch's own write
    apart = backend.forward(q, kc2, vc2, b.md, 0.125)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    torch.testing.assert_close(fused, apart, atol=0, rtol=0)


def test_a_mixed_step_plans_its_decode_rows_once_for_all_its_layers(cpu: CpuKernels,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode rows of a step that also holds prompt chunks are planned by the first layer and the plan is
    kept in the step's scratch (numpy, ~0.2 ms for 40 sequences: 30 layers would pay it 30 times); each layer's
    output (its own queries and caches) equals what a step's first layer gives."""
    seq_lens, query_lens = CASES[3]
    b = make_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=torch.bfloat16, seed=20, poison=0.0, device="cpu")
    layers = [(b.q.float() * (1 + i), b.key_cache * (1 - i / 4), b.value_cache * (1 + i)) for i in range(3)]
    calls = []
    real_plan = paged_decode.plan
    monkeypatch.setattr(paged_decode, "plan", lambda *a, **k: calls.append(1) or real_plan(*a, **k))
    backend = CpuAttentionBackend(cpu)
    outs = [backend.forward(q, kc, vc, b.md, 0.125) for q, kc, vc in layers]
    assert len(calls) == 1
    for (q, kc, vc), out in zip(layers, outs):
        b.md.scratch.clear()
        torch.testing.assert_close(out, backend.forward(q, kc, vc, b.md, 0.125), atol=0, rtol=0)
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_kv_write_equals_torchs_bit_for_bit(cpu: CpuKernels, dtype: torch.dtype) -> None:
    """The backend's write of a step's rows (every row of a mixed step: the C++ kernel's write) leaves the caches
    as torch's conversion and index_copy do, bit for bit (rounding to nearest even at ties, infinities,
    overflow and -0 included; a NaN as a NaN), rows in any order, K and V strided views of one projection."""
    backend = CpuAttentionBackend(cpu)
    b = make_batch([90, 33, 301, 5], [30, 33, 45, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=dtype, seed=3, poison=0.0, device="cpu")
    t = b.md.kv_rows.shape[0]
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(t, 2 * 2 * 64 + 8, generator=gen)
    kv.view(-1)[:64] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), float("nan"), float("inf"),
                                     float("-inf"), 3e38, -0.0] * 8)       # ties, NaN, infinities, overflow, -0
    k, v = kv[:, :128].view(t, 2, 64), kv[:, 136:].view(t, 2, 64)
    kc1, vc1, kc2, vc2 = (c.clone() for c in (b.key_cache, b.value_cache, b.key_cache, b.value_cache))
    backend.write_kv(kc1, vc1, k, v, b.md)
    TorchAttentionBackend.write_kv(backend, kc2, vc2, k, v, b.md)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for ours, torchs in ((kc1, kc2), (vc1, vc2)):
        nan = torchs.isnan()              # a NaN stays a NaN (torch's bfloat16 one is 0xffff, the kernel's 0x7fc0)
        assert torch.equal(ours.isnan(), nan) and int(nan.sum()) == (8 if ours is kc1 else 0)
        assert torch.equal(ours.view(bits)[~nan], torchs.view(bits)[~nan])
    assert not torch.equal(kc1, b.key_cache)                                # it wrote something
