"""Prompt log-probabilities (`prompt_logprobs`): which rows of a step's flattened batch give them (`rows`) and
their entries, appended to each sequence as the rows come (`record`): position p's logits predict prompt
token p + 1, so a prompt computed in several chunks (chunked prefill, preemption) gets them chunk by chunk."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sched.scheduler import ScheduledSeq
    from engine.sequence import Sequence


def rows(scheduled: list[ScheduledSeq]) -> tuple[list[int], list[tuple[Sequence, int]]]:
    """Rows of the flattened batch whose logits give prompt log-probabilities (position p predicts
    prompt token p + 1), and for each row its sequence and the position of the token it predicts."""
    rows: list[int] = []
    targets: list[tuple[Sequence, int]] = []
    offset = 0
    for s in scheduled:
        seq = s.seq
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            # from the first position not done yet: a prefill restarted by preemption skips the rest
            start = max(seq.num_computed, len(seq.prompt_logprobs) - 1)
            for p in range(start, min(seq.num_computed + s.num_new, seq.num_prompt_tokens - 1)):
                rows.append(offset + p - seq.num_computed)
                targets.append((seq, p + 1))
        offset += s.num_new
    return rows, targets

def record(logits: torch.Tensor, targets: list[tuple[Sequence, int]]) -> None:
    """Appends each target's entry (its token's log-probability and the row's top prompt_logprobs) to its
    sequence's prompt_logprobs; `logits` [R, V] are the rows `rows` named."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                       # [R, V]
    ids = torch.tensor([seq.token_ids[pos] for seq, pos in targets], device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    k = max(seq.params.prompt_logprobs or 0 for seq, _ in targets)
    top_v, top_i = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for (seq, pos), token, lp, vs, ix in zip(targets, ids.tolist(), chosen, top_v.tolist(), top_i.tolist()):
        assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == pos
        n = seq.params.prompt_logprobs or 0
        entry = dict(zip(ix[:n], vs[:n]))
        entry[token] = lp
        seq.prompt_logprobs.append(entry)


__all__ = ["record", "rows"]
