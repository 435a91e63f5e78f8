"""Forks: the sequences a request adds once its prompt is computed, for parallel sampling (n, best_of)
and beam search.

A fork shares every block of its parent by reference count (BlockManager.fork); the first write into a
shared partial block copies it (copy-on-write, done by the block manager when the scheduler grows the
sequence). A fork starts RUNNING with its parent's computed state, so it never recomputes the prompt.

- Parallel sampling: when sequence 0 finishes the prompt, best_of - 1 children fork from it, before
  the first token is sampled; child i draws from its own seeded stream.
- Beam search: each step, the live beams' next-token log-probabilities go to BeamSearch, which picks
  the next W beams; a beam picked twice forks, a beam not picked ends (its blocks are freed).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.kv.block_manager import BlockManager
from engine.sched.beam_search import BeamSearch
from engine.sched.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, SequenceGroup, Status


class NewSeq(Protocol):
    def __call__(self, request_id: str, token_ids: list[int], params: SamplingParams, max_tokens: int, index: int,
                 prompt_len: int | None = None, arrival: float | None = None) -> Sequence: ...


class Forks:
    def __init__(self, manager: BlockManager, scheduler: Scheduler, new_seq: NewSeq,
                 finish_seq: Callable[[Sequence, str], None]) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.new_seq = new_seq
        self.finish_seq = finish_seq

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int, prompt_len: int | None) -> Sequence:
        child = self.new_seq(group.request_id, parent.token_ids, parent.params, parent.max_tokens, index,
                             prompt_len=prompt_len, arrival=parent.arrival)
        child.num_computed, child.num_cached_tokens = parent.num_computed, parent.num_cached_tokens
        child.tenant = parent.tenant
        self.manager.fork(parent.seq_id, child.seq_id)
        self.scheduler.add_running(child)
        child.group = group
        return child

    def fork_samples(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: best_of - 1 children of the freshly computed prompt."""
        group.forked = True
        children = [self._fork(group, parent, index, None) for index in range(1, group.best_of)]
        group.seqs.extend(children)
        return children

    def end_unsampled(self, group: SequenceGroup, parent: Sequence) -> None:
        """max_tokens 0 (a scoring or cache-writing prefill) with n, best_of or beams > 1: nothing is sampled, so
        every other sample (or beam) is the same empty completion as the first. They are made finished, never
        running: no seat, no block, no fork. Without them the request would wait forever for samples that
        nothing forks (issue 34, item 4)."""
        group.forked = True
        for index in range(1, group.best_of):
            child = self.new_seq(group.request_id, parent.token_ids, parent.params, 0, index,
                                 prompt_len=parent.num_prompt_tokens, arrival=parent.arrival)
            child.num_computed, child.num_cached_tokens = parent.num_computed, parent.num_cached_tokens
            child.status, child.finish_reason, child.group = Status.FINISHED, "length", group
            group.seqs.append(child)

    def start_beam_search(self, group: SequenceGroup, eos_token_ids: frozenset[int]) -> None:
        params = group.params
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        group.beam = BeamSearch(group.best_of, len(group.prompt_token_ids), group.max_tokens, frozenset(eos),
                                params.length_penalty, params.early_stopping)

    def beam_step(self, group: SequenceGroup) -> None:
        """Every live beam has its next-token log-probabilities: choose, fork, free. When the search
        ends, every live beam ends with it."""
        live = group.seqs
        assert group.beam is not None
        logprobs = torch.stack([s.pending_logprobs for s in live])  # type: ignore[misc]
        for s in live:
            s.pending_logprobs = None
        choices = group.beam.step(logprobs, [s.cumulative_logprob for s in live], [s.output_token_ids for s in live])
        used: set[int] = set()
        new_live: list[Sequence] = []
        for c in choices:                                   # fork first: children copy the parent's tokens
            if c.parent in used:
                parent = live[c.parent]
                new_live.append(self._fork(group, parent, 0, parent.num_prompt_tokens))
            else:
                used.add(c.parent)
                new_live.append(live[c.parent])
        for seq, c in zip(new_live, choices):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.score
        for i, seq in enumerate(live):                      # dropped beams give their blocks back
            if i not in used:
                self.finish_seq(seq, "stop")
        group.seqs = new_live
        if group.beam.done:
            for seq in new_live:
                self.finish_seq(seq, "length")
