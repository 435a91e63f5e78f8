"""Quantized linear layers (engine/models/quant.py): GGUF Q4 blocks taken exactly, the kernels' error
bounded, the exact top logits, and the engine's greedy output on a tiny checkpoint."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.quant import DENSE_FROM_ROWS, GROUP, Int4Linear, Int8Linear, QuantLogits, gguf_q4
from kernels import quant_gemm as qg
from kernels.cpu.library import cpu_flags
from kernels.ops import KernelConfig, Ops, default_ops
from tests.helpers.kernels import pretend_amx

# bfloat16 activations (8 mantissa bits: 2^-9 relative per element) through a dot product of a few
# hundred terms: the output's relative error is a few 1e-3 (measured 3.4e-3 on SmolLM2's projections).
REL_TOL = 1e-2


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def q4_1_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode w [rows, cols] as GGUF Q4_1 bytes (ggml's layout), and the values those bytes decode to."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(-1), g.max(-1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    q = np.clip(np.round((g - m[..., None].astype(np.float32)) / d[..., None].astype(np.float32)), 0, 15)
    q = q.astype(np.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    raw = np.concatenate([d[..., None].view(np.uint8).reshape(rows, cols // GROUP, 2),
                          m[..., None].view(np.uint8).reshape(rows, cols // GROUP, 2), qs], axis=-1)
    value = q.astype(np.float32) * d[..., None].astype(np.float32) + m[..., None].astype(np.float32)
    return raw.reshape(rows, -1), value.reshape(rows, cols)


def test_gguf_q4_1_blocks_are_taken_exactly() -> None:
    rng = np.random.default_rng(0)
    raw, value = q4_1_blocks(rng.standard_normal((8, 64)).astype(np.float32))
    got = gguf_q4(raw, "Q4_1", 8, 64)
    assert got is not None
    q, scale, zero = got
    deq = ((q - 8).float().view(8, 2, GROUP) * scale[..., None] + zero[..., None]).view(8, 64)
    assert torch.equal(deq, torch.from_numpy(value))       # (q - 8) * d + (m + 8 d) = q d + m, bit for bit here
    assert gguf_q4(raw, "Q8_0", 8, 64) is None


def test_the_real_gguf_q4_blocks_equal_its_dequantized_weights(real_model_path: Path) -> None:
    from engine.models.gguf import q4_weights
    from engine.models.loader import load_model
    dense = dict(load_model(str(real_model_path), quantization="none").model.named_parameters())
    exact = q4_weights(real_model_path)
    assert len(exact) == 4 * 30                                 # every projection of the 30 layers
    for name in ("layers.0.self_attn.qkv_proj.weight", "layers.29.mlp.gate_up_proj.weight",
                 "layers.7.self_attn.o_proj.weight", "layers.13.mlp.down_proj.weight"):
        q, scale, zero = exact[name]
        deq = ((q - 8).float().view(q.shape[0], -1, GROUP) * scale[..., None] + zero[..., None]).view(q.shape)
        assert torch.equal(deq, dense[name].detach()), name      # Q/K un-permuted and fused as the loader does
        x = torch.randn(3, q.shape[1])
        assert rel_err(Int4Linear(q, scale, zero, None)(x), x @ dense[name].detach().T) < REL_TOL


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear.from_float])
def test_quantized_linear_error_is_bounded(cls) -> None:
    torch.manual_seed(1)
    w, b, x = torch.randn(96, 128), torch.randn(96), torch.randn(5, 128)
    lin = cls(w, b)
    out = lin(x)
    assert out.dtype == torch.float32 and out.shape == (5, 96)
    # 4-bit round-to-nearest: a step of (max - min) / 15 per group, so ~5% relative; 8-bit per row: ~1%.
    assert rel_err(out, x @ w.T + b) < (0.1 if cls is not Int8Linear else 2e-2)


@pytest.mark.parametrize("mode,coarse_err", [("int8", 2e-2), ("int4", 0.1)])
def test_quantized_logits_are_exact_where_they_decide(mode: str, coarse_err: float) -> None:
    torch.manual_seed(2)
    w, h = torch.randn(5008, 64), torch.randn(6, 64)
    ref = h @ w.T
    head = QuantLogits(w, mode, refine=64)
    assert isinstance(head.coarse, Int4Linear if mode == "int4" else Int8Linear)
    got = head(h)
    top = ref.topk(16, dim=-1).indices          # well inside the 64 refined (its edge may differ by rounding)
    torch.testing.assert_close(got.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-4)  # float32 sums
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert rel_err(got, ref) < coarse_err                       # the rest: quantized rows, bfloat16 output
    assert isinstance(QuantLogits(w[:5000], mode).coarse, Int8Linear)   # rows the int4 kernel cannot take


def test_int8_engine_on_a_tiny_checkpoint_stays_close_to_float32(tiny_llama_dir: Path) -> None:
    """Random weights quantize worse than trained ones; still, the first step's log-probabilities stay
    within 0.15 of float32's (measured 0.11: the two prompts prefill in one step of 10 rows, so they take
    the bfloat16 GEMM path with the int8 weights rounded to bfloat16) and the first greedy tokens agree.
    The KV cache is float32 here, to measure the weights alone."""
    one = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    outs = {q: LLM(str(tiny_llama_dir), quantization=q, num_kv_blocks=64, kv_cache_dtype="float32").generate(
        prompts, one) for q in ("none", "int8")}
    for a, b in zip(outs["none"], outs["int8"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert max(abs(la[t] - lb[t]) for t in set(la) & set(lb)) < 0.15


def test_quantization_is_refused_where_it_cannot_run(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="CPU only"):
        LLM(str(tiny_llama_dir), quantization="int4", device="meta", num_kv_blocks=8)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama_dir), quantization="int3", num_kv_blocks=8)


def test_the_dense_gemm_is_bfloat16_only_where_the_cpu_multiplies_bfloat16() -> None:
    """torch says oneDNN takes bfloat16 on any AVX-512 CPU, but without AVX-512 BF16 or AMX it emulates it (an AVX-512
    Xeon without BF16: 48.6 against 232.8 GFLOPS in float32): there the dense GEMM is float32."""
    cascade_lake = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"})
    assert not qg.native_bf16(cascade_lake, onednn_bf16=True)
    assert qg.native_bf16(cascade_lake | {"avx512_bf16"}, True) and qg.native_bf16(cascade_lake | {"amx_bf16"}, True)
    assert not qg.native_bf16(cascade_lake | {"avx512_bf16"}, onednn_bf16=False)
    native = bool(qg.NATIVE_BF16 & cpu_flags()) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert qg.ONEDNN_BF16 == native and qg.DENSE_DTYPE == (torch.bfloat16 if native else torch.float32)


def test_a_row_of_the_dense_gemm_does_not_depend_on_the_rows_beside_it() -> None:
    """oneDNN's float32 GEMM summed a lone row of the 1,536-input down projection in another order than the same row
    among others (an AVX-512 Xeon without BF16): a prompt whose last token alone was left to compute after a cached
    prefix then answered otherwise than the same prompt computed whole."""
    torch.manual_seed(3)
    for n, k in ((576, 1536), (960, 576)):
        w, b = qg.pack_dense(torch.randn(n, k) * 0.05), torch.randn(n)
        x = torch.randn(17, k)
        whole = qg.dense_mm(x, w, b)
        for t in (0, 16):
            assert torch.equal(qg.dense_mm(x[t:t + 1], w, b)[0], whole[t])
        assert torch.equal(qg.dense_mm(x[-3:], w, None)[-1], qg.dense_mm(x, w, None)[-1])


def test_wide_steps_take_the_dense_gemm() -> None:
    """From DENSE_FROM_ROWS rows a quantized layer multiplies by a dense weight (oneDNN's layout): bfloat16 where
    oneDNN has a bfloat16 GEMM, float32 elsewhere (an AVX2 CPU emulates bfloat16 products, 8x slower); below,
    by the quantized kernel. Int8 and GGUF Q4 layers keep their own values for it (the rows of a wide step
    equal the same rows sent a few at a time, up to bfloat16 rounding); a layer quantized here from a
    float weight (from_float: K-quants, the output layer) keeps that float weight, the better of the two."""
    torch.manual_seed(2)
    w, b = torch.randn(96, 128) * 0.1, torch.randn(96)
    x = torch.randn(DENSE_FROM_ROWS + 3, 128)
    ref = x @ w.T + b
    for lin, tol in ((Int8Linear(w, b), 2e-2), (Int4Linear.from_float(w, b), 0.1)):
        assert lin.dense.dtype == (torch.bfloat16 if qg.ONEDNN_BF16 else torch.float32)
        wide = lin(x)
        narrow = torch.cat([lin(x[i:i + 2]) for i in range(0, x.shape[0], 2)])
        assert wide.shape == narrow.shape == (x.shape[0], 96) and wide.dtype == torch.float32
        assert not torch.equal(wide[:2], lin(x[:2]))              # two different kernels computed them
        assert rel_err(narrow, ref) < tol
        assert rel_err(wide, ref) < (tol if isinstance(lin, Int8Linear) else REL_TOL)
        if isinstance(lin, Int8Linear):
            assert rel_err(wide, narrow) < REL_TOL
    q, scale, zero = (torch.randint(0, 16, (96, 128), dtype=torch.int32), torch.rand(96, 4) * 0.01,
                      torch.randn(96, 4) * 0.01)
    exact = Int4Linear(q, scale, zero, b)                            # a GGUF Q4 layer: its 4-bit values either way
    assert rel_err(exact(x), torch.cat([exact(x[i:i + 2]) for i in range(0, x.shape[0], 2)])) < REL_TOL
    assert rel_err(exact(x, wide=True), exact(x)) < REL_TOL           # a prompt chunk: the dense GEMM


def gguf_q4_layer(ops: Ops, seed: int) -> tuple[Int4Linear, torch.Tensor]:
    """A 96 x 128 layer as a GGUF Q4 file gives it (4-bit values, scales, zeros; no float weight) and its bias;
    torch's global generator seeded for the test's own draws after it."""
    torch.manual_seed(seed)
    q, scale, zero = (torch.randint(0, 16, (96, 128), dtype=torch.int32), torch.rand(96, 4) * 0.01,
                      torch.randn(96, 4) * 0.01)
    b = torch.randn(96)
    return Int4Linear(q, scale, zero, b, ops=ops), b


def test_wide_decode_steps_of_gguf_q4_layers_decode_the_4_bit_weights() -> None:
    """Where wide steps are float32 GEMMs (AVX2, AVX-512 without BF16) and int16 activations are off, a GGUF Q4
    layer's decode steps of DENSE_FROM_ROWS rows and more take our panel-decoding int4 GEMM (int4_gemm.cpp
    gemm_wide: its bits exactly), a prompt chunk the dense GEMM; a layer quantized here from a float weight keeps that
    weight for its wide steps (from_float)."""
    ops = Ops(KernelConfig(int16_activations=False))
    if ops._int4 is None:
        pytest.skip("wide steps are bfloat16 GEMMs on this CPU (or the C++ kernels are off)")
    exact, b = gguf_q4_layer(ops, seed=3)
    x = torch.randn(DENSE_FROM_ROWS + 5, 128)
    own = ops._int4.gemm_wide(x, exact.q8, exact.sz8) + b
    assert rel_err(ops.linear(exact, x, prefill=True), own) < 2e-5  # a prompt chunk: the dense GEMM, same values
    exact.dense = qg.pack_dense(torch.zeros(96, 128))               # now only the 4-bit weights hold the layer
    assert torch.equal(ops.linear(exact, x, prefill=False), own)    # float32 activations, as a wide step has
    assert torch.equal(ops.linear(exact, x, prefill=True), b.expand(x.shape[0], -1))
    w = torch.randn(96, 128) * 0.1
    kept = Int4Linear.from_float(w, b, ops)
    assert not kept.dense_is_int4 and exact.dense_is_int4
    assert rel_err(ops.linear(kept, x, prefill=False), x @ w.T + b) < 1e-5   # the float weight, not its 4 bits


def test_wide_steps_of_gguf_q4_layers_run_the_int16_activation_gemm_and_keep_no_dense_copy() -> None:
    """On an AVX-512 CPU with VNNI and no BF16 (--int16-activations, the default), a GGUF Q4 layer's prompt chunks
    of any size and its decode steps from Q16_FROM_ROWS rows (every decode step: 1) take gemm_q16 (its bits
    exactly); its dense copy is not kept (never read). Without int16 activations the narrow decode steps take
    torch's int4 kernel. A float weight kept by from_float still serves its wide steps."""
    ops = default_ops()
    if not ops.wide_int4_q16:
        pytest.skip("gemm_q16 serves an AVX-512 CPU with VNNI and no BF16 only")
    exact, b = gguf_q4_layer(ops, seed=4)
    assert exact.dense.numel() == 0
    assert qg.Q16_FROM_ROWS == ops.own_wide_from == 1
    for rows, prefill in ((1, True), (1, False), (5, False), (DENSE_FROM_ROWS + 40, True)):
        x = torch.randn(rows, 128)
        assert torch.equal(ops.linear(exact, x, prefill), ops._int4.gemm_q16(x, exact.q8, exact.sz8) + b)
    x = torch.randn(5, 128)
    off = Ops(dataclasses.replace(ops.config, int16_activations=False))
    assert not off.wide_int4_q16 and off.own_wide_from > 5
    narrow = off.linear(exact, x, prefill=False)
    assert rel_err(narrow, ops._int4.gemm_wide(x, exact.q8, exact.sz8) + b) < 2e-2      # torch's, bfloat16 activations
    w = torch.randn(96, 128) * 0.1
    kept = Int4Linear.from_float(w, b, ops)
    xs = x.repeat(4, 1)
    assert kept.dense.numel() and rel_err(ops.linear(kept, xs, prefill=True), xs @ w.T + b) < 1e-5


