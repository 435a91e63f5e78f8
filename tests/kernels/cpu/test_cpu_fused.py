"""The fused elementwise kernels (kernels/cpu/fused.cpp) against the model's own torch ops, on strided rows;
and the quantized model's fast path (one C++ pass a row between its matmuls) against its layer-by-layer
path on a tiny checkpoint.

Agreement criterion: float32 results within float32 rounding (the kernels sum in another order); bfloat16
results within one bfloat16 step of the float32 value rounded (the rounding of a value that float32 sums
put on either side of a bfloat16 midpoint may differ).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from kernels.cpu.library import CpuKernels
from kernels.ops import KernelConfig, Ops, apply_rotary

REFERENCE = Ops(KernelConfig(cpu_kernels="none"))          # the torch implementations, the reference here

BF16_STEP = 2.0 ** -7                 # one bfloat16 step, relative (8 significant bits)


def close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_STEP, atol=1e-6)
    assert (got.float() == want.float()).float().mean() > 0.99      # off by a step only at rare midpoints


def strided(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, width] with a row stride wider than the row (a slice of a wider buffer), as the engine passes."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + 24, generator=g) * 3).to(dtype)[:, 8:8 + width]


def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in float32."""
    return REFERENCE.rms_norm(x, w, eps, mixed=False)


@pytest.mark.parametrize("rows", [1, 3, 200])
def test_rms_norm_and_add_rms_norm(variant: CpuKernels, rows: int) -> None:
    fused = variant.fused
    w, eps = torch.rand(576) + 0.5, 1e-5
    x = strided(rows, 576, torch.float32, rows)
    close_bf16(fused.rms_norm(x, w, eps), norm(x, w, eps).to(torch.bfloat16))
    close_bf16(REFERENCE.rms_norm(x, w, eps, mixed=True), norm(x, w, eps).to(torch.bfloat16))   # the fallback
    r = strided(rows, 576, torch.bfloat16, rows + 1)
    x2 = x.clone()
    y = fused.add_rms_norm(x2, r, w, eps)
    assert torch.equal(x2, x + r.float())                         # the residual, updated in place, exact
    close_bf16(y, norm(x + r.float(), w, eps).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 5, 130])
def test_qkv_rope_splits_and_rotates(variant: CpuKernels, rows: int) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = strided(rows, (heads + 2 * kv_heads) * head_dim, torch.bfloat16, rows)
    angles = torch.rand(rows, head_dim // 2) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    q, k, v = variant.fused.qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim)
    x = qkv.float()
    wq = x[:, :heads * head_dim].reshape(rows, heads, head_dim)
    wk = x[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    wv = x[:, (heads + kv_heads) * head_dim:].reshape(rows, kv_heads, head_dim)
    torch.testing.assert_close(q, apply_rotary(wq, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, apply_rotary(wk, cos, sin), rtol=1e-6, atol=1e-6)
    assert torch.equal(v, wv)
    fq, fk, fv = REFERENCE.qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim, mixed=True)   # the fallback
    torch.testing.assert_close(fq, q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fk, k, rtol=1e-6, atol=1e-6)
    assert torch.equal(fv, v)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_silu_mul(variant: CpuKernels, rows: int) -> None:
    gate_up = strided(rows, 2 * 1536, torch.bfloat16, rows)
    g, u = gate_up.float().chunk(2, dim=-1)
    close_bf16(variant.fused.silu_mul(gate_up), (F.silu(g) * u).to(torch.bfloat16))
    close_bf16(REFERENCE.silu_mul(gate_up, mixed=True), (F.silu(g) * u).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 9, 130])
def test_float32_activations(variant: CpuKernels, rows: int) -> None:
    """A step whose matmuls are float32 GEMMs keeps its activations float32 (Ops.step_act): each kernel takes and
    gives float32 there, within float32 rounding of the formula, and the residual is updated exactly."""
    fused = variant.fused
    w, eps = torch.rand(576) + 0.5, 1e-5
    x = strided(rows, 576, torch.float32, rows)
    y = fused.rms_norm(x, w, eps, torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, norm(x, w, eps), rtol=1e-5, atol=1e-6)
    r = strided(rows, 576, torch.float32, rows + 1)
    x2 = x.clone()
    y = fused.add_rms_norm(x2, r, w, eps)
    assert y.dtype == torch.float32 and torch.equal(x2, x + r)
    torch.testing.assert_close(y, norm(x + r, w, eps), rtol=1e-5, atol=1e-6)
    gate_up = strided(rows, 2 * 1536, torch.float32, rows + 2)
    g, u = gate_up.chunk(2, dim=-1)
    got = fused.silu_mul(gate_up)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.silu(g) * u, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(REFERENCE.silu_mul(gate_up, mixed=True), got, rtol=1e-5, atol=1e-6)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = strided(rows, (heads + 2 * kv_heads) * head_dim, torch.float32, rows + 3)
    emb = torch.rand(rows, head_dim // 2).repeat(1, 2) * 100
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    q, k, v = fused.qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim)
    fq, fk, fv = REFERENCE.qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim, mixed=True)
    torch.testing.assert_close(q, fq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, fk, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, fv)


