"""LLMEngine: the synchronous engine core. add / abort / step; one thread drives it.

It owns the model, the KV cache, the block manager and the scheduler. `step()` runs one scheduled
batch and returns the deltas of every request that progressed. The async layer (async_engine.py)
and the offline API (llm.py) both drive this class.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.block_pool import BlockPool, PinCapError
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequest, PinCapExceeded, QueueFull
from engine.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.models.loader import LoadedModel, load_model
from engine.sampler import make_generator
from engine.scheduler import Scheduler
from engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence
from kernels import get_backend

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_pinned: int
    kv_blocks_cached: int
    kv_blocks_free: int
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    prefix_cache_queried_tokens_total: int
    prefix_cache_hit_tokens_total: int


@dataclass(frozen=True)
class PinnedPrefix:
    num_tokens: int
    num_pinned_blocks: int
    block_hashes: list[str]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None:
            model = config.model
            if model is None:
                from engine.models.demo import demo_model_path
                model = str(demo_model_path())
            loaded = load_model(model, device=config.device, dtype=config.dtype)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        args = loaded.args
        limit = args.max_position_embeddings
        if args.sliding_window is not None:
            limit = min(limit, args.sliding_window)  # no sliding-window attention: stay inside one window
        self.max_model_len = min(config.max_model_len or limit, limit)
        dtype = _DTYPES[config.dtype]
        num_blocks = config.num_kv_blocks or KVCache.blocks_for_budget(
            args, config.block_size, dtype, config.kv_cache_memory_gb * 2**30)
        self.pool = BlockPool(num_blocks, max_pinned_blocks=int(num_blocks * config.pinned_fraction))
        self.manager = BlockManager(self.pool, config.block_size, loaded.fingerprint, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.kv_cache = KVCache(args, num_blocks, config.block_size, dtype, config.device)
        assert config.attention_backend is not None
        self.runner = ModelRunner(loaded.model, self.kv_cache, get_backend(config.attention_backend), config.device)
        self.requests: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks a request against the model and the cache; returns its resolved max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the prompt must contain at least one token", param="prompt")
        vocab = self.loaded.args.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
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
        need = -(-(n + max_tokens) // self.config.block_size)
        usable = self.pool.num_blocks_total - self.pool.num_pinned + self.manager.num_pinned_hits(prompt_token_ids)
        if need > usable:
            raise InvalidRequest(
                f"the request needs {need} KV blocks but the cache has {usable} for it "
                f"({self.pool.num_pinned} of {self.pool.num_blocks_total} are pinned)", param="max_tokens")
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    pin_on_finish: bool = False) -> Sequence:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="id")
        max_tokens = self.validate(prompt_token_ids, params)
        if len(self.scheduler.waiting) >= self.config.max_num_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_num_waiting} requests)")
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, next(self._arrivals), max_tokens)
        seq.pin_on_finish = pin_on_finish
        seq.generator = make_generator(params.seed, self.config.device)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort", delta_ids=[], delta_text="")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for seq in sched.failed:
            seq.error = "the request can never fit the KV cache"
            outputs.append(self._finish(seq, "abort", [], ""))
        if not sched.scheduled:
            return outputs
        tables = [self.manager.block_table(s.seq.seq_id) for s in sched.scheduled]
        sampled = self.runner.execute(sched.scheduled, tables, sched.copies)
        self.scheduler.update(sched)
        row = 0
        for s in sched.scheduled:
            if not s.sample:
                continue
            seq = s.seq
            assert sampled is not None
            i, row = row, row + 1
            if seq.max_tokens == 0:  # prefill only (a prefix being pinned)
                outputs.append(self._finish(seq, "length", [], ""))
                continue
            token = sampled.token_ids[i]
            seq.token_ids.append(token)
            seq.cumulative_logprob += sampled.logprobs[i]
            if seq.logprobs is not None and sampled.top_logprobs is not None:
                seq.logprobs.append(sampled.top_logprobs[i])
            outputs.append(self._after_token(seq, token))
        return outputs

    def _after_token(self, seq: Sequence, token: int) -> RequestOutput:
        params = seq.params
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return self._finish(seq, "stop", [token], seq.detokenizer.flush())
        if not params.ignore_eos and token in self.loaded.eos_token_ids:
            return self._finish(seq, "stop", [token], seq.detokenizer.flush())
        text, stop = seq.detokenizer.update([token])
        if stop is not None:
            seq.stop_reason = stop
            return self._finish(seq, "stop", [token], text)
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length", [token], text + seq.detokenizer.flush())
        return self._output(seq, [token], text)

    def _finish(self, seq: Sequence, reason: str, delta_ids: list[int], delta_text: str) -> RequestOutput:
        if seq.pin_on_finish and reason == "length" and self.manager.has(seq.seq_id):
            try:
                self.manager.pin(seq.prompt_token_ids)
            except PinCapError as exc:
                seq.error = str(exc)
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)
        seq.finish_reason = reason
        return self._output(seq, delta_ids, delta_text)

    def _output(self, seq: Sequence, delta_ids: list[int], delta_text: str) -> RequestOutput:
        out = CompletionOutput(
            index=0, text=delta_text, token_ids=delta_ids, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[-len(delta_ids):] if seq.logprobs and delta_ids else None)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, [out], seq.finished,
                             num_cached_tokens=max(seq.num_cached_tokens, 0), error=seq.error)

    # -- prefixes -----------------------------------------------------------------------------
    def check_pin(self, token_ids: list[int]) -> None:
        """Raises PinCapExceeded if pinning this prefix could not fit under the cap."""
        new = self.manager.new_pins_needed(token_ids)
        if self.pool.num_pinned + new > self.pool.max_pinned_blocks:
            raise PinCapExceeded(
                f"pinning this prefix needs {new} more KV blocks, over the cap of {self.pool.max_pinned_blocks} "
                f"pinned blocks ({self.pool.num_pinned} already pinned); nothing was pinned", param="prompt")

    def pin_prefix(self, token_ids: list[int]) -> PinnedPrefix:
        """Computes the prefix's KV (prefix-cache hits are reused) and pins its full blocks."""
        self.check_pin(token_ids)
        if self.manager.cached_prefix_blocks(token_ids) is None:
            rid = f"pin-{next(self._seq_ids)}"
            seq = self.add_request(rid, token_ids, SamplingParams(max_tokens=0, temperature=0.0), pin_on_finish=True)
            while not seq.finished:
                self.step()
            if seq.error:
                raise PinCapExceeded(seq.error, param="prompt")
        else:
            try:
                self.manager.pin(token_ids)
            except PinCapError as exc:
                raise PinCapExceeded(str(exc), param="prompt") from exc
        return self.pinned_prefix(token_ids)

    def pinned_prefix(self, token_ids: list[int]) -> PinnedPrefix:
        hashes = self.manager.block_hashes(token_ids)
        return PinnedPrefix(len(token_ids), len(hashes), [h.hex() for h in hashes])

    def unpin_prefix(self, token_ids: list[int]) -> int:
        return self.manager.unpin(token_ids)

    def stats(self) -> EngineStats:
        p = self.pool.stats()
        s = self.scheduler
        return EngineStats(p.total, p.used, p.pinned, p.cached, p.free, len(s.running), len(s.waiting),
                           s.num_preemptions, s.prefix_queried_tokens, s.prefix_hit_tokens)