def test_wide_steps_of_gguf_q4_layers_run_the_int4_bf16_gemm_and_keep_no_dense_copy() -> None:
    """Where wide steps are bfloat16 GEMMs (AVX-512 BF16), a GGUF Q4 layer's prompt chunks and decode steps, of any
    row count (BF16_GEMM_FROM_ROWS), take int4_gemm.cpp gemm_bf16 (its bits exactly), whose decoded weights are the
    dense copy's: so the layer keeps no dense copy. A layer quantized here from a float weight keeps that weight
    (from_float), torch's int4 kernel for its narrow decode steps and the dense GEMM for the wide ones."""
    ops = default_ops()
    if not ops.wide_int4_bf16:
        pytest.skip("wide steps are not bfloat16 GEMMs on this CPU (or the C++ kernels are off)")
    if ops.int4_bf16_keeps_dense:
        pytest.skip("this CPU has AMX: its wide steps keep oneDNN's GEMM (the test below)")
    exact, b = gguf_q4_layer(ops, seed=4)
    assert exact.dense.numel() == 0 and exact.w4.shape == (6, 64, 16)
    for rows, prefill in ((DENSE_FROM_ROWS + 5, False), (DENSE_FROM_ROWS + 5, True), (3, True), (3, False),
                          (1, False)):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        own = (ops._int4_bf16.gemm_bf16(x, exact.w4, exact.sz4).float() + b).to(torch.bfloat16)
        assert torch.equal(ops.linear(exact, x, prefill=prefill), own)
    w = torch.randn(96, 128) * 0.1
    kept = Int4Linear.from_float(w, b, ops)
    assert kept.w4.numel() == 0 and kept.dense.numel() == 96 * 128
    x = torch.randn(3, 128).to(torch.bfloat16)                       # its narrow decode step: torch's int4 kernel
    assert torch.equal(ops.linear(kept, x, prefill=False), qg.int4_mm(x, kept.packed, kept.scale_zero) +
                       b.to(torch.bfloat16))
    x = torch.randn(DENSE_FROM_ROWS + 5, 128).to(torch.bfloat16)
    assert rel_err(ops.linear(kept, x, prefill=False).float(), x.float() @ w.T + b) < 2e-2


