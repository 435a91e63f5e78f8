"""Prometheus metrics, one registry per app (no global state), in vLLM's names wherever vLLM has the
concept, so an existing vLLM dashboard reads them. Every `vllm:` series has the label `model_name`
(the served model name).

| series (`prefixserve_*`: no vLLM equivalent)          | type      | what                                   |
|-------------------------------------------------------|-----------|----------------------------------------|
| vllm:num_requests_running                             | gauge     | requests in the running batch          |
| vllm:num_requests_waiting                             | gauge     | requests waiting for admission         |
| vllm:kv_cache_usage_perc                              | gauge     | used / total KV blocks, 0..1 (**)      |
| vllm:num_preemptions_total                            | counter   | preemptions (recompute)                |
| vllm:prefix_cache_queries_total                       | counter   | prompt tokens looked up in the cache   |
| vllm:prefix_cache_hits_total                          | counter   | of those, tokens found cached          |
| vllm:prompt_tokens_total                              | counter   | prompts of requests at first token     |
| vllm:generation_tokens_total                          | counter   | tokens sampled (all samples and beams) |
| vllm:request_success_total{finished_reason}           | counter   | finished: stop, length, abort          |
| vllm:time_to_first_token_seconds                      | histogram | arrival -> first token                 |
| vllm:inter_token_latency_seconds                      | histogram | gap between decode steps (*)           |
| vllm:request_time_per_output_token_seconds            | histogram | per request: decode / (tokens - 1)     |
| vllm:e2e_request_latency_seconds                      | histogram | arrival -> finished                    |
| vllm:request_queue_time_seconds                       | histogram | arrival -> first scheduled             |
| vllm:request_inference_time_seconds                   | histogram | first scheduled -> finished            |
| vllm:request_prefill_time_seconds                     | histogram | first scheduled -> first token         |
| vllm:request_decode_time_seconds                      | histogram | first token -> finished                |
| vllm:request_prompt_tokens                            | histogram | prompt length per finished request     |
| vllm:request_generation_tokens                        | histogram | tokens sampled per finished request    |
| prefixserve_kv_blocks_{total,used,pinned,cached,free} | gauge     | KV blocks by state                     |
| prefixserve_http_requests_total{route,status}         | counter   | answers by route template              |
| prefixserve_prefix_hit_requests_total{prefix}         | counter   | requests that hit the named prefix     |
| prefixserve_prefix_tokens_saved_total{prefix}         | counter   | prompt tokens those hits saved         |
| prefixserve_kv_events_{batches,dropped}_total         | counter   | KV events published / dropped (if on)  |
| prefixserve_grammar_cache_{entries,bytes}             | gauge     | compiled grammars kept, their size     |
| prefixserve_torch_threads                             | gauge     | compute threads now (fewer when busy)  |
| prefixserve_torch_thread_changes_total                | counter   | times that count changed               |
| prefixserve_<kv backend>_<name>                        | either    | the KV backend's own figures (*3)      |
| prefixserve_kernels_info{op,implementation,cpu_variant,batch_invariant} | info | the kernels each op runs (1) |
| prefixserve_kv_tier_<name>                             | either    | the KV tier's figures (*4)             |

(*3) Whatever `KVStore.stats` returns, exported as the backend declares it (gauge or counter, with its
help text): nothing here names a backend. The paged backend reports none; engine/kv/backends/ has the
others' lists.
(*4) Only with a KV tier (--kv-tier-dir / --kv-tier-shared-dir): KVTier.stats (engine/kv/tier/tier.py) lists
them: hit and miss blocks, loads and their seconds, bytes read and written, faults by kind, bytes on disk.
(**) Used: referenced by a request or pinned; free blocks that still cache a prefix count as free,
as in vLLM. (*) The engine timestamps a request's first and last token, not each one: every gap of a request
is counted as its mean decode gap. Sum and count are exact (total decode time, number of gaps); the
buckets lose the spread within one request. vLLM's deprecated `vllm:time_per_output_token_seconds`
(the same quantity) is not exported. Replaced names: prefixserve_requests_running / _waiting,
_preemptions_total, _prefix_cache_queried_tokens_total / _hit_tokens_total, _time_to_first_token_seconds,
_time_per_output_token_seconds, _e2e_request_latency_seconds are the vllm: series above.

Leases (`prompt_cache_key`, `cache_control`) get no per-prefix series: they are a client's session cache, as many
as there are sessions, and a label each would grow the scrape with what clients send; their hits count in
vllm:prefix_cache_hits. A prefix's label is its name when it is published; a tenant's own prefix is labelled
`private-<HMAC-SHA256(label key, "<tenant>/<name>")[:12]>`, the label key derived from the server's
configured keys (so every replica with the same keys, and a restart, label a prefix alike) and known to
no one who lacks them: a scrape cannot be used to check guessed names offline (prefix_store/access.py).

Engine gauges and counters are read from `engine.stats()` when scraped; request histograms are
observed from the engine's own timestamps (RequestTimes) when a request's output reaches its
handler. Per-prefix series are read from the registry's local view when scraped, so a prefix's
series go with it (deleted here, on another replica, or by a resync); their number is bounded by
the registry's.
"""
from __future__ import annotations

