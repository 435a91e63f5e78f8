"""EngineCore: tokens in, tokens out.

Owns the model runner, the KV cache, the block pool and manager, the scheduler, the sampler and the
forks. `step()` schedules one batch, runs the model, samples one token per sampling sequence and applies
the token-level stop rules (stop token ids, EOS, max_tokens, max_model_len). Text (detokenization, stop
strings, the choice of the n best) is the output processor's (output/processor.py); pins are the pin
state machine's (pinning.py); both call back into `finish_seq` and `abort`. The checks a request passes
before it waits (on fixed inputs, on the cache as it is) are the admission's (admission.py). Around sampling:
prompt log-probabilities are sample/prompt_logprobs.py's, structured output's masks sample/constrained_rows.py's,
the row-by-row retry of a failed batch the sampler's; growing blocks ahead of need is the scheduler's.

NOTE: not thread-safe. One thread owns a core: the engine thread of AsyncEngine, or the caller of the
offline API. The one exception is `make_request`, which reads only what never changes after
construction (config, model shape, cache size), so the event loop may call it.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.admission import Admission
from engine.config import EngineConfig
from engine.errors import CapacityExceeded, EngineError, InvalidRequest, KVRefused
from engine.kv import backends as kv_backends
from engine.kv.backends.base import CacheSpec, KVStore, blocks_for_budget
from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool, root_hash
from engine.kv.event_publisher import ZmqEventPublisher
from engine.kv.events import KVEventQueue, KVEventsConfig
from engine.kv.tier import create_tier
from engine.models.chat_template import override_chat_template, read_chat_template
from engine.models.default import NAME as DEFAULT_NAME
from engine.models.default import TOOLS_TEMPLATE, default_model_path, is_builtin
from engine.models.loader import LoadedModel, load_model
from engine.outputs import EngineStats, RequestTimes
from engine.sample import constrained_rows, logits_processors, prompt_logprobs
from engine.sample.logits_processors import RowContext
from engine.sample.sampler import Sampler, make_generator
from engine.sample.structured import Grammars
from engine.sched.forks import Forks
from engine.sched.scheduler import Scheduler
from engine.sequence import EngineRequest, SamplingParams, Sequence, SequenceGroup
from engine.worker.model_runner import ModelRunner
from engine.worker.threads import ThreadGovernor
from kernels.ops import KernelConfig, Ops

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CoreOutput:
    """What one step did. `sampled`: sequences that got one new token (the last of their token_ids), in
    batch order; beams are not listed (their tokens count only when the search ends). `groups`: every
    request the step touched (sampled, beam-stepped, finished or failed), each once, in first-touch order."""

    sampled: list[Sequence] = field(default_factory=list)
    groups: list[SequenceGroup] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set, repr=False)      # id() of the groups listed: touch in O(1)

    def touch(self, group: SequenceGroup) -> None:
        if id(group) not in self._seen:           # NOTE: the groups are alive while listed, so ids are not reused
            self._seen.add(id(group))
            self.groups.append(group)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)   # NOTE: process-wide; the engine owns the process's compute
        self.threads = ThreadGovernor.make(config.torch_threads if config.adaptive_threads else None,
                                           config.batch_invariant, torch.set_num_threads)
        # The op layer: which kernels run is decided here, once (and logged: KernelReport)
        self.ops = Ops(KernelConfig(config.device, config.cpu_kernels, config.batch_invariant,
                                    traced=config.compile_decode, amx_dense_from_rows=config.amx_dense_from_rows,
                                    int16_activations=config.int16_activations))
        for line in self.ops.report.lines():
            log.info("kernels: %s", line)
        if loaded is None:
            model = config.model
            if model is None:
                model = str(default_model_path())
            loaded = load_model(model, device=config.device, dtype=config.dtype, quantization=config.quantization,
                                ops=self.ops)
            if config.model is None:
                loaded.name = DEFAULT_NAME
        else:
            loaded.model.set_ops(self.ops)
        if config.chat_template is not None:
            override_chat_template(loaded, read_chat_template(config.chat_template))
        elif is_builtin(config.model):  # the built-in model: its template with tools (engine/models/default.py)
            override_chat_template(loaded, TOOLS_TEMPLATE.read_text())
        self.loaded = loaded
        args = loaded.args
        limit = args.max_position_embeddings
        if args.sliding_window is not None:
            limit = min(limit, args.sliding_window)  # no sliding-window attention: stay inside one window
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.vocab_size = args.vocab_size
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.kv_cache_dtype = config.kv_cache_dtype or self.ops.default_kv_cache_dtype(
            config.dtype, quantized=loaded.quantization != "none")
        dtype = _DTYPES[self.kv_cache_dtype]
        self.attention_backend = config.attention_backend or self.ops.attention_family(dtype)
        backend = kv_backends.get(config.kv_backend)
        self.block_size = backend.block_size(args, dtype, config.block_size)
        if self.block_size != config.block_size:
            log.info("kv_backend=%s: block size %d -> %d tokens (the backend's rule)", backend.name,
                     config.block_size, self.block_size)
        num_blocks = config.num_kv_blocks or blocks_for_budget(args, self.block_size, dtype,
                                                               config.kv_cache_memory_gb * 2**30)
        # the admission checks; frozen, so make_request may run them off the engine thread
        self.admission = Admission(config.max_num_seqs, config.max_num_waiting, self.vocab_size, self.max_model_len,
                                   self.block_size, num_blocks)
        events = KVEventsConfig.from_json(config.kv_events_config) if config.kv_events_config else None
        sink = KVEventQueue(events.max_queue_size) if events is not None and events.enabled else None
        max_pinned = int(num_blocks * config.pinned_fraction)
        self.pool = BlockPool(num_blocks, max_pinned_blocks=max_pinned, events=sink,
                              max_pinned_per_owner=int(max_pinned * config.pinned_tenant_fraction))
        attention = backend.attention(self.attention_backend, self.ops)
        self.kv_cache: KVStore = backend.create(CacheSpec(args, num_blocks, self.block_size, dtype, config.device,
                                                          self.max_model_len, config.max_num_seqs, attention,
                                                          config.map_ahead_tokens, config.kv_max_mappings))
        self.manager = BlockManager(self.pool, self.block_size, loaded.fingerprint, config.enable_prefix_caching,
                                    self.kv_cache.placement)
        self.tier = create_tier(config, self.kv_cache, (2, args.num_layers, self.block_size, args.num_kv_heads,
                                                        args.head_dim), dtype, root_hash(loaded.fingerprint),
                                self._tier_namespace(), max_load_blocks=max(1, num_blocks // 2))
        self.pool.spill = self.tier
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens, self.tier,
                                   config.decode_prefill_cost, args.context_weight)
        self.runner = ModelRunner(loaded.model, self.kv_cache, attention, config.device, self.manager)
        if config.compile_decode:
            took = self.runner.compile_decode(config.max_num_seqs)
            if self.runner.compiled is not None and self.runner.compiled.failed is None:
                log.info("decode step compiled for batch buckets %s in %.1f s", self.runner.compiled.buckets, took)
        if self.threads is not None:
            # between layers too: a prefill step beside a new neighbour may last seconds (the compiled decode
            # graph does not call it: there the step's start decides)
            self.ops.between_layers = self.threads.tick
        self.sampler = Sampler(self.ops)
        self.forks = Forks(self.manager, self.scheduler, self.new_seq, self.finish_seq)
        self.requests: dict[str, SequenceGroup] = {}
        self.kv_events: ZmqEventPublisher | None = None    # started last: nothing to undo if loading fails
        if sink is not None and events is not None:
            self.kv_events = ZmqEventPublisher(events, sink, self.block_size, curve=config.kv_events_curve()).start()
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    def _tier_namespace(self) -> str:
        """What makes this engine's KV bytes reusable by another process: blocks are shared through the KV tier
        only between engines that agree on all of it (the tokens are in the block hashes)."""
        c, args = self.config, self.loaded.args
        return (f"prefixserve-kv v1 fingerprint={self.loaded.fingerprint} kv_dtype={self.kv_cache_dtype} "
                f"dtype={c.dtype} weights={self.loaded.quantization} attention={self.attention_backend} "
                f"kv_backend={c.kv_backend} device={torch.device(c.device).type} compile_decode={c.compile_decode} "
                f"block={self.block_size}x{args.num_layers}x{args.num_kv_heads}x{args.head_dim}")

    @property
    def grammars(self) -> Grammars:
        """Compiled grammars for structured output (made on first use: 1-2 s). Thread-safe: the async engine
        compiles a request's grammar on a grammar thread and hands it over with the request (`grammar`), so
        the engine thread never compiles one; the offline engine compiles in `add`."""
        with self._grammars_lock:
            if self._grammars is None:
                c = self.config
                self._grammars = Grammars(self.loaded.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                          c.grammar_compile_timeout, c.grammar_cache_size,
                                          int(c.grammar_cache_mb * 2**20))
            return self._grammars

    # -- requests -----------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     tenant: str = "") -> EngineRequest:
        """Checks on fixed inputs only (engine/admission.py): safe on any thread. Raises InvalidRequest."""
        return self.admission.make_request(request_id, prompt_token_ids, params, tenant)

    def add(self, request: EngineRequest) -> SequenceGroup:
        """Admits a checked request to the waiting queue. Cache-dependent checks happen here, on the
        owning thread: raises InvalidRequest (cannot fit beside the pinned blocks) or QueueFull."""
        rid, prompt = request.request_id, request.prompt_token_ids
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use", param="id")
        hashes = self.manager.block_hashes(prompt, salt=request.params.cache_salt) \
            if self.config.enable_prefix_caching else []
        self.admission.check_room(request, hashes, self.pool, self.manager,
                                  self.scheduler.waiting.count(request.tenant))
        grammar = request.grammar
        if request.params.structured is not None and grammar is None:
            grammar = self.grammars.compile(request.params.structured)    # InvalidRequest if it does not compile
        seq = self.new_seq(rid, prompt, request.params, request.max_tokens, 0)
        seq.block_hashes = hashes
        seq.tenant = request.tenant
        group = SequenceGroup(request, seq, RequestTimes(arrival=request.arrival))
        group.grammar = grammar
        if request.params.use_beam_search and request.max_tokens > 0:     # nothing to search with max_tokens 0
            self.forks.start_beam_search(group, self.eos_token_ids)
        self.requests[rid] = group
        self.scheduler.add(seq)
        return group

    def new_seq(self, request_id: str, token_ids: list[int], params: SamplingParams, max_tokens: int, index: int,
                prompt_len: int | None = None, arrival: float | None = None) -> Sequence:
        prompt = token_ids[:prompt_len] if prompt_len is not None else token_ids
        seq = Sequence(next(self._seq_ids), request_id, prompt, params,
                       next(self._arrivals) if arrival is None else arrival, max_tokens)
        seq.token_ids = list(token_ids)
        seq.index = index
        # sample i of a seeded request draws from its own stream: the same every time
        seed = None if params.seed is None else params.seed * 1_000_003 + index
        seq.generator = make_generator(seed, self.config.device)
        return seq

    def finish_seq(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends one sequence (its blocks are freed); the request leaves `requests` once all have ended.
        A sequence that already ended keeps its reason."""
        if not seq.finished:
            self.scheduler.remove(seq)
            seq.finish_reason = reason
            if stop_reason is not None:
                seq.stop_reason = stop_reason
        group = seq.group
        if group is not None and group.finished:
            self._retire(group)

    def abort(self, request_id: str, error: EngineError | None = None) -> SequenceGroup | None:
        """Ends a whole request (every unfinished sequence with "abort"); None if it is not running."""
        group = self.requests.get(request_id)
        if group is None:
            return None
        group.ended = True
        group.error = error or group.error
        if group.beam is not None:
            group.beam.done = True
        for seq in group.seqs:
            self.finish_seq(seq, "abort")
        self._retire(group)
        return group

    def _retire(self, group: SequenceGroup) -> None:
        if self.requests.pop(group.request_id, None) is not None:
            group.times.finished = time.monotonic()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> CoreOutput:
        out = CoreOutput()
        sched = self.scheduler.schedule()
        for seq in sched.failed:
            assert seq.group is not None
            self.abort(seq.request_id, CapacityExceeded(
                "the request no longer fits the KV cache beside the pinned prefixes; retry later"))
            out.touch(seq.group)
        if not sched.scheduled:
            if self.tier is not None:
                self.tier.capture()         # what the scheduling evicted goes to the writer (a load may wait for it)
                if self.tier.pending:
                    self.tier.wait(0.05)    # requests wait for blocks from the tier: nothing to compute till then
            return out
        if self.threads is not None:
            self.threads.tick()             # fewer threads while other processes want these cores
        for s in sched.scheduled:
            if s.seq.group is not None and s.seq.group.times.scheduled is None:
                s.seq.group.times.scheduled = time.monotonic()
        if self.kv_cache.ahead_tokens:
            self.scheduler.grow_ahead(sched.scheduled, self.kv_cache.ahead_tokens, self.max_model_len)
        extra_rows, prompt_targets = prompt_logprobs.rows(sched.scheduled)
        if self.tier is not None:
            self.tier.capture()             # blocks evicted for this step: copied out before it overwrites them
        try:
            step_logits = self.runner.execute(sched.scheduled, sched.copies, extra_rows)
        except KVRefused as exc:        # the KV cache cannot hold these: their requests end, the rest run next step
            for s in sched.scheduled:
                if s.seq.seq_id in exc.seq_ids and s.seq.group is not None and self.abort(s.seq.request_id, exc):
                    out.touch(s.seq.group)
            self.scheduler.undo_joins(sched)    # nothing was written: blocks shared in-step are not there
            return out
        logits = step_logits.sample
        if step_logits.extra is not None:
            prompt_logprobs.record(step_logits.extra, prompt_targets)
        self.scheduler.update(sched)
        rows: list[int] = []
        targets: list[Sequence] = []
        for i, s in enumerate(sched.scheduled):
            if not s.sample:
                continue
            seq, group = s.seq, s.seq.group
            assert group is not None
            out.touch(group)
            if seq.max_tokens == 0:      # prefill only (a prefix being pinned, a prompt scored or cached)
                if group.best_of > 1 and not group.forked:
                    self.forks.end_unsampled(group, seq)
                self.finish_seq(seq, "length")
            elif group.beam is not None:
                seq.pending_logprobs = torch.log_softmax(logits[i].float(), dim=-1)
            else:
                family = [seq] + (self.forks.fork_samples(group, seq) if not group.forked and group.best_of > 1 else [])
                rows += [i] * len(family)
                targets += family
        if targets:
            # every row once, in order (a plain decode step): the step's logits as they are, no [N, V] copy. They
            # are inference-mode tensors, which a grammar's mask writes in place: inference mode allows that.
            identity = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
            with torch.inference_mode():
                self._sample(logits if identity else logits[rows], targets)
            out.sampled = targets
        for group in out.groups:
            if group.beam is not None and not group.finished and group.seqs and \
                    all(s.pending_logprobs is not None for s in group.seqs):
                self._count_token(group, len(group.seqs))
                self.forks.beam_step(group)
        return out

    def _sample(self, logits: torch.Tensor, targets: list[Sequence]) -> None:
        """One token for each target row; then the token-level stop rules. A row that cannot be sampled
        (non-finite logits, or a sampling failure of its own) ends its request only."""
        gens = [t.generator for t in targets if t.generator is not None]
        assert len(gens) == len(targets), "every sampled sequence has its generator"
        params = [t.params for t in targets]
        contexts = None
        if any(logits_processors.needs_processing(p) for p in params):
            contexts = [RowContext(t.output_token_ids, t.prompt_token_ids, self._stop_ids(t.params)) for t in targets]
        constrained = [j for j, t in enumerate(targets) if t.params.structured is not None]
        if constrained:
            constrained_rows.mask(self.grammars, logits, [targets[j] for j in constrained], constrained)
            for seq, error in constrained_rows.limits(logits, targets, contexts, constrained):
                self.abort(seq.request_id, error)
        try:
            res = self.sampler(logits, params, gens, contexts)
        except Exception:               # find the rows at fault: sample one at a time, fail only those
            log.exception("batched sampling failed; sampling row by row")
            res = self.sampler.row_by_row(logits, params, gens, contexts)
        failed = set(res.failed)
        for j, seq in enumerate(targets):
            if seq.finished:                # its request was just failed through a sibling's row
                continue
            if j in failed:
                assert seq.group is not None
                self.abort(seq.request_id, EngineError("the model produced non-finite logits for this request"))
                continue
            token = res.token_ids[j]
            if seq.guide is not None and not seq.guide.accept_token(token):
                self.abort(seq.request_id, EngineError("structured output: the grammar rejected a sampled token"))
                continue
            seq.token_ids.append(token)
            seq.cumulative_logprob += res.logprobs[j]
            if seq.logprobs is not None and res.top_logprobs is not None:
                seq.logprobs.append(res.top_logprobs[j])
            assert seq.group is not None
            self._count_token(seq.group, 1)
            self._check_stop(seq, token)
            if seq.guide is not None and not seq.finished and seq.guide.is_terminated():
                self.finish_seq(seq, "stop")             # the grammar is complete

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    def _count_token(self, group: SequenceGroup, n: int) -> None:
        if group.times.first_token is None:
            group.times.first_token = time.monotonic()
        group.num_generated_tokens += n

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids:
            self.finish_seq(seq, "stop", token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self.finish_seq(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish_seq(seq, "length")

    def reset_prefix_cache(self) -> int:
        """Forgets every evictable cached block (pinned prefixes and running requests keep theirs)."""
        return self.pool.reset_prefix_cache()

    def close(self) -> None:
        """Stops what the core started besides itself (the KV-events publisher, the cache's threads)."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.tier is not None:
            self.tier.close()
        self.kv_cache.close()
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()

    def stats(self) -> EngineStats:
        p = self.pool.stats()
        s = self.scheduler
        events = self.kv_events
        grammars = self._grammars           # None until the first structured request
        return EngineStats(p.total, p.used, p.pinned, p.cached, p.free, len(s.running), len(s.waiting),
                           s.num_preemptions, s.prefix_queried_tokens, s.prefix_hit_tokens, self.config.kv_backend,
                           self.kv_cache.stats(self.manager.num_blocks),
                           events.published_batches if events is not None else None,
                           events.queue.dropped if events is not None else None,
                           len(grammars.cache) if grammars is not None else 0,
                           grammars.cache.num_bytes if grammars is not None else 0,
                           self.tier.stats() if self.tier is not None else {}, torch.get_num_threads(),
                           self.threads.changes if self.threads is not None else 0)
