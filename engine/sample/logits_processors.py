"""Per-request adjustments of a step's logits before sampling, batched over the rows that ask for them.

In vLLM's order and with its semantics (OpenAI's where it has them), on the raw logits:
  1. logit_bias: token id -> bias in [-100, 100], added;
  2. min_tokens: EOS and the stop token ids get -inf until that many tokens were generated;
  3. repetition_penalty r (CTRL / transformers): a token seen in the prompt or the output has its logit
     divided by r if positive, multiplied by r if negative;
  4. frequency_penalty f and presence_penalty p (OpenAI): logit -= f * count + p * (count > 0), counts
     over the generated tokens only.
Temperature, min_p, top-k and top-p come after, in the sampler. Rows that ask for none of these pay
nothing: no tensor is built for them. Each control is one tensor operation over the rows that use it
(the token counts come from one scatter over the padded token lists), never a Python loop over tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sequence import SamplingParams


@dataclass(frozen=True)
class RowContext:
    """What the processors need to know of a row's sequence (references, not copies)."""

    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int]
    stop_ids: frozenset[int]            # EOS (unless ignored) and the stop token ids: min_tokens masks them


def needs_processing(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0 or p.frequency_penalty
                or p.presence_penalty)


def apply(logits: torch.Tensor, params: list[SamplingParams], contexts: list[RowContext]) -> torch.Tensor:
    """`logits` [N, V] with every row's adjustments; the input itself when no row has any."""
    rows = [i for i, p in enumerate(params) if needs_processing(p)]
    if not rows:
        return logits
    out = logits.clone()
    device, vocab = logits.device, logits.shape[-1]
    _logit_bias(out, [(i, params[i]) for i in rows if params[i].logit_bias], vocab)
    masked = [(i, t) for i in rows if params[i].min_tokens and len(contexts[i].output_token_ids) < params[i].min_tokens
              for t in sorted(contexts[i].stop_ids) if 0 <= t < vocab]
    if masked:
        out[torch.tensor([i for i, _ in masked], device=device),
            torch.tensor([t for _, t in masked], device=device)] = float("-inf")
    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep:
        seen = _token_table(rep, [list(contexts[i].prompt_token_ids) + list(contexts[i].output_token_ids)
                                  for i in rep], vocab, device) > 0
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], device=device)[:, None]
        sub = out[rep]
        out[rep] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    freq = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
    if freq:
        counts = _token_table(freq, [list(contexts[i].output_token_ids) for i in freq], vocab, device)
        f = torch.tensor([params[i].frequency_penalty for i in freq], device=device)[:, None]
        p = torch.tensor([params[i].presence_penalty for i in freq], device=device)[:, None]
        out[freq] = out[freq] - f * counts - p * (counts > 0).to(out.dtype)
    return out


def _logit_bias(out: torch.Tensor, rows: list[tuple[int, SamplingParams]], vocab: int) -> None:
    if not rows:
        return
    r, c, v = [], [], []
    for i, p in rows:
        assert p.logit_bias is not None
        for token, bias in p.logit_bias.items():
            if 0 <= token < vocab:
                r.append(i)
                c.append(token)
                v.append(bias)
    if r:
        dev = out.device
        out.index_put_((torch.tensor(r, device=dev), torch.tensor(c, device=dev)),
                       torch.tensor(v, dtype=out.dtype, device=dev), accumulate=True)


def _token_table(rows: list[int], token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), V] float32 counts of each token id in each list (one scatter over the padded lists)."""
    width = max(1, max(len(t) for t in token_lists))
    padded = torch.full((len(rows), width), vocab, dtype=torch.long)     # pad: an extra column, dropped
    for j, tokens in enumerate(token_lists):
        if tokens:
            padded[j, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab].to(device)
