"""The constrained rows of a step (structured output), before sampling: each masked to what its grammar
allows next (`mask`; a sequence gets its matcher when it first samples), then the rows the mask leaves with
no way on (`limits`). engine/sample/structured.py has the grammars themselves."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequest
from engine.sample.logits_processors import RowContext

if TYPE_CHECKING:
    from engine.sample.structured import Grammars
    from engine.sequence import Sequence


def mask(grammars: Grammars, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Masks the constrained rows of `logits` in place to what their grammars allow next."""
    for seq in seqs:
        if seq.guide is None:
            assert seq.group is not None and seq.group.grammar is not None
            seq.guide = grammars.matcher(seq.group.grammar)
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index).float()
    grammars.apply(sub, [s.guide for s in seqs])
    logits.index_copy_(0, index, sub.to(logits.dtype))


def limits(logits: torch.Tensor, targets: list[Sequence], contexts: list[RowContext] | None,
           rows: list[int]) -> list[tuple[Sequence, InvalidRequest]]:
    """After masking: a constrained row whose grammar allows no token at all (a dead end: a rule that can never
    finish) is returned with the 400-class error its request ends with; one whose grammar allows nothing but
    its end while min_tokens still bans the stop tokens ends there: the grammar's end wins over min_tokens (its
    stop tokens are unmasked for that row: its context loses them), finish_reason "stop"."""
    dead: list[tuple[Sequence, InvalidRequest]] = []
    allowed = torch.isfinite(logits[rows])                                     # [R, V]
    for k, j in enumerate(rows):
        seq = targets[j]
        if not bool(allowed[k].any()):
            spec = seq.params.structured
            assert spec is not None
            dead.append((seq, InvalidRequest(
                f"the {spec.kind.replace('_', ' ')} constraint admits no continuation after "
                f"{len(seq.output_token_ids)} tokens (a rule of it can never finish)", param=spec.param)))
            continue
        ctx = contexts[j] if contexts is not None else None
        if ctx is None or not ctx.stop_ids or len(ctx.output_token_ids) >= seq.params.min_tokens:
            continue
        row = allowed[k].clone()
        row[[t for t in ctx.stop_ids if 0 <= t < row.shape[0]]] = False
        if not bool(row.any()):
            contexts[j] = RowContext(ctx.output_token_ids, ctx.prompt_token_ids, frozenset())  # type: ignore[index]
    return dead


__all__ = ["limits", "mask"]
