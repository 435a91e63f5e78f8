"""50 concurrent streams, half cut mid-stream: nothing leaks, and /metrics says so; a stopped stream is
counted as an abort and reports what it used (the access log's cached and generated tokens)."""
from __future__ import annotations

import asyncio
import logging
import random

import aiohttp
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import ServerThread

NAMES = ["prefixserve_kv_blocks_total", "prefixserve_kv_blocks_used", "prefixserve_kv_blocks_pinned",
         "prefixserve_kv_blocks_cached", "vllm:num_requests_running", "vllm:num_requests_waiting",
         "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
         "vllm:prefix_cache_hits_total"]


def finished(url: str) -> dict[str, float]:
    """vllm:request_success_total by finished_reason."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "vllm:request_success_total"}


def scrape(url: str) -> dict[str, float]:
    resp = requests.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    return {s.name: s.value for fam in text_string_to_metric_families(resp.text) for s in fam.samples
            if set(s.labels) - {"model_name"} <= {"le"} and s.labels.get("le", "+Inf") == "+Inf"}


async def _stream(s: aiohttp.ClientSession, url: str, i: int, cut: bool) -> tuple[bool, bytes]:
    body = {"prompt": f"request {i} " + "block " * (i % 7 * 5), "max_tokens": 60, "ignore_eos": True,
            "stream": True, "temperature": 0.8, "seed": i}
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        seen = b""
        async for chunk in resp.content.iter_any():
            seen += chunk
            if cut and seen.count(b"data: ") >= 3:
                return True, seen  # leaving the context closes the connection mid-stream
        return False, seen


async def test_fifty_streams_half_cut(server: ServerThread) -> None:
    before, reasons = scrape(server.url), finished(server.url)
    cuts = [i % 2 == 0 for i in range(50)]
    random.Random(0).shuffle(cuts)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as s:
        results = await asyncio.gather(*(_stream(s, server.url, i, cut) for i, cut in enumerate(cuts)))
    assert sum(cut for cut, _ in results) == 25
    for cut, raw in results:
        if not cut:
            assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b'"finish_reason":"length"') == 1
    m = scrape(server.url)
    for _ in range(100):  # the aborts land at the next engine step
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            break
        await asyncio.sleep(0.05)
        m = scrape(server.url)
    assert all(name in m for name in NAMES), set(NAMES) - set(m)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["prefixserve_kv_blocks_used"] == m["prefixserve_kv_blocks_pinned"]
    assert m["prefixserve_kv_blocks_total"] == 512
    assert m["prefixserve_kv_blocks_free"] + m["prefixserve_kv_blocks_used"] == 512
    # latency histograms: 50 first tokens, only the 25 completed requests count end to end
    def grew(name: str) -> float:
        return m[name] - before.get(name, 0.0)   # a labelled series appears with its first sample
    assert grew("vllm:time_to_first_token_seconds_count") == 50
    assert grew("vllm:e2e_request_latency_seconds_count") == 25
    assert grew("vllm:request_time_per_output_token_seconds_count") == 25
    assert m["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    after = finished(server.url)                 # the cut ones are aborts, the others ran to their length
    assert after["abort"] - reasons.get("abort", 0) == 25 and after["length"] - reasons.get("length", 0) == 25


async def test_a_stopped_stream_reports_what_it_used(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    prompt = "a prompt long enough to fill a few cache blocks " * 3
    requests.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    before = finished(server.url).get("abort", 0)
    with caplog.at_level(logging.INFO, logger="service.access"):
        async with aiohttp.ClientSession() as s:
            body = {"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "stream": True}
            async with s.post(f"{server.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                seen = b""
                async for chunk in resp.content.iter_any():
                    seen += chunk
                    if seen.count(b"data: ") >= 3:
                        break                  # the client stops reading and closes the connection
        for _ in range(100):
            lines = [r for r in caplog.records if r.name == "service.access" and "/v1/completions" in r.getMessage()]
            if lines and finished(server.url).get("abort", 0) > before:
                break
            await asyncio.sleep(0.05)
    fields = lines[-1].fields                  # type: ignore[attr-defined]
    assert fields["cached_tokens"] >= 16 and 1 <= fields["completion_tokens"] < 100, fields
    assert finished(server.url)["abort"] == before + 1
