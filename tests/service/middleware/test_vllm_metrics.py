"""/metrics as a vLLM dashboard reads it: vLLM's series names with the model_name label, counters that
grow by what a request did, latency histograms whose parts add up (queue + prefill = time to first
token, prefill + decode = inference, queue + inference = end to end), requests by finish reason, and
per-prefix series that go with their prefix."""
from __future__ import annotations

import uuid

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import ServerThread

# What vLLM's example Grafana dashboard (and its V1 metrics doc) query, by series name.
DASHBOARD = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_sum", "vllm:request_inference_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
]
TIMES = ["time_to_first_token", "e2e_request_latency", "request_queue_time", "request_inference_time",
         "request_prefill_time", "request_decode_time", "inter_token_latency", "request_time_per_output_token"]
PREFIX = "You are a helpful assistant. Answer briefly and cite the page, the block and the cache. " * 3


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def completion(server: ServerThread, **body: object) -> dict:
    resp = requests.post(f"{server.url}/v1/completions", timeout=60, json={"prompt": "the cache keeps", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_dashboard_series_and_what_one_request_adds(server: ServerThread, model_name: str) -> None:
    before = scrape(server.url)
    out = completion(server, max_tokens=5, ignore_eos=True, temperature=0)
    after = scrape(server.url)
    names = {name for name, _ in after}
    assert not [n for n in DASHBOARD if n not in names], [n for n in DASHBOARD if n not in names]
    for (name, labels) in after:
        if name.startswith("vllm:"):
            assert dict(labels)["model_name"] == model_name, (name, labels)

    def grew(name: str, **labels: str) -> float:
        labels = {"model_name": model_name, **labels}
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:prompt_tokens_total") == out["usage"]["prompt_tokens"]
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:request_prompt_tokens_sum") == out["usage"]["prompt_tokens"]
    assert grew("vllm:request_generation_tokens_sum") == 5
    for t in TIMES:
        expected = 4 if t == "inter_token_latency" else 1      # 5 tokens: 4 gaps
        assert grew(f"vllm:{t}_seconds_count") == expected, t
        assert grew(f"vllm:{t}_seconds_bucket", le="+Inf") == expected, t
    s = {t: grew(f"vllm:{t}_seconds_sum") for t in TIMES}
    assert all(v > 0 for k, v in s.items() if k != "request_queue_time") and s["request_queue_time"] >= 0
    assert s["time_to_first_token"] == pytest.approx(s["request_queue_time"] + s["request_prefill_time"], abs=1e-6)
    assert s["request_inference_time"] == pytest.approx(s["request_prefill_time"] + s["request_decode_time"],
                                                        abs=1e-6)
    assert s["e2e_request_latency"] == pytest.approx(s["request_queue_time"] + s["request_inference_time"],
                                                     abs=1e-6)
    assert s["inter_token_latency"] == pytest.approx(s["request_decode_time"], abs=1e-6)
    assert 4 * s["request_time_per_output_token"] == pytest.approx(s["request_decode_time"], abs=1e-6)
    kv = {n: value(after, f"prefixserve_kv_blocks_{n}") for n in ("used", "total")}
    assert value(after, "vllm:kv_cache_usage_perc", model_name=model_name) == kv["used"] / kv["total"]
    assert value(after, "vllm:num_requests_running", model_name=model_name) == 0


def test_every_sample_counts_and_finish_reasons(server: ServerThread, model_name: str) -> None:
    before = scrape(server.url)
    completion(server, max_tokens=4, ignore_eos=True, temperature=0.8, n=2, seed=3)
    first = completion(server, max_tokens=3, temperature=0, return_token_ids=True)["choices"][0]["token_ids"]
    stopped = completion(server, max_tokens=3, temperature=0, stop_token_ids=[first[0]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    after = scrape(server.url)

    def grew(name: str, **labels: str) -> float:
        labels = {"model_name": model_name, **labels}
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:generation_tokens_total") == 8 + len(first) + 1    # both samples of n=2
    assert grew("vllm:request_success_total", finished_reason="length") == 1 + (len(first) == 3)
    assert grew("vllm:request_success_total", finished_reason="stop") == 1 + (len(first) < 3)
    assert grew("vllm:inter_token_latency_seconds_count") == 3 + (len(first) - 1)   # per request, not per sample


def test_leases_have_no_series(server: ServerThread) -> None:
    """A `prompt_cache_key` lease (one per client session) is no named prefix: a series each would grow the
    scrape with what clients send."""
    key = f"session-{uuid.uuid4().hex}"
    completion(server, prompt=PREFIX + " one", max_tokens=1, prompt_cache_key=key)
    completion(server, prompt=PREFIX + " two", max_tokens=1, prompt_cache_key=key)
    assert [r for r in requests.get(f"{server.url}/v1/prefixes", timeout=10).json()["data"]
            if r["name"].startswith("pck-")]                   # the lease exists
    assert 'prefix="pck-' not in requests.get(f"{server.url}/metrics", timeout=10).text


def test_prefix_series_go_with_their_prefix(server: ServerThread) -> None:
    names = [f"m-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for name in names:
        resp = requests.post(f"{server.url}/v1/prefixes", json={"name": name, "prompt": PREFIX + name}, timeout=60)
        assert resp.status_code == 201, resp.text
    try:
        for name in names:
            completion(server, prompt=" a question", prefix=name, max_tokens=1)
        m = scrape(server.url)
        for name in names:
            assert value(m, "prefixserve_prefix_hit_requests_total", prefix=name) == 1
            assert value(m, "prefixserve_prefix_tokens_saved_total", prefix=name) > 0
        assert requests.delete(f"{server.url}/v1/prefixes/{names[0]}", timeout=30).status_code == 200
        text = requests.get(f"{server.url}/metrics", timeout=10).text
        assert names[0] not in text and f'prefix="{names[1]}"' in text
    finally:
        for name in names:
            requests.delete(f"{server.url}/v1/prefixes/{name}", timeout=30)
    assert not [line for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines()
                if line.startswith("prefixserve_prefix_")]


def test_route_labels_are_templates(server: ServerThread) -> None:
    junk = uuid.uuid4().hex
    assert requests.get(f"{server.url}/{junk}/x", timeout=10).status_code == 404
    assert requests.get(f"{server.url}/v1/prefixes/{junk}", timeout=10).status_code == 404
    m = scrape(server.url)
    assert value(m, "prefixserve_http_requests_total", route="unmatched", status="404") >= 1
    assert value(m, "prefixserve_http_requests_total", route="/v1/prefixes/{name}", status="404") >= 1
    assert not [k for k in m if junk in str(k)]
