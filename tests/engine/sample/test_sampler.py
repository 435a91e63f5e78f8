"""Sampler: seeds, greedy, temperature / top-k / top-p against independent numpy references, logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.sample.sampler import Sampler, SamplerOutput, make_generator
from engine.sequence import SamplingParams

VOCAB = 48


def _logits(num_rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Direct float64 computation: softmax(logits / T), keep the top k, renormalize, keep the smallest
    highest-probability set whose mass reaches p, renormalize."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    k = len(p) if top_k <= 0 else min(top_k, len(p))
    keep[order[:k]] = True
    p = np.where(keep, p, 0.0) / p[keep].sum()
    cum = np.cumsum(p[order])
    n_nucleus = len(p) if top_p >= 1.0 else int(np.searchsorted(cum, top_p) + 1)  # first to reach p
    nucleus = np.zeros_like(keep)
    nucleus[order[:n_nucleus]] = True
    p = np.where(nucleus, p, 0.0)
    return p / p.sum()


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed0: int = 0) -> np.ndarray:
    """n independent draws in one batch: n copies of the row, one seeded generator each."""
    sampler = Sampler()
    batch = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    out = sampler(batch, [params] * n, [make_generator(seed0 + i, "cpu") for i in range(n)])
    return np.array(out.token_ids)


def _run_steps(rows: list[tuple[int, SamplingParams]], steps: int) -> dict[int, list[int]]:
    """Each key is a request; step t feeds request r the logits _logits(.., seed=1000*t + r)."""
    sampler = Sampler()
    gens = {r: make_generator(p.seed, "cpu") for r, p in rows}
    tokens: dict[int, list[int]] = {r: [] for r, _ in rows}
    for t in range(steps):
        logits = torch.cat([_logits(1, seed=1000 * t + r, scale=0.5) for r, _ in rows])
        out = sampler(logits, [p for _, p in rows], [gens[r] for r, _ in rows])
        for (r, _), tok in zip(rows, out.token_ids):
            tokens[r].append(tok)
    return tokens


# -- seeds ----------------------------------------------------------------------------------------

def test_seeded_request_is_independent_of_batch_composition_and_order():
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=30, seed=1234)
    alone = _run_steps([(0, target)], steps=25)[0]
    others = [(1, SamplingParams(temperature=1.3)), (2, SamplingParams(temperature=0.0)),
              (3, SamplingParams(temperature=0.7, top_k=5, seed=99))]
    mixed = _run_steps([others[0], (0, target), others[1], others[2]], steps=25)[0]
    reversed_ = _run_steps([others[2], others[1], (0, target), others[0]], steps=25)[0]
    assert alone == mixed == reversed_
    assert len(set(alone)) > 5            # it really sampled; not a degenerate constant stream


def test_same_seed_same_tokens_different_seed_different_tokens():
    def stream(seed: int) -> list[int]:
        return _run_steps([(0, SamplingParams(temperature=1.0, seed=seed))], steps=30)[0]
    assert stream(7) == stream(7)
    assert stream(7) != stream(8)


def test_make_generator_seeding():
    a, b = make_generator(5, "cpu"), make_generator(5, "cpu")
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    # Out-of-range seeds are folded into 64 bits rather than rejected.
    big, neg = make_generator(2**70 + 5, "cpu"), make_generator(-1, "cpu")
    assert torch.rand(1, generator=big).item() >= 0 and torch.rand(1, generator=neg).item() >= 0
    # Unseeded generators draw from OS entropy: two of them do not agree.
    u, v = make_generator(None, "cpu"), make_generator(None, "cpu")
    assert not torch.equal(torch.rand(8, generator=u), torch.rand(8, generator=v))


# -- greedy ---------------------------------------------------------------------------------------

def test_greedy_rows_are_argmax_and_consume_no_randomness():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=1),
              SamplingParams(temperature=0.0, top_p=0.1, seed=3)] * 2
    gens = [make_generator(i, "cpu") for i in range(6)]
    out = Sampler()(logits, params, gens)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    fresh = [make_generator(i, "cpu") for i in range(6)]
    for g, f in zip(gens, fresh):                       # untouched generator states
        assert torch.equal(g.get_state(), f.get_state())


def test_greedy_ties_take_the_first_index():
    logits = torch.zeros(1, 10)
    logits[0, 3] = logits[0, 7] = 5.0
    assert Sampler()(logits, [SamplingParams(temperature=0)], [make_generator(0, "cpu")]).token_ids == [3]


# -- distributions --------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.floats(0.2, 3.0),
       top_k=st.sampled_from([-1, 0, 2, 5, 17, VOCAB, VOCAB + 10]), top_p=st.floats(0.05, 1.0))
def test_probs_match_direct_computation(seed, temperature, top_k, top_p):
    logits = _logits(1, seed=seed)
    expected = _reference_probs(logits[0].numpy(), temperature, top_k, top_p)
    # Keep away from the nucleus boundary, where float32 and float64 may legitimately disagree.
    cum = np.cumsum(np.sort(_reference_probs(logits[0].numpy(), temperature, top_k, 1.0))[::-1])
    assume(np.min(np.abs(cum - top_p)) > 1e-4 or top_p == 1.0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = Sampler().probs(logits, [params])[0].double().numpy()
    # Same support: filtered tokens are exactly 0; kept ones are > 0 unless float32 underflows them.
    assert np.all(got[expected == 0] == 0)
    assert np.all(got[expected > 1e-30] > 0)
    np.testing.assert_allclose(got, expected, atol=1e-5)          # float32 softmax vs float64


def test_probs_rows_mix_greedy_and_random():
    logits = _logits(3)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5), SamplingParams(top_k=1)]
    probs = Sampler().probs(logits, params)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), VOCAB).float())
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.5, dim=-1))
    assert probs[2].argmax() == logits[2].argmax() and probs[2].max() == 1.0


def test_top_k_support_of_many_draws():
    logits = _logits(1, seed=3, scale=0.5)[0]
    draws = _draw_many(logits, SamplingParams(temperature=1.0, top_k=6), n=3000)
    expected = set(torch.topk(logits, 6).indices.tolist())
    assert set(draws.tolist()) == expected


def test_top_p_support_of_many_draws():
    logits = _logits(1, seed=4)[0]
    p = _reference_probs(logits.numpy(), 1.0, -1, 1.0)
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    top_p = float((cum[3] + cum[4]) / 2)              # halfway: exactly 5 tokens in the nucleus
    draws = _draw_many(logits, SamplingParams(temperature=1.0, top_p=top_p), n=3000)
    assert set(draws.tolist()) == set(order[:5].tolist())


def test_top_p_always_keeps_the_top_token():
    logits = _logits(1, seed=5)[0]
    draws = _draw_many(logits, SamplingParams(temperature=1.0, top_p=1e-6), n=200)
    assert set(draws.tolist()) == {int(logits.argmax())}


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a zero-probability token was drawn"
    return float((((counts - expected) ** 2)[mask] / expected[mask]).sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=4, top_p=0.8),
])
def test_empirical_frequencies_match_probs(params):
    vocab, n = 8, 20_000
    logits = _logits(1, vocab=vocab, seed=6, scale=1.0)[0]
    probs = Sampler().probs(logits.unsqueeze(0), [params])[0].double().numpy()
    counts = np.bincount(_draw_many(logits, params, n=n), minlength=vocab)
    # df <= 7; P(chi2_7 > 35) ~ 1e-5, so this fails only when the sampler is wrong.
    assert _chi_square(counts, probs) < 35.0
    # Temperature really reshapes the distribution: compare against the T=1 softmax.
    if params.top_k == -1 and params.top_p == 1.0:
        plain = torch.softmax(logits.double(), -1).numpy()
        assert _chi_square(counts, plain) > 200.0


# -- logprobs -------------------------------------------------------------------------------------

def test_logprobs_are_of_the_raw_logits():
    logits = _logits(4, seed=8)
    params = [SamplingParams(temperature=0.3, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=2.0, top_k=3, seed=2), SamplingParams(top_p=0.5, seed=3)]
    out = Sampler()(logits, params, [make_generator(p.seed, "cpu") for p in params])
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw[torch.arange(4), torch.tensor(out.token_ids)]
    # logit - logsumexp (one pass, no [N, V] log-softmax): log_softmax's value up to float32 rounding
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, rtol=0, atol=1e-6)
    assert out.top_logprobs is None


def test_top_logprobs_lists_top_n_plus_the_sampled_token():
    logits = _logits(3, seed=9, scale=0.3)          # flat: the sampled token is often outside the top 2
    params = [SamplingParams(temperature=1.0, logprobs=2, seed=s) for s in range(3)]
    params[1] = SamplingParams(temperature=1.0, seed=1)              # this row did not ask
    params[2] = SamplingParams(temperature=0, logprobs=0)            # only the sampled token
    out = Sampler()(logits, params, [make_generator(i, "cpu") for i in range(3)])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs is not None
    top2 = torch.topk(raw[0], 2)
    expected0 = dict(zip(top2.indices.tolist(), top2.values.tolist()))
    expected0[out.token_ids[0]] = raw[0, out.token_ids[0]].item()
    assert out.top_logprobs[0] == expected0
    assert out.top_logprobs[1] == {}
    assert out.top_logprobs[2] == {out.token_ids[2]: raw[2, out.token_ids[2]].item()}
    assert out.token_ids[2] == int(logits[2].argmax())


def test_output_shape_and_types():
    out = Sampler()(_logits(2), [SamplingParams(seed=1), SamplingParams(temperature=0)],
                    [make_generator(1, "cpu"), make_generator(None, "cpu")])
    assert isinstance(out, SamplerOutput)
    assert len(out.token_ids) == len(out.logprobs) == 2
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in out.token_ids)
    assert all(isinstance(lp, float) and lp <= 0.0 for lp in out.logprobs)


def test_masked_tokens_are_never_drawn():
    # -inf logits (e.g. vocabulary padding) sit at the end of the cdf: u close to 1 must not reach them.
    logits = _logits(1, seed=10, scale=0.1)[0]
    logits[VOCAB // 2:] = float("-inf")
    for params in [SamplingParams(temperature=1.0), SamplingParams(temperature=5.0, top_p=0.99)]:
        draws = _draw_many(logits, params, n=2000)
        assert set(draws.tolist()) == set(range(VOCAB // 2))
