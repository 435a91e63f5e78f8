"""The C++ halves of a decoder layer and the one-call decode step (kernels/cpu/layers.py) on the real model: the same
kernels in the same order as the op-by-op path, so the same tokens and the same log-probabilities, bit for bit,
through prompt chunks and mixed steps (the halves) and decode steps of any width (one call), with bfloat16 between
the matmuls (gemm_bf16) or float32 (gemm_q16 / gemm_wide); the steps of another GEMM and the layers that do not fit
keep the op-by-op path."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.cpu.layers import LayerHalves
from kernels.ops import Ops, default_ops
from kernels.quant_gemm import (
    AMX_DENSE_FROM_ROWS,
    BF16_GEMM_FROM_ROWS,
    INT8_HEAD_FROM_ROWS,
    INT8_HEAD_Q16_FROM_ROWS,
    Q16_FROM_ROWS,
    WIDE512_FROM_ROWS,
)
from tests.helpers.kernels import pretend_amx


def answers(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3))
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def record_halves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """("halves", rows) for each call of a layer's first half (prompt and mixed steps), ("decode", rows) for each
    one-call decode step, appended as the engine makes them."""
    calls: list[tuple[str, int]] = []
    real_pre, real_decode = LayerHalves.pre, LayerHalves.decode_layers

    def pre(self: LayerHalves, s: Any, *a: Any) -> Any:
        calls.append(("halves", s.x.shape[0]))
        return real_pre(self, s, *a)

    def decode_layers(self: LayerHalves, s: Any, *a: Any) -> Any:
        calls.append(("decode", s.x.shape[0]))
        return real_decode(self, s, *a)

    monkeypatch.setattr(LayerHalves, "pre", pre)
    monkeypatch.setattr(LayerHalves, "decode_layers", decode_layers)
    return calls


def halves_against_op_by_op(path: Path, monkeypatch: pytest.MonkeyPatch, **engine: Any) -> list[tuple[str, int]]:
    """14 prompts of 30-260 tokens, 12 tokens out each, with the halves, then op by op (no prefix cache: the second
    run computes every prompt as the first did, the same chunks, the same steps): chunks of a 512-token budget,
    steps mixing chunks and decodes, decode steps of 14 rows down to 1 as the longest finish last. Asserts the same
    tokens and log-probabilities bit for bit; returns the calls of the halves the first run made (record_halves).
    The thread count stays put (no adaptive threads): a busy machine would change it between the runs, and with it
    the decode kernel's splits, so the sums' order."""
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randrange(30, 260))] for _ in range(14)]
    calls = record_halves(monkeypatch)
    llm = LLM(str(path), max_model_len=1024, num_kv_blocks=512, enable_prefix_caching=False,
              max_num_batched_tokens=512, adaptive_threads=False, **engine)
    fast = answers(llm, prompts)
    made = list(calls)
    monkeypatch.setattr(Ops, "layer_halves", lambda self, *a: None)
    calls.clear()
    slow = answers(llm, prompts)
    assert not calls
    assert fast == slow
    return made


def decode_rows(calls: list[tuple[str, int]]) -> set[int]:
    return {rows for kind, rows in calls if kind == "decode"}


def test_the_halves_give_the_op_by_op_paths_tokens_and_logprobs_bit_for_bit(real_model_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if default_ops().layer_halves(True, 64, torch.bfloat16) is None:
        pytest.skip("no C++ halves on this CPU: its wide steps do not take gemm_bf16 (no AVX-512 BF16, or AMX)")
    calls = halves_against_op_by_op(real_model_path, monkeypatch)
    assert {kind for kind, _ in calls} == {"halves", "decode"}     # prompt and mixed steps; decode steps
    # every decode step is wide where gemm_bf16 serves: the narrow ones in one call too
    assert {1, 2, 3} <= decode_rows(calls)


def test_every_decode_step_takes_the_halves_and_float32_activations_keep_the_op_by_op_path() -> None:
    ops = default_ops()
    if ops.layer_halves(True, 1, torch.bfloat16) is None:
        pytest.skip("no C++ halves on this CPU")
    assert ops.wide_rows == BF16_GEMM_FROM_ROWS == 1
    assert ops.layer_halves(False, 1, torch.bfloat16) is not None      # batch-1 decode: gemm_bf16, one call
    assert ops.head_wide_rows == INT8_HEAD_FROM_ROWS == 4              # the head: int4 rows below 4, int8 x int8
    assert ops.layer_halves(True, 64, torch.float32) is None


def f32_halves_or_skip() -> LayerHalves:
    ops = default_ops()
    halves = ops.layer_halves(True, 64, torch.float32)
    if halves is None or not ops.wide_int4_q16:
        pytest.skip("no float32 C++ halves of gemm_q16 on this CPU (AVX-512 VNNI without BF16)")
    return halves


def test_where_gemm_q16_serves_the_layers_the_head_takes_its_int8_product_from_three_rows() -> None:
    """The head's int8 x int8 product (oneDNN, VNNI) is as fast as the int4 rows at 1-2 rows and 2-3x faster from
    4 (kernels/quant_gemm.py INT8_HEAD_Q16_FROM_ROWS): a step of 3 rows or more takes it, one of 1 or 2 the int4
    rows; greedy choices the same either way (the top candidates recomputed exactly)."""
    from engine.models.quant import QuantLogits

    ops = default_ops()
    if not ops.wide_int4_q16:
        pytest.skip("gemm_q16 does not serve the layers on this CPU (AVX-512 VNNI without BF16)")
    assert ops.head_wide_rows == INT8_HEAD_Q16_FROM_ROWS == 3
    torch.manual_seed(3)
    w = torch.randn(4096, 576)
    head = QuantLogits(w, "int4", ops=ops)
    assert head.wide is not None
    head.wide = spy = mock.Mock(wraps=head.wide, refine=head.wide.refine)      # the real product, its calls seen
    for rows in (1, 2, 3, 8):
        x = torch.randn(rows, 576)
        assert torch.equal(head(x).argmax(-1), (x @ w.T).argmax(-1))
    assert [c.args[0].shape[0] for c in spy.call_args_list] == [3, 8]


def test_the_float32_halves_of_gemm_q16_give_the_op_by_op_paths_tokens_and_logprobs_bit_for_bit(
        real_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where gemm_q16 takes the prompt chunks and the decode steps from Q16_FROM_ROWS rows (every decode step; float32
    between the matmuls), those steps run as C++ halves or one call: the same bits as the op-by-op path."""
    halves = f32_halves_or_skip()
    assert halves.gemm == "q16" and halves.act == torch.float32
    calls = halves_against_op_by_op(real_model_path, monkeypatch)
    assert {kind for kind, _ in calls} == {"halves", "decode"}
    rows = decode_rows(calls)
    assert min(rows) == Q16_FROM_ROWS == 1 and max(rows) >= 12, rows


