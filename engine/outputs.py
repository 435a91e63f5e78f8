"""What the engine hands back: CompletionOutput (one generated sequence) and RequestOutput (one request),
and `RequestOutput.merge`, the one place where streamed deltas are accumulated; EngineStats, what an engine
reports of itself (the KV cache's blocks, the queues, prefix hits, the KV backend's and tier's figures, the
grammar cache, the compute threads) for /metrics and LLM.stats().

A streaming request yields deltas: each CompletionOutput holds the text and tokens generated since the
previous output of the same request. Merging deltas in order gives what a non-streaming request returns
at once. The async engine merges when a consumer lags behind; the offline API merges to build its
results; nobody else accumulates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.kv.backends.base import KVStat  # it imports torch: engine.config must import without it


@dataclass
class CompletionOutput:
    """One generated sequence. In streams, `text`, `token_ids` and `logprobs` are the delta since the
    last output; `finish_reason`, `stop_reason` and `cumulative_logprob` are the latest values."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None    # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None

    def copy(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                self.cumulative_logprob, list(self.logprobs) if self.logprobs is not None else None)


@dataclass
class RequestTimes:
    """Engine-side timestamps (time.monotonic) of one request, for latency metrics that do not depend on
    how promptly a consumer reads."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None
    scheduled: float | None = None      # first put in a step's batch (queue time ends here)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    num_written_tokens: int = 0         # prompt tokens it wrote into the prefix cache (blocks it cached first)
    error: EngineError | None = None    # set when the engine had to end the request itself
    times: RequestTimes | None = None
    num_generated_tokens: int = 0       # every token sampled for the request (all samples and beams)
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token, once all are computed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def merge(self, delta: RequestOutput) -> RequestOutput:
        """Appends a later delta of the same request to this one, in place; returns self."""
        assert delta.request_id == self.request_id, (delta.request_id, self.request_id)
        by_index = {o.index: o for o in self.outputs}
        for o in delta.outputs:
            cur = by_index.get(o.index)
            if cur is None:
                self.outputs.append(o.copy())
                continue
            cur.text += o.text
            cur.token_ids.extend(o.token_ids)
            if o.logprobs:
                cur.logprobs = (cur.logprobs or []) + o.logprobs
            cur.finish_reason, cur.stop_reason = o.finish_reason, o.stop_reason
            cur.cumulative_logprob = o.cumulative_logprob
        self.outputs.sort(key=lambda o: o.index)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_written_tokens = delta.num_written_tokens
        self.error = delta.error or self.error
        self.times = delta.times or self.times
        self.num_generated_tokens = delta.num_generated_tokens
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        return self

    def copy(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_token_ids, [o.copy() for o in self.outputs], self.finished,
                             self.num_cached_tokens, self.num_written_tokens, self.error, self.times,
                             self.num_generated_tokens, self.prompt_logprobs)


@dataclass(frozen=True)
class PinnedPrefix:
    """A prefix whose full blocks are pinned in the KV cache (the result of a pin)."""

    num_tokens: int
    num_pinned_blocks: int
    block_hashes: list[str] = field(default_factory=list)    # hex, chained, one per full block


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
    kv_backend: str = ""                          # the KV backend's name, and its own figures (KVStore.stats)
    kv_backend_stats: dict[str, KVStat] = field(default_factory=dict)
    kv_events_published: int | None = None       # KV event batches published, records dropped (None: events off)
    kv_events_dropped: int | None = None
    grammars_cached: int = 0                      # compiled grammars kept for reuse, and their bytes
    grammar_cache_bytes: int = 0
    kv_tier_stats: dict[str, KVStat] = field(default_factory=dict)   # the KV tier's figures ({}: no tier)
    torch_threads: int = 0                        # the compute threads now, and how often the governor moved them
    torch_thread_changes: int = 0
