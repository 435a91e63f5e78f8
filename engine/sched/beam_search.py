"""Beam search state of one request, step by step, with the selection rules of transformers' `generate`
(num_beams=W, do_sample=False, length_penalty, early_stopping), so results match it token for token.

Per step, given the log-probabilities [L, V] of the L live beams (L <= W) for their next token:
  1. candidates: the top K = max(2, 1 + #eos) * W of (beam score + log p) over all L * V continuations;
  2. a candidate that ends in EOS, or reaches max length, is a finished hypothesis if it ranks in the
     top W; its score is (sum of log p) / (generated length ** length_penalty);
  3. the W best candidates that did not finish become the next live beams (in score order);
  4. stop when no live beam can beat the worst of W finished hypotheses (transformers' heuristic),
     when early_stopping is True and W hypotheses have finished, or when every candidate finished.
This class only decides; the engine forks and frees the beams' KV blocks accordingly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG = -1.0e9


@dataclass
class Hypothesis:
    token_ids: list[int]        # generated tokens (EOS included when it ended on one)
    score: float                # length-penalized
    logprob: float              # raw sum of log-probabilities


@dataclass
class BeamChoice:
    parent: int                 # index into the live beams given to `step`
    token: int
    score: float                # running sum of log-probabilities


@dataclass
class BeamSearch:
    width: int
    prompt_len: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    finished: list[Hypothesis] = field(default_factory=list)     # best first, at most `width`
    improvable: bool = True
    done: bool = False

    def step(self, logprobs: torch.Tensor, scores: list[float], generated: list[list[int]]) -> list[BeamChoice]:
        """logprobs: [L, V] log-softmax rows of the live beams, in beam order; scores: their running sums;
        generated: their generated tokens so far. Returns the next live beams (best first)."""
        num_live, vocab = logprobs.shape
        cur_gen = len(generated[0])                 # tokens generated so far (same for every beam)
        total = logprobs.float() + torch.tensor(scores, dtype=torch.float32, device=logprobs.device)[:, None]
        k = min(max(2, 1 + len(self.eos_token_ids)) * self.width, num_live * vocab)
        top_scores, top_idx = torch.topk(total.reshape(-1), k)
        top_scores_l, top_idx_l = top_scores.tolist(), top_idx.tolist()
        at_max = cur_gen + 1 >= self.max_tokens
        hits = [at_max or (i % vocab) in self.eos_token_ids for i in top_idx_l]

        # finished hypotheses: only the top `width` candidates may enter
        full = len(self.finished) >= self.width
        if self.improvable and not (self.early_stopping is True and full):
            penalty = (cur_gen + 1) ** self.length_penalty
            for j in range(min(self.width, k)):
                if hits[j]:
                    beam, token = divmod(top_idx_l[j], vocab)
                    self.finished.append(Hypothesis(generated[beam] + [token], top_scores_l[j] / penalty,
                                                    top_scores_l[j]))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width:]

        choices = [BeamChoice(i // vocab, i % vocab, s) for i, s, h in zip(top_idx_l, top_scores_l, hits) if not h]
        choices = choices[:self.width]

        # transformers' early-stop heuristic, evaluated with the new length
        if choices and len(self.finished) >= self.width:
            gen_len = cur_gen + 1
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                gen_len = self.max_tokens
            best_possible = choices[0].score / (gen_len ** self.length_penalty)
            worst = min(h.score for h in self.finished)
            self.improvable = self.improvable and best_possible > worst
        full = len(self.finished) >= self.width
        self.done = (not choices or not self.improvable or (self.early_stopping is True and full))
        return [] if self.done else choices

    def results(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
