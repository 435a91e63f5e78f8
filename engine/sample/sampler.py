"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, log-probabilities.

One call samples one token for each row of a [N, V] logits batch. Rows are independent: a seeded
request draws the same tokens whichever other requests share its batch and in whatever order, because
its randomness comes only from its own generator and its own row.

NOTE: each random row consumes exactly one float64 uniform from its generator per step, and greedy rows
consume none. A request's token stream is therefore a function of (seed, logits it sees) only.
Why inverse-CDF rather than the exponential race (argmax p / q, q ~ Exp(1)^V): the race needs V draws
per row, ~100 ns each on a CPU (200 ms a step for 64 rows of a 32k vocabulary); one uniform and a
cumulative sum cost a few milliseconds and are just as batch-invariant. Rows that ask for no filter (no
min-p, top-k, top-p) draw through the op layer's fused kernel where there is one (kernels/cpu/logits.cpp
row_sample: the same inverse CDF in one pass over the row; its agreement criterion in kernels/cpu/logits.py).
"""
from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field

import torch

from engine.sample import logits_processors
from engine.sample.logits_processors import RowContext
from engine.sequence import SamplingParams
from kernels.ops import Ops, default_ops

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 64) - 1      # torch.Generator.manual_seed takes 64-bit values


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A per-request generator on `device`: seeded from `seed` (taken mod 2**64) when given, else
    from fresh OS entropy, so that unseeded requests never share a stream."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed if seed is not None else secrets.randbits(64)) & _SEED_MASK)
    return generator


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                           # log_softmax(raw logits) at the sampled token
    top_logprobs: list[dict[int, float]] | None     # per row; {} for rows that did not ask; None if none asked
    failed: list[int] = field(default_factory=list)  # rows whose logits held NaN or +inf: no token for them


class Sampler:
    """Stateless but for the op layer it reduces logits with; one instance serves every step.

    Every row: its logits processors first (engine/sample/logits_processors.py: bias, min_tokens, penalties).
    Random rows: logits / temperature -> min-p -> top-k -> top-p (on the top-k-renormalized
    distribution) -> one draw per row by inverse CDF: u ~ U[0, 1) from the row's generator, the token
    is the first whose cumulative probability (float64, vocabulary order) exceeds u.
    Greedy rows (temperature < 1e-5, or top_k 1): argmax of the processed logits, first index on ties.
    Log-probabilities are always those of the raw, unscaled logits (what transformers and OpenAI report).
    A row whose raw logits hold NaN or +inf (a broken forward pass) is reported in `failed` and gets
    token 0; the other rows are untouched by it (every operation here is per row).
    """

    def __init__(self, ops: Ops | None = None) -> None:
        self.ops = ops or default_ops()

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                 contexts: list[RowContext] | None = None) -> SamplerOutput:
        # logits: [N, V] float32; params[i], generators[i] and contexts[i] belong to row i (contexts are
        # needed only by rows with logits processors). Greedy rows' generators are never touched.
        num_rows = logits.shape[0]
        assert len(params) == num_rows == len(generators), (logits.shape, len(params), len(generators))
        logits = logits.float()
        # NOTE: one pass over the vocabulary gives both the log-normalizer and the broken rows: a NaN logit
        # makes a row's log-sum-exp NaN, a +inf logit makes it +inf (torch's logsumexp handles infinities);
        # log-probabilities are then logit - lse, for the few tokens reported, never a [N, V] log_softmax.
        # The op layer may give the argmax with it (the C++ kernel: torch.argmax's index exactly, logsumexp
        # within float32 rounding; 0.6 ms against 3-5 ms at 64 rows).
        lse, fused_argmax = self.ops.row_stats(logits)                   # [N], [N] or None
        broken = torch.isnan(lse) | torch.isposinf(lse)                  # [N]
        failed = broken.nonzero().flatten().tolist()
        if failed:
            logits = logits.masked_fill(broken[:, None], 0.0)
            lse = torch.where(broken, torch.full_like(lse, math.log(logits.shape[-1])), lse)
        raw = logits                                                     # the raw logits, before processors
        if contexts is not None:
            logits = logits_processors.apply(logits, params, contexts)
        # [N]; greedy answer for every row (the fused argmax is of the raw logits: without processors only)
        token_ids = fused_argmax if fused_argmax is not None and contexts is None and not failed else \
            logits.argmax(dim=-1)

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            uniform = torch.empty(len(random_rows), dtype=torch.float64, device=logits.device)
            for j, i in enumerate(random_rows):
                uniform[j].uniform_(generator=generators[i])
            if len(random_rows) == num_rows:                             # no copy of the rows
                token_ids = self._draw(logits, params, uniform)
            else:
                index = torch.tensor(random_rows, device=logits.device)
                token_ids[index] = self._draw(logits[index], [params[i] for i in random_rows], uniform)

        token_ids = token_ids.clamp_(0, logits.shape[-1] - 1)
        if failed:
            token_ids[broken] = 0
        ids = token_ids.tolist()
        logprobs = (raw.gather(1, token_ids.unsqueeze(1)).squeeze(1) - lse).tolist()
        return SamplerOutput(token_ids=ids, logprobs=logprobs,
                             top_logprobs=self._top_logprobs(raw, lse, ids, logprobs, params), failed=failed)

    def row_by_row(self, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator],
                   contexts: list[RowContext] | None) -> SamplerOutput:
        """`__call__` one row at a time, after a batch failed: the rows that fail alone are `failed` (token 0),
        the others sampled as the batch would have sampled them."""
        ids, logprobs, tops, failed = [], [], [], []
        for j in range(len(params)):
            try:
                one = self(logits[j:j + 1], params[j:j + 1], gens[j:j + 1],
                                   contexts[j:j + 1] if contexts is not None else None)
                ids.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
                tops.append(one.top_logprobs[0] if one.top_logprobs is not None else {})
                failed += [j] if one.failed else []
            except Exception:
                log.exception("sampling failed for one row")
                ids.append(0)
                logprobs.append(0.0)
                tops.append({})
                failed.append(j)
        return SamplerOutput(ids, logprobs, tops if any(p.logprobs is not None for p in params) else None, failed)

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The exact distribution `__call__` draws each row from: [N, V], rows sum to 1.
        Greedy rows are one-hot at the argmax."""
        logits = logits.float()
        out = torch.zeros_like(logits)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        out[greedy] = torch.nn.functional.one_hot(
            logits[greedy].argmax(dim=-1), logits.shape[-1]).to(out.dtype)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            out[index] = self._filtered_probs(logits[index], [params[i] for i in random_rows])
        return out

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
        """[M, V] random rows, u [M] float64 -> [M] tokens by inverse CDF. Rows that ask for no filter take the
        op layer's fused draw where it has one (one pass, no [M, V] temporaries)."""
        if not any(self._filters(p, logits.shape[-1]) for p in params):
            temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
            chosen = self.ops.sample_softmax(logits, temperature, uniform)
            if chosen is not None:
                return chosen
        probs = self._filtered_probs(logits, params)                     # [M, V]
        cdf = probs.double().cumsum(dim=-1)                              # [M, V]
        total = cdf[:, -1:].contiguous()                                 # [M, 1], 1 up to rounding
        # right=True: a zero-probability token never exceeds its predecessor's cdf, so it is never
        # chosen. u * total < total, except by rounding; the minimum keeps that case in the support.
        choice = torch.searchsorted(cdf, uniform[:, None] * total, right=True)
        return torch.minimum(choice, torch.searchsorted(cdf, total)).squeeze(1)  # last token with p > 0

    @staticmethod
    def _filters(p: SamplingParams, vocab: int) -> bool:
        """Whether a random row asks for more than softmax(logits / temperature): min-p, top-k or top-p."""
        return bool(p.min_p) or 0 < p.top_k < vocab or p.top_p < 1.0

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # logits: [M, V] of non-greedy rows -> probabilities after temperature, top-k, top-p.
        device, vocab = logits.device, logits.shape[-1]
        temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        scaled = logits / temperature.unsqueeze(1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            # min-p (vLLM): drop tokens whose probability is below min_p x the top token's
            probs = torch.softmax(scaled, dim=-1)
            floor = torch.tensor(min_p, device=device, dtype=probs.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        # top_p == 1 is "off": +inf keeps the float32 cumsum, which may round up to 1, from cutting the tail.
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        k_max = max(top_k)
        if k_max == vocab and all(p == float("inf") for p in top_p):
            return torch.softmax(scaled, dim=-1)                         # no filtering: skip the sort

        # One descending top-k_max serves both filters (a full sort only when some row has top-k off).
        # Ties at the k-th place are broken by sort order, so exactly min(k, V) tokens survive top-k.
        sorted_logits, order = scaled.topk(k_max, dim=-1)                # [M, K], descending
        rank = torch.arange(k_max, device=device).unsqueeze(0)           # [1, K]
        k = torch.tensor(top_k, device=device).unsqueeze(1)              # [M, 1]
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Nucleus: keep token r iff the mass strictly above it is < p. That is the smallest prefix whose
        # mass reaches p, and rank 0 (mass above = 0 < p) always stays.
        p = torch.tensor(top_p, device=device, dtype=sorted_probs.dtype).unsqueeze(1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = (mass_above < p) | (rank == 0)
        sorted_probs = sorted_probs.masked_fill(~keep, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, order, sorted_probs)

    @staticmethod
    def _top_logprobs(raw: torch.Tensor, lse: torch.Tensor, token_ids: list[int], logprobs: list[float],
                      params: list[SamplingParams]) -> list[dict[int, float]] | None:
        # One topk over all rows at the largest n asked; each row keeps its own first n.
        # A dict holds n entries, or n + 1 when the sampled token is not among the top n.
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return None
        max_n = min(max(n for n in wanted if n is not None), raw.shape[-1])
        values, ids = raw.topk(max_n, dim=-1)                           # [N, max_n], sorted
        values = values - lse[:, None]
        values_l, ids_l = values.tolist(), ids.tolist()
        out: list[dict[int, float]] = []
        for row, n in enumerate(wanted):
            entry: dict[int, float] = {}
            if n is not None:
                entry = dict(zip(ids_l[row][:n], values_l[row][:n]))
                entry[token_ids[row]] = logprobs[row]    # the sampled token is always reported
            out.append(entry)
        return out