import bisect
import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from service.config import ServiceConfig
from service.state import ServiceState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))  # 1 .. 500k
MODEL = ["model_name"]

_BLOCK_GAUGES = {
    "kv_blocks_total": "KV cache blocks in all",
    "kv_blocks_used": "KV cache blocks referenced by running requests or pinned",
    "kv_blocks_pinned": "KV cache blocks pinned by registered prefixes",
    "kv_blocks_cached": "Free KV cache blocks that still hold a reusable prefix",
    "kv_blocks_free": "KV cache blocks that can be allocated",
}


class _GapHistogram:
    """A histogram fed `count` equal observations at once (O(log buckets)), for inter-token gaps."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)    # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self, name: str, doc: str, model: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=MODEL)
        cumulative, acc = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            acc += n
            cumulative.append((bound, float(acc)))
        fam.add_metric([model], cumulative, self.sum)
        return fam


class _StateCollector(Collector):
    """What is read at scrape time: the engine's gauges and counters, the per-prefix counters."""

    def __init__(self, state: ServiceState, gaps: _GapHistogram) -> None:
        self._state = state
        self._gaps = gaps
        self._label_key = label_key(state.config)

    def collect(self) -> Iterator[Metric]:
        state = self._state
        if state.engine is None:  # still warming
            return
        s = state.engine.stats()
        model = [state.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=MODEL)
            fam.add_metric(model, value)
            return fam

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=MODEL)
            fam.add_metric(model, value)
            return fam

        yield gauge("vllm:num_requests_running", "Requests in the running batch", s.requests_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission", s.requests_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield counter("vllm:num_preemptions", "Requests preempted (recomputed) for lack of KV blocks",
                      s.preemptions_total)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s.prefix_cache_queried_tokens_total)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                      s.prefix_cache_hit_tokens_total)
        yield self._gaps.family("vllm:inter_token_latency_seconds",
                                "Gap between a request's decode steps (each request's mean gap)", model[0])
        for name, doc in _BLOCK_GAUGES.items():
            yield GaugeMetricFamily(f"prefixserve_{name}", doc, value=getattr(s, name))
        yield GaugeMetricFamily("prefixserve_torch_threads", "Compute threads the engine runs now (fewer while other "
                                "processes want the same cores: --adaptive-threads)", value=s.torch_threads)
        yield CounterMetricFamily("prefixserve_torch_thread_changes", "Times the engine changed its compute threads",
                                  value=s.torch_thread_changes)
        yield GaugeMetricFamily("prefixserve_grammar_cache_entries", "Compiled grammars kept for reuse",
                                value=s.grammars_cached)
        yield GaugeMetricFamily("prefixserve_grammar_cache_bytes", "Bytes of the compiled grammars kept for reuse",
                                value=s.grammar_cache_bytes)
        kernels = InfoMetricFamily("prefixserve_kernels", "The implementation each op runs, chosen once at start "
                                   "(the C++ CPU build for this CPU's instruction set, or the fallback)", labels=["op"])
        k = state.engine.kernels
        for op, impl in k["ops"].items():
            kernels.add_metric([op], {"implementation": impl, "cpu_variant": k["cpu_variant"] or "none",
                                      "batch_invariant": str(k["batch_invariant"]).lower()})
        yield kernels
        for key, stat in s.kv_backend_stats.items():      # whatever the KV backend reports, by its name
            family = GaugeMetricFamily if stat.kind == "gauge" else CounterMetricFamily
            yield family(f"prefixserve_{s.kv_backend}_{key}", stat.doc, value=stat.value)
        for key, stat in s.kv_tier_stats.items():         # the KV tier's, when there is one
            family = GaugeMetricFamily if stat.kind == "gauge" else CounterMetricFamily
            yield family(f"prefixserve_kv_tier_{key}", stat.doc, value=stat.value)
        hits = CounterMetricFamily("prefixserve_prefix_hit_requests", "Requests naming a registered prefix "
                                   "that hit its cached blocks, by prefix", labels=["prefix"])
        saved = CounterMetricFamily("prefixserve_prefix_tokens_saved", "Prompt tokens served from a named "
                                    "prefix's cached blocks, by prefix", labels=["prefix"])
        for key, entry in (state.registry.local.items() if state.registry is not None else ()):
            if entry.record.kind != "named":    # leases are a client's cache, not a prefix someone named:
                continue                        # their hits count in vllm:prefix_cache_hits alone
            label = self._label(key, entry.record.owner)
            hits.add_metric([label], entry.hit_requests)
            saved.add_metric([label], entry.tokens_saved)
        yield hits
        yield saved
        if s.kv_events_published is not None:
            yield CounterMetricFamily("prefixserve_kv_events_batches", "KV event batches published (ZMQ PUB)",
                                      value=s.kv_events_published)
            yield CounterMetricFamily("prefixserve_kv_events_dropped", "KV event records dropped because the "
                                      "publisher fell behind (each drop is followed by AllBlocksCleared)",
                                      value=s.kv_events_dropped)


    def _label(self, key: str, owner: str | None) -> str:
        """A prefix's label (the module docstring): its name when published; a tenant's own as a keyed digest."""
        if owner is None:
            return key
        return "private-" + hmac.new(self._label_key, key.encode(), hashlib.sha256).hexdigest()[:12]


