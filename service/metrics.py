"""Prometheus metrics, one registry per app (no global state).

Gauges and counters for the KV cache and the scheduler are read from `engine.stats()` when scraped
(the engine already keeps the totals); latency histograms are observed by the service per request.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core import EngineStats
from engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

_GAUGES = {
    "kv_blocks_total": "KV cache blocks in all",
    "kv_blocks_used": "KV cache blocks referenced by running requests or pinned",
    "kv_blocks_pinned": "KV cache blocks pinned by registered prefixes",
    "kv_blocks_cached": "Free KV cache blocks that still hold a reusable prefix",
    "kv_blocks_free": "KV cache blocks that can be allocated",
    "requests_running": "Requests in the running batch",
    "requests_waiting": "Requests waiting for admission",
}
_COUNTERS = {
    "preemptions": ("preemptions_total", "Requests preempted (recomputed) for lack of KV blocks"),
    "prefix_cache_queried_tokens": ("prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache"),
}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:  # still warming: no engine yet
            return
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"prefixserve_{name}", doc, value=getattr(s, name))
        for name, (field, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"prefixserve_{name}", doc, value=getattr(s, field))


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.ttft = Histogram("prefixserve_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("prefixserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("prefixserve_e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("prefixserve_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.prefix_hits = Counter("prefixserve_prefix_hit_requests", "Requests naming a registered prefix that "
                                   "hit its cached blocks, by prefix", ["prefix"], registry=self.registry)
        self.prefix_saved = Counter("prefixserve_prefix_tokens_saved", "Prompt tokens served from a named "
                                    "prefix's cached blocks, by prefix", ["prefix"], registry=self.registry)

    def prefix_used(self, name: str, hit: int, tokens_saved: int) -> None:
        self.prefix_hits.labels(name).inc(hit)
        self.prefix_saved.labels(name).inc(tokens_saved)

    def first_token(self, out: RequestOutput) -> None:
        """A request's first output with tokens reached its consumer (aborted requests count too)."""
        if out.times is not None and out.times.first_token is not None:
            self.ttft.observe(out.times.first_token - out.times.arrival)

    def request_finished(self, out: RequestOutput, num_seqs: int) -> None:
        """One engine request ended (not aborted by its client): latencies from the engine's own
        timestamps. TPOT is per sequence: a request of best_of samples or beams made best_of tokens a step."""
        t = out.times
        if t is None or t.finished is None:
            return
        self.e2e.observe(t.finished - t.arrival)
        if t.first_token is None:
            return
        per_seq = out.num_generated_tokens // max(1, num_seqs)
        if per_seq > 1:
            self.tpot.observe((t.finished - t.first_token) / (per_seq - 1))

    def render(self) -> web.Response:
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
