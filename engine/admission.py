"""Admission: the checks a request passes before it may wait for a turn.

Two kinds, on two threads:
- `make_request`: checks on what never changes once the engine is built (the prompt, the vocabulary, the
  context length, the cache's size), so any thread may call it (the async engine calls it on the event
  loop, before a request is queued to the engine thread);
- `check_room`: checks on the cache as it is now (the pinned blocks a request cannot use, the tenant's
  place in the waiting queue): the core's owning thread only, at `EngineCore.add`.

Both raise InvalidRequest (a 4xx: the request can never run as asked) or QueueFull (retry later).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.errors import InvalidRequest, QueueFull
from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockHash, BlockPool
from engine.sequence import EngineRequest, SamplingParams


@dataclass(frozen=True)
class Admission:
    """The engine's fixed facts the checks read. NOTE: frozen: nothing here changes after construction,
    which is what makes `make_request` safe off the engine thread."""

    max_num_seqs: int
    max_num_waiting: int
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks_total: int

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     tenant: str = "") -> EngineRequest:
        """Checks on fixed inputs only (prompt, vocabulary, context length): safe on any thread. `tenant`: whose
        request it is, an opaque key the scheduler shares its turns between. Raises InvalidRequest."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the prompt must contain at least one token", param="prompt")
        if params.use_beam_search and params.stop:
            raise InvalidRequest("stop strings are not supported with beam search", param="stop")
        width = params.best_of or params.n
        if width > self.max_num_seqs:
            # Every sample (or beam) is a sequence of its own in the batch; a beam search steps only when all
            # its beams have their logits, so more beams than batch seats could never step (item 18 of issue 24)
            param = "best_of" if width > params.n else "n"
            raise InvalidRequest(f"{param} ({width}) must be at most the batch's max_num_seqs "
                                 f"({self.max_num_seqs}): each sample or beam runs as its own sequence",
                                 param=param)
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if n >= self.max_model_len and not (n == self.max_model_len and params.max_tokens == 0):
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {n} "
                "tokens, leaving no room to generate.", param="prompt")
        max_tokens = self.max_model_len - n if params.max_tokens is None else params.max_tokens
        if n + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion).", param="max_tokens")
        need = self.blocks_needed(n, max_tokens, params)
        if need > self.num_blocks_total:
            raise InvalidRequest(f"the request needs {need} KV blocks but the cache has "
                                 f"{self.num_blocks_total} in all", param="max_tokens")
        return EngineRequest(request_id, list(prompt_token_ids), params, max_tokens, time.monotonic(), tenant=tenant)

    def blocks_needed(self, num_prompt: int, max_tokens: int, params: SamplingParams) -> int:
        # prompt blocks are shared by every sample / beam; each has its own output blocks (+1 for CoW)
        b = self.block_size
        extra = (params.best_of or 1) - 1
        return -(-(num_prompt + max_tokens) // b) + extra * (-(-max_tokens // b) + 1)

    def check_room(self, request: EngineRequest, hashes: list[BlockHash], pool: BlockPool, manager: BlockManager,
                   waiting: int) -> None:
        """Checks against the cache as it is now (owning thread only): the request must fit beside the pinned
        blocks (those it would reuse count for it), and its tenant's `waiting` requests must leave room in the
        queue. `hashes`: the prompt's block hashes ([] without prefix caching)."""
        prompt = request.prompt_token_ids
        need = self.blocks_needed(len(prompt), request.max_tokens, request.params)
        pinned_hits = 0                       # leading pinned blocks this prompt would reuse
        if hashes:
            for block in manager.cached_blocks(prompt, hashes[:(len(prompt) - 1) // self.block_size]):
                if block is None or block.pin_count == 0:
                    break
                pinned_hits += 1
        usable = pool.num_blocks_total - pool.num_pinned + pinned_hits
        if need > usable:
            raise InvalidRequest(
                f"the request needs {need} KV blocks but the cache has {usable} for it "
                f"({pool.num_pinned} of {pool.num_blocks_total} are pinned)", param="max_tokens")
        if waiting >= self.max_num_waiting:   # per tenant: see config
            raise QueueFull(f"the waiting queue is full ({self.max_num_waiting} requests); retry later")
