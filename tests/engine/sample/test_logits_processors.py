"""Sampling controls (logit_bias, min_tokens, repetition / frequency / presence penalties, min_p) against a
plain float64 reference per row; batch invariance; and the sampler's safety with degenerate inputs."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.sample import logits_processors
from engine.sample.logits_processors import RowContext
from engine.sample.sampler import Sampler, make_generator
from engine.sequence import SamplingParams

V = 40
STOP = frozenset({2, 7})


def reference(logits: np.ndarray, p: SamplingParams, ctx: RowContext) -> np.ndarray:
    """One row, written out as the semantics say (engine/sample/logits_processors.py)."""
    x = logits.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(ctx.output_token_ids) < p.min_tokens:
        for t in ctx.stop_ids:
            x[t] = -np.inf
    seen = set(ctx.prompt_token_ids) | set(ctx.output_token_ids)
    for t in seen:
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(ctx.output_token_ids):
        count = list(ctx.output_token_ids).count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def random_case(rng: random.Random) -> tuple[SamplingParams, RowContext]:
    params = SamplingParams(
        presence_penalty=rng.choice([0.0, 0.5, -1.0]), frequency_penalty=rng.choice([0.0, 0.3, 1.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7]), min_tokens=rng.choice([0, 3]),
        logit_bias=rng.choice([None, {rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)}]), max_tokens=16)
    ctx = RowContext([rng.randrange(V) for _ in range(rng.randrange(0, 8))],
                     [rng.randrange(V) for _ in range(rng.randrange(1, 8))], STOP)
    return params, ctx


def test_every_control_matches_the_reference_in_mixed_batches() -> None:
    rng = random.Random(0)
    for trial in range(30):
        cases = [random_case(rng) for _ in range(rng.randrange(1, 7))]
        logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(trial)) * 3
        out = logits_processors.apply(logits, [c[0] for c in cases], [c[1] for c in cases])
        for i, (p, ctx) in enumerate(cases):
            ref = reference(logits[i].numpy(), p, ctx)
            got = out[i].double().numpy()
            assert np.array_equal(np.isinf(ref), np.isinf(got)), (trial, i)
            finite = np.isfinite(ref)
            np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-6, atol=1e-4)   # float32 vs float64


def test_rows_without_controls_are_left_alone() -> None:
    logits = torch.randn(3, V)
    plain = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    assert logits_processors.apply(logits, plain, []) is logits                      # nothing built at all
    mixed = plain[:2] + [SamplingParams(presence_penalty=1.0)]
    out = logits_processors.apply(logits, mixed, [RowContext([1, 1], [3], STOP)] * 3)
    assert torch.equal(out[:2], logits[:2]) and not torch.equal(out[2], logits[2])


def test_min_p_keeps_what_the_definition_keeps() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(min_p=m, temperature=t) for m, t in ((0.1, 1.0), (0.5, 0.7), (0.0, 1.0), (1.0, 1.0))]
    probs = Sampler().probs(logits, params).double().numpy()
    for i, p in enumerate(params):
        z = logits[i].double().numpy() / p.temperature
        q = np.exp(z - z.max())
        q /= q.sum()
        keep = q >= p.min_p * q.max()
        ref = np.where(keep, q, 0.0)
        np.testing.assert_allclose(probs[i], ref / ref.sum(), atol=1e-6)


def test_seeded_rows_with_penalties_do_not_depend_on_the_batch() -> None:
    sampler = Sampler()
    p = SamplingParams(temperature=1.0, seed=5, presence_penalty=0.8, logit_bias={3: 2.0}, min_p=0.05)
    ctx = RowContext([1, 2, 3], [4, 5], STOP)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(11))
    alone = sampler(logits, [p], [make_generator(5, "cpu")], [ctx]).token_ids[0]
    crowd = torch.cat([torch.randn(2, V), logits, torch.randn(1, V)])
    others = [SamplingParams(temperature=0.5), SamplingParams(repetition_penalty=1.5), p, SamplingParams()]
    mixed = sampler(crowd, others, [make_generator(i, "cpu") for i in (1, 2, 5, 4)],
                    [RowContext([], [1], STOP)] * 2 + [ctx, RowContext([9], [1], STOP)])
    assert mixed.token_ids[2] == alone


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_tiny_temperatures_are_greedy_and_harm_no_neighbour(temperature: float) -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 50
    out = Sampler()(logits, [SamplingParams(temperature=temperature), SamplingParams(temperature=0.0)],
                    [make_generator(1, "cpu"), make_generator(2, "cpu")])
    assert out.token_ids == logits.argmax(dim=-1).tolist() and not out.failed


def test_non_finite_logits_fail_their_row_only() -> None:
    logits = torch.randn(3, V)
    logits[1, 5] = float("nan")
    logits[2] = float("inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, params, [make_generator(i, "cpu") for i in range(3)])
    assert out.failed == [1, 2]
    assert out.token_ids[0] == int(logits[0].argmax()) and all(0 <= t < V for t in out.token_ids)