def test_without_int16_activations_gemm_wides_decode_steps_take_the_float32_halves_bit_for_bit(
        real_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-int16-activations on that CPU: gemm_wide (float32 activations) takes the decode steps from
    WIDE512_FROM_ROWS rows, as the float32 halves' "wide" kind in one call; prompt chunks (oneDNN's float32 GEMM) and
    narrower decode steps (torch's int4 kernel) op by op; the same bits as the op-by-op path. The kind an AVX2 or
    AVX-512 CPU without VNNI runs (there from DENSE_FROM_ROWS / WIDE512_FROM_ROWS rows)."""
    f32_halves_or_skip()
    off = Ops(dataclasses.replace(default_ops().config, int16_activations=False))
    halves = off.layer_halves(False, WIDE512_FROM_ROWS, torch.float32)
    assert halves is not None and halves.gemm == "wide" and off.own_wide_from == WIDE512_FROM_ROWS
    assert off.layer_halves(True, 64, torch.float32) is None and off.layer_halves(False, 11, torch.bfloat16) is None
    calls = halves_against_op_by_op(real_model_path, monkeypatch, int16_activations=False)
    assert {kind for kind, _ in calls} == {"decode"}
    assert min(decode_rows(calls)) >= WIDE512_FROM_ROWS and max(decode_rows(calls)) == 14, calls


def test_the_float32_halves_take_the_steps_of_gemm_q16_only(real_model_path: Path) -> None:
    """Every decode step takes them (Q16_FROM_ROWS: 1), a step whose activations are bfloat16 (no gemm_q16) keeps
    the op-by-op path; a model with a projection that has no packed 4-bit weights does not fit."""
    from engine.models.loader import load_model
    from engine.models.quant import Int4Linear
    f32_halves_or_skip()
    ops = default_ops()
    assert ops.layer_halves(False, 1, torch.float32) is not None
    assert "float32 halves" in ops.report.ops["decoder layers, prompt chunks and every decode step"]     # logged
    assert ops.layer_halves(True, 64, torch.bfloat16) is None
    halves = ops.layer_halves(True, 64, torch.float32)
    assert halves is not None
    model = load_model(str(real_model_path)).model
    assert halves.bind(model) is not None
    model.layers[5].self_attn.o_proj = Int4Linear.from_float(torch.randn(576, 576) * 0.01, None, ops)
    assert not model.layers[5].self_attn.o_proj.dense_is_int4
    assert halves.bind(model) is None


def test_a_model_whose_layers_do_not_all_take_gemm_bf16_does_not_fit(real_model_path: Path) -> None:
    """A projection quantized here from a float weight keeps that weight for its wide steps (no packed 4-bit
    weights): such a model keeps the op-by-op path."""
    from engine.models.loader import load_model
    from engine.models.quant import Int4Linear
    ops = default_ops()
    if ops.layer_halves(True, 64, torch.bfloat16) is None:
        pytest.skip("no C++ halves on this CPU")
    model = load_model(str(real_model_path)).model
    halves = ops.layer_halves(True, 64, torch.bfloat16)
    assert halves is not None and halves.bind(model) is not None
    o = model.layers[5].self_attn.o_proj
    assert o.w4.numel()
    model.layers[5].self_attn.o_proj = Int4Linear.from_float(torch.randn(576, 576) * 0.01, None, ops)
    assert halves.bind(model) is None


def test_on_a_cpu_with_amx_only_narrow_decode_steps_take_the_halves(real_model_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has AMX (its flags as such a CPU gives them; the kernels are this CPU's), oneDNN's GEMM keeps
    the prompt chunks and the decode steps of AMX_DENSE_FROM_ROWS rows or more, op by op, and the narrower decode
    steps take gemm_bf16 in one C++ call; the same tokens and log-probabilities, bit for bit, as the op-by-op path
    (whose narrow steps take gemm_bf16 too)."""
    if default_ops().layer_halves(False, 1, torch.bfloat16) is None:
        pytest.skip("no C++ halves on this CPU")
    pretend_amx(monkeypatch)
    rng = random.Random(11)
    # 14 prompts, 12 tokens out each: decode steps of 14 rows down to 1 as they finish (their lengths differ)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randrange(30, 200))] for _ in range(14)]
    llm = LLM(str(real_model_path), max_model_len=1024, num_kv_blocks=512, enable_prefix_caching=False,
              max_num_batched_tokens=512)
    ops = llm.engine.core.ops
    assert ops.int4_bf16_keeps_dense and ops.layer_halves(False, AMX_DENSE_FROM_ROWS - 1, torch.bfloat16) is not None
    calls = record_halves(monkeypatch)
    steps: list[int] = []
    real_execute = llm.engine.core.runner.execute

    def execute(scheduled: Any, *a: Any, **k: Any) -> Any:
        if all(s.num_new == 1 for s in scheduled):
            steps.append(len(scheduled))
        return real_execute(scheduled, *a, **k)

    monkeypatch.setattr(llm.engine.core.runner, "execute", execute)
    fast = answers(llm, prompts)
    assert {kind for kind, _ in calls} == {"decode"}                 # no prompt chunk, no wide step: oneDNN's
    assert sorted(rows for _, rows in calls) == sorted(r for r in steps if r < AMX_DENSE_FROM_ROWS)
    assert max(steps) >= AMX_DENSE_FROM_ROWS and min(steps) == 1
    monkeypatch.setattr(Ops, "layer_halves", lambda self, *a: None)
    calls.clear()
    assert answers(llm, prompts) == fast and not calls