def amx_ops(monkeypatch: pytest.MonkeyPatch) -> Ops:
    """The op layer as a CPU with AMX would make it: the same kernels as here, chosen by AMX's rules."""
    config = default_ops().config                # the cached default, made before the patch
    pretend_amx(monkeypatch)
    return Ops(config)


def test_a_cpu_with_amx_keeps_onednns_gemm_for_wide_steps_and_gemm_bf16_for_narrow_decode_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gemm_bf16 beats oneDNN's AVX-512 BF16 GEMM, not (by design) its AMX one: where the CPU has AMX, a GGUF Q4
    layer's prompt chunks and decode steps of AMX_DENSE_FROM_ROWS rows or more take oneDNN's GEMM on its dense
    copy, and its narrower decode steps gemm_bf16 (in place of torch's int4 kernel): each path's bits exactly."""
    if not default_ops().wide_int4_bf16:
        pytest.skip("gemm_bf16 does not serve on this CPU")
    ops = amx_ops(monkeypatch)
    assert ops.wide_int4_bf16 and ops.int4_bf16_keeps_dense and qg.AMX_DENSE_FROM_ROWS == DENSE_FROM_ROWS
    layer, b = gguf_q4_layer(ops, seed=5)
    assert layer.w4.numel() and layer.dense.numel() == 96 * 128       # both: the narrow steps' and the wide ones'
    for rows, prefill in ((1, False), (DENSE_FROM_ROWS - 1, False), (DENSE_FROM_ROWS, False), (64, False),
                          (1, True), (3, True), (64, True)):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        bf16 = not prefill and rows < DENSE_FROM_ROWS
        assert ops.bf16_gemm_step(prefill, rows) == bf16
        assert (ops.layer_halves(prefill, rows, torch.bfloat16) is not None) == (bf16 and ops._fused is not None)
        expected = (ops._int4_bf16.gemm_bf16(x, layer.w4, layer.sz4).float() + b).to(torch.bfloat16) if bf16 else \
            qg.dense_mm(x, layer.dense, b)
        assert torch.equal(ops.linear(layer, x, prefill=prefill), expected), (rows, prefill)
    quantized = ops.report.ops["quantized gemm"]
    assert f"for decode steps below {DENSE_FROM_ROWS} rows" in quantized and "AMX" in quantized


def test_amx_dense_from_rows_moves_the_crossover_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """--amx-dense-from-rows (PREFIXSERVE_AMX_DENSE_FROM_ROWS) sets where an AMX CPU's decode steps leave gemm_bf16
    for oneDNN's GEMM: its default is quant_gemm's AMX_DENSE_FROM_ROWS; below 1 the config refuses it; without AMX
    it changes nothing."""
    import argparse
    from dataclasses import replace

    from engine.config import EngineConfig
    from service.flags import add_flags, values
    assert EngineConfig().amx_dense_from_rows == qg.AMX_DENSE_FROM_ROWS
    with pytest.raises(ValueError, match="amx_dense_from_rows must be >= 1"):
        EngineConfig(amx_dense_from_rows=0)
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    assert values(parser.parse_args(["--amx-dense-from-rows", "6"]), EngineConfig)["amx_dense_from_rows"] == 6
    monkeypatch.setenv("PREFIXSERVE_AMX_DENSE_FROM_ROWS", "12")
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    assert values(parser.parse_args([]), EngineConfig)["amx_dense_from_rows"] == 12
    if not default_ops().wide_int4_bf16:
        pytest.skip("gemm_bf16 does not serve on this CPU")
    if not default_ops().int4_bf16_keeps_dense:                 # no AMX here: every decode step stays gemm_bf16
        plain = Ops(replace(default_ops().config, amx_dense_from_rows=4))
        assert plain.bf16_gemm_step(False, 64) and plain.bf16_gemm_step(True, 3)
    config = default_ops().config
    amx_ops(monkeypatch)                                         # AMX's flags from here on
    ops = Ops(replace(config, amx_dense_from_rows=4))
    assert [ops.bf16_gemm_step(False, r) for r in (1, 3, 4, 9)] == [True, True, False, False]
    assert not ops.bf16_gemm_step(True, 1)
    assert "below 4 rows" in ops.report.ops["quantized gemm"]


def test_quantized_answers_do_not_depend_on_how_much_of_the_prompt_was_cached(tiny_llama_dir: Path) -> None:
    """The fast path mixes kernels (4-bit for decode rows, bfloat16 GEMMs for prefill chunks; a C++ decode
    kernel and flash prefill): a prompt's tokens must take the same ones whether they are computed in one
    chunk or after a prefix-cache hit of any depth (its last token alone included), or a named prefix
    would not give the inline answer. Greedy tokens and first-step log-probabilities must be identical."""
    prompt = [(7 * i + 3) % 300 + 3 for i in range(41)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    results = []
    for cached in (0, 16, 32, 40):
        llm = LLM(str(tiny_llama_dir), quantization="int4", block_size=8, num_kv_blocks=128)
        assert llm.engine.core.attention_backend == "cpu" and llm.engine.core.kv_cache_dtype == "bfloat16"
        if cached:
            llm.generate([prompt[:cached + 1]], SamplingParams(temperature=0.0, max_tokens=1))
        out = llm.generate([prompt], params)[0]
        assert out.num_cached_tokens == cached
        results.append((out.outputs[0].token_ids, out.outputs[0].logprobs))
    assert all(r == results[0] for r in results[1:])


def test_building_the_head_leaves_torch_global_generator_alone() -> None:
    """The int8 head probes oneDNN's kernel once at load: with fixed inputs, so a caller's torch.manual_seed
    gives the same random numbers after a model loads as before."""
    w = torch.linspace(-1, 1, 3200 * 64).view(3200, 64)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    QuantLogits(w, "int4")
    assert torch.equal(torch.rand(4), expected)


def test_an_engine_given_a_loaded_model_runs_it_on_its_own_op_layer(tiny_llama_dir: Path) -> None:
    """The quantized modules hold the op layer for their own forward (the head: its logits); an engine that is
    handed a model loaded elsewhere (LLMEngine(config, loaded)) puts its own everywhere, or the head would keep
    the loader's (another batch-invariance setting, another C++ build)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.loader import load_model

    loaded = load_model(str(tiny_llama_dir), quantization="int4")
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), batch_invariant=True, num_kv_blocks=16), loaded)
    ops = engine.core.ops
    assert ops.config.batch_invariant and loaded.model.ops is ops and loaded.model.lm_head.ops is ops
    assert all(layer.self_attn.qkv_proj.ops is ops for layer in loaded.model.layers)
