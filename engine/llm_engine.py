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
from engine.beam_search import BeamSearch
from engine.sampler import Sampler
from engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence, SequenceGroup
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
        self.sampler = Sampler()
        self.requests: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks a request against the model and the cache; returns its resolved max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the prompt must contain at least one token", param="prompt")
        if params.use_beam_search and params.stop:
            raise InvalidRequest("stop strings are not supported with beam search", param="stop")
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
        b = self.config.block_size
        # prompt blocks are shared by every sample / beam; each has its own output blocks (+1 for CoW)
        extra = (params.best_of or 1) - 1
        need = -(-(n + max_tokens) // b) + extra * (-(-max_tokens // b) + 1)
        usable = self.pool.num_blocks_total - self.pool.num_pinned + self.manager.num_pinned_hits(prompt_token_ids)
        if need > usable:
            raise InvalidRequest(
                f"the request needs {need} KV blocks but the cache has {usable} for it "
                f"({self.pool.num_pinned} of {self.pool.num_blocks_total} are pinned)", param="max_tokens")
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    pin_on_finish: bool = False) -> SequenceGroup:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="id")
        max_tokens = self.validate(prompt_token_ids, params)
        if len(self.scheduler.waiting) >= self.config.max_num_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_num_waiting} requests)")
        seq = self._new_seq(request_id, list(prompt_token_ids), params, next(self._arrivals), max_tokens, 0)
        seq.pin_on_finish = pin_on_finish
        group = SequenceGroup(request_id, params, seq)
        if params.use_beam_search:
            eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.loaded.eos_token_ids))
            group.beam = BeamSearch(group.best_of, len(prompt_token_ids), max_tokens, frozenset(eos),
                                    params.length_penalty, params.early_stopping)
        self.requests[request_id] = group
        self.scheduler.add(seq)
        return group

    def _new_seq(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float,
                 max_tokens: int, index: int, prompt_len: int | None = None) -> Sequence:
        prompt = token_ids[:prompt_len] if prompt_len is not None else token_ids
        seq = Sequence(next(self._seq_ids), request_id, prompt, params, arrival, max_tokens)
        seq.token_ids = list(token_ids)
        seq.index = index
        # sample i of a seeded request draws from its own stream: the same every time
        seed = None if params.seed is None else params.seed * 1_000_003 + index
        seq.generator = make_generator(seed, self.config.device)
        if not params.use_beam_search:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, params.stop)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.requests.get(request_id)
        if group is None:
            return None
        return self._end_group(group, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        deltas: dict[str, list[CompletionOutput]] = {}
        ended: list[RequestOutput] = []
        for seq in sched.failed:
            assert seq.group is not None
            seq.group.error = "the request can never fit the KV cache"
            ended.append(self._end_group(seq.group, "abort"))
        if sched.scheduled:
            tables = [self.manager.block_table(s.seq.seq_id) for s in sched.scheduled]
            logits = self.runner.execute(sched.scheduled, tables, sched.copies)
            self.scheduler.update(sched)
            self._sample([s.seq for s in sched.scheduled if s.sample], logits, deltas, ended)
        outputs = ended
        for rid, outs in deltas.items():
            group = self.requests.get(rid)
            if group is not None and group.finished:
                ended_out = self._close_group(group)
                ended_out.outputs = outs + ended_out.outputs if group.streams else ended_out.outputs
                outputs.append(ended_out)
            elif group is not None and group.streams:
                outputs.append(self._request_output(group, outs))
        return outputs

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor, deltas: dict[str, list[CompletionOutput]],
                ended: list[RequestOutput]) -> None:
        rows: list[int] = []
        targets: list[Sequence] = []
        beams: list[SequenceGroup] = []
        for i, seq in enumerate(sampling):
            group = seq.group
            assert group is not None
            if seq.max_tokens == 0:           # prefill only (a prefix being pinned)
                deltas.setdefault(seq.request_id, []).append(self._finish_seq(seq, "length"))
                continue
            if group.beam is not None:
                seq.pending_logprobs = torch.log_softmax(logits[i].float(), dim=-1)
                if group not in beams:
                    beams.append(group)
                continue
            family = [seq]
            if not group.forked and group.best_of > 1:
                family += self._fork_samples(group, seq)
            rows += [i] * len(family)
            targets += family
        if targets:
            gens = [t.generator for t in targets if t.generator is not None]
            assert len(gens) == len(targets), "every sampled sequence has its generator"
            out = self.sampler(logits[rows], [t.params for t in targets], gens)
            for j, seq in enumerate(targets):
                seq.token_ids.append(out.token_ids[j])
                seq.cumulative_logprob += out.logprobs[j]
                if seq.logprobs is not None and out.top_logprobs is not None:
                    seq.logprobs.append(out.top_logprobs[j])
                delta = self._after_token(seq, out.token_ids[j])
                deltas.setdefault(seq.request_id, []).append(delta)
        for group in beams:
            if all(s.pending_logprobs is not None for s in group.seqs):
                self._beam_step(group)
                deltas.setdefault(group.request_id, [])

    def _fork_samples(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: best_of - 1 children share every block of the freshly computed prompt."""
        group.forked = True
        children = []
        for index in range(1, group.best_of):
            child = self._new_seq(group.request_id, parent.token_ids, parent.params, parent.arrival,
                                  parent.max_tokens, index)
            child.num_computed, child.num_cached_tokens = parent.num_computed, parent.num_cached_tokens
            self.manager.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            child.group = group
            group.seqs.append(child)
            children.append(child)
        return children

    def _beam_step(self, group: SequenceGroup) -> None:
        live = group.seqs
        assert group.beam is not None
        logprobs = torch.stack([s.pending_logprobs for s in live])  # type: ignore[misc]
        for s in live:
            s.pending_logprobs = None
        choices = group.beam.step(logprobs, [s.cumulative_logprob for s in live], [s.output_token_ids for s in live])
        used: set[int] = set()
        new_live: list[Sequence] = []
        for c in choices:                                   # fork first: children copy the parent's tokens
            parent = live[c.parent]
            if c.parent in used:
                child = self._new_seq(group.request_id, parent.token_ids, parent.params, parent.arrival,
                                      parent.max_tokens, 0, prompt_len=parent.num_prompt_tokens)
                child.num_computed, child.num_cached_tokens = parent.num_computed, parent.num_cached_tokens
                self.manager.fork(parent.seq_id, child.seq_id)
                self.scheduler.add_running(child)
                child.group = group
                new_live.append(child)
            else:
                used.add(c.parent)
                new_live.append(parent)
        for seq, c in zip(new_live, choices):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.score
        for i, seq in enumerate(live):                      # dropped beams give their blocks back
            if i not in used:
                self._finish_seq(seq, "stop")
        group.seqs = new_live

    def _after_token(self, seq: Sequence, token: int) -> CompletionOutput:
        """Stop checks for a sampled token; returns the sequence's delta."""
        params, detok = seq.params, seq.detokenizer
        assert detok is not None
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return self._finish_seq(seq, "stop", [token], detok.flush())
        if not params.ignore_eos and token in self.loaded.eos_token_ids:
            return self._finish_seq(seq, "stop", [token], detok.flush())
        text, stop = detok.update([token])
        if stop is not None:
            seq.stop_reason = stop
            return self._finish_seq(seq, "stop", [token], text)
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish_seq(seq, "length", [token], text + detok.flush())
        return self._completion(seq, [token], text)

    def _finish_seq(self, seq: Sequence, reason: str, delta_ids: list[int] | None = None,
                    delta_text: str = "") -> CompletionOutput:
        if seq.pin_on_finish and reason == "length" and self.manager.has(seq.seq_id):
            try:
                self.manager.pin(seq.prompt_token_ids)
            except PinCapError as exc:
                seq.error = str(exc)
                if seq.group is not None:
                    seq.group.error = str(exc)
        if not seq.finished:
            self.scheduler.remove(seq)
        seq.finish_reason = seq.finish_reason or reason
        return self._completion(seq, delta_ids or [], delta_text)

    def _end_group(self, group: SequenceGroup, reason: str) -> RequestOutput:
        """Abort (or fail) a whole request: every unfinished sequence ends with `reason`."""
        outs = [self._finish_seq(s, reason) for s in group.seqs if not s.finished]
        if group.beam is not None:
            group.beam.done = True
        out = self._close_group(group)
        if group.streams:
            out.outputs = outs
        return out

    def _close_group(self, group: SequenceGroup) -> RequestOutput:
        """The final output of a finished request. Streaming groups: an empty delta (the caller adds the
        step's deltas). Others: the n best sequences, whole."""
        self.requests.pop(group.request_id, None)
        params = group.params
        if group.streams:
            return self._request_output(group, [])
        if group.beam is not None:
            for s in group.seqs:
                if not s.finished:
                    self._finish_seq(s, "length")
            hyps = group.beam.results(params.n)
            eos = group.beam.eos_token_ids
            outs = [CompletionOutput(i, self.tokenizer.decode(h.token_ids, skip_special_tokens=True), h.token_ids,
                                     "stop" if h.token_ids and h.token_ids[-1] in eos else "length",
                                     cumulative_logprob=h.logprob) for i, h in enumerate(hyps)]
            if not outs:  # aborted before the first step
                outs = [CompletionOutput(0, "", [], "abort")]
            return self._request_output(group, outs)
        best = sorted(group.seqs, key=lambda s: -s.cumulative_logprob)[:params.n]
        outs = [CompletionOutput(i, s.detokenizer.text if s.detokenizer else "", s.output_token_ids, s.finish_reason, s.stop_reason,
                                 s.cumulative_logprob, s.logprobs) for i, s in enumerate(best)]
        return self._request_output(group, outs)

    def _completion(self, seq: Sequence, delta_ids: list[int], delta_text: str) -> CompletionOutput:
        return CompletionOutput(
            index=seq.index, text=delta_text, token_ids=delta_ids, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[-len(delta_ids):] if seq.logprobs and delta_ids else None)

    def _request_output(self, group: SequenceGroup, outs: list[CompletionOutput]) -> RequestOutput:
        first = group.seqs[0] if group.seqs else None
        cached = max(first.num_cached_tokens, 0) if first is not None else 0
        prompt = first.prompt_token_ids if first is not None else []
        return RequestOutput(group.request_id, prompt, outs, group.finished, num_cached_tokens=cached,
                             error=group.error)

    # -- prefixes -----------------------------------------------------------------------------
    def check_pin(self, token_ids: list[int]) -> None:
        """Raises PinCapExceeded if pinning this prefix could not fit under the cap."""
        if not self.config.enable_prefix_caching:
            raise InvalidRequest("pinning a prefix needs prefix caching, which is disabled", param="prompt")
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
            group = self.add_request(rid, token_ids, SamplingParams(max_tokens=0, temperature=0.0), pin_on_finish=True)
            while not group.finished:
                self.step()
            if group.error:
                raise PinCapExceeded(group.error, param="prompt")
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