def test_step_activations_follow_the_dense_gemm() -> None:
    """float32 between the matmuls exactly where the step takes a float32 dense GEMM or the C++ int4 GEMM;
    bfloat16 for torch's int4 / int8 kernels' steps and in the batch-invariant mode."""
    import kernels.quant_gemm as qg
    ops = Ops(KernelConfig())
    wide = torch.float32 if qg.DENSE_DTYPE == torch.float32 else torch.bfloat16
    assert ops.step_act(qg.DENSE_FROM_ROWS, prefill=False) == wide
    assert ops.step_act(1, prefill=True) == wide
    narrow = torch.float32 if ops.narrow_int4 or ops.own_wide_step(False, 1) else torch.bfloat16
    assert ops.step_act(1, prefill=False) == narrow
    # the C++ int4 GEMMs where the dense GEMM is float32; gemm_wide's AVX-512 loops take decode steps from
    # WIDE512_FROM_ROWS rows, and torch's int4 kernel the narrower ones; gemm_q16 every decode step (from 1 row)
    own = qg.DENSE_DTYPE == torch.float32 and ops.cpu is not None
    wide512 = own and ops.cpu is not None and ops.cpu.int4.wide_path == "avx512"
    assert ops.narrow_int4 == (own and not wide512)
    q16 = wide512 and ops.cpu is not None and ops.cpu.int4.has_q16      # and with VNNI, gemm_q16, prompt chunks too
    assert ops.wide_int4_q16 == q16
    assert ops.own_wide_from == (qg.Q16_FROM_ROWS if q16 else qg.WIDE512_FROM_ROWS if wide512 else qg.DENSE_FROM_ROWS)
    assert (ops.step_act(1, prefill=False) == torch.float32) == (ops.narrow_int4 or q16)
    assert ops.own_wide_step(False, ops.own_wide_from) == own and not ops.own_wide_step(False, ops.own_wide_from - 1)
    assert ops.own_wide_step(True, 1) == ops.own_wide_step(True, 4096) == q16
    assert ops.step_act(ops.own_wide_from, prefill=False) == wide
    assert not Ops(KernelConfig(int16_activations=False)).own_wide_step(True, 4096)
    assert Ops(KernelConfig(batch_invariant=True)).step_act(4096, prefill=True) == torch.bfloat16


def test_the_c_kernels_agree_with_the_torch_ops_in_the_model(tiny_llama_dir: Path, cpu: CpuKernels) -> None:
    """The same quantized model, the same prompts, greedy: the op layer on the C++ kernels (the default on the
    CPU) against the same op layer on its torch implementations (cpu_kernels none), prefill and decode steps:
    every first-step log-probability within 0.05 (bfloat16 rounding placed elsewhere) and the first tokens
    equal."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(3, 60))]
    fast = LLM(str(tiny_llama_dir), quantization="int4", num_kv_blocks=64)
    assert fast.engine.core.ops.cpu is not None and fast.engine.loaded.model.mixed
    slow = LLM(str(tiny_llama_dir), quantization="int4", num_kv_blocks=64, cpu_kernels="none")
    assert slow.engine.core.ops.cpu is None
    for a, b in zip(fast.generate(prompts, params), slow.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert max(abs(la[t] - lb[t]) for t in set(la) & set(lb)) < 0.05


def test_the_start_log_names_the_prefill_products(cpu: CpuKernels) -> None:
    """The paged prefill line of the start log says which products a bf16 cache's tiles take: int16 on the
    avx512_vnni build's int16 tiles, bf16 on the bf16 and AMX tiles."""
    from kernels.cpu.paged_prefill import BF16_PATHS, I16_PATHS
    from kernels.ops import _prefill_impl
    line, path = _prefill_impl(cpu), cpu.prefill.path(torch.bfloat16)
    assert ("int16 products over bf16 caches" in line) == (path in I16_PATHS)
    assert ("bf16 products over bf16 caches" in line) == (path in BF16_PATHS)