def label_key(config: ServiceConfig) -> bytes:
    """The key of private prefixes' labels: a digest of every configured key, or a random one without keys."""
    keys = sorted({*config.api_key, *config.admin_key, *(pair.partition(":")[2] for pair in config.tenant_keys)})
    if not keys:
        return secrets.token_bytes(32)
    return hashlib.sha256(b"prefixserve-metrics-labels\0" + b"\0".join(k.encode() for k in keys)).digest()


class Metrics:
    def __init__(self, state: ServiceState) -> None:
        self._state = state
        self.registry = CollectorRegistry()
        self._gaps = _GapHistogram(_TPOT_BUCKETS)
        self.registry.register(_StateCollector(state, self._gaps))
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, MODEL, buckets=buckets, registry=r)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that reached their "
                                     "first token", MODEL, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens sampled", MODEL, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               [*MODEL, "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Per request: mean time per "
                              "output token after the first", _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token",
                             _LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduled",
                               _LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Time from first scheduled to "
                                   "finished", _LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Time from first scheduled to the "
                                 "first token", _LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Time from the first token to finished",
                                _LATENCY_BUCKETS)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request",
                                    _TOKEN_BUCKETS)
        self.generation_len = histogram("vllm:request_generation_tokens", "Tokens sampled per finished "
                                        "request", _TOKEN_BUCKETS)
        self.requests = Counter("prefixserve_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)

    @property
    def _model(self) -> str:
        return self._state.model_name

    def first_token(self, out: RequestOutput) -> None:
        """A request's first output with tokens reached its consumer (aborted requests count too)."""
        self.prompt_tokens.labels(self._model).inc(out.num_prompt_tokens)
        if out.times is not None and out.times.first_token is not None:
            self.ttft.labels(self._model).observe(out.times.first_token - out.times.arrival)

    def progress(self, out: RequestOutput, counted: int) -> int:
        """Counts the tokens sampled since `counted` (the request's total at its previous output);
        returns the new total."""
        if out.num_generated_tokens > counted:
            self.generation_tokens.labels(self._model).inc(out.num_generated_tokens - counted)
        return max(counted, out.num_generated_tokens)

    def request_finished(self, out: RequestOutput, num_seqs: int) -> None:
        """One engine request ended (not aborted by its client): latencies from the engine's own
        timestamps. Per-token figures are per sequence: a request of best_of samples or beams made
        best_of tokens a step."""
        m = self._model
        reason = next((o.finish_reason for o in out.outputs if o.finish_reason is not None), "abort")
        self.success.labels(m, reason).inc()
        self.prompt_len.labels(m).observe(out.num_prompt_tokens)
        self.generation_len.labels(m).observe(out.num_generated_tokens)
        t = out.times
        if t is None or t.finished is None:
            return
        self.e2e.labels(m).observe(t.finished - t.arrival)
        if t.scheduled is not None:
            self.queue.labels(m).observe(t.scheduled - t.arrival)
            self.inference.labels(m).observe(t.finished - t.scheduled)
            if t.first_token is not None:
                self.prefill.labels(m).observe(t.first_token - t.scheduled)
        if t.first_token is None:
            return
        self.decode.labels(m).observe(t.finished - t.first_token)
        per_seq = out.num_generated_tokens // max(1, num_seqs)
        if per_seq > 1:
            gap = (t.finished - t.first_token) / (per_seq - 1)
            self.tpot.labels(m).observe(gap)
            self._gaps.observe(gap, per_seq - 1)

    def request_aborted(self, prompt_tokens: int, generated: int) -> None:
        """One engine request stopped by its client before it finished (a disconnect, a cancel, a stop):
        counted as finished_reason "abort", its lengths as far as it got."""
        m = self._model
        self.success.labels(m, "abort").inc()
        self.prompt_len.labels(m).observe(prompt_tokens)
        self.generation_len.labels(m).observe(generated)

    def render(self) -> web.Response:
        # Every per-model series is exported from the start, at zero, as vLLM does: a scraper (or a
        # router comparing replicas) sees a replica that has served nothing as 0, not as missing.
        m = self._model
        per_model = (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e, self.queue,
                     self.inference, self.prefill, self.decode, self.prompt_len, self.generation_len)
        for series in per_model if m else ():
            series.labels(m)
        for reason in ("stop", "length", "abort") if m else ():
            self.success.labels(m, reason)
        resp = web.Response(body=generate_latest(self.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp


METRICS = web.AppKey("metrics", Metrics)


@web.middleware
async def metrics_middleware(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Counts answers by route template (never the raw path: bounded label values)."""
    resp: web.StreamResponse = await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[METRICS].requests.labels(route, str(resp.status)).inc()
    return resp
