"""The real vllm-router (compose's router entrypoint) in front of three replica processes and a real
Redis, on loopback: streams pass through byte for byte, a client that goes away aborts the replica's
request, a registered prefix hits on every replica under every policy, kv_aware follows our KV events,
and a replica killed mid-run loses no request that had not started streaming.

What the router does when a replica dies (vllm-router 0.1.17 as compose runs it):
- a request whose replica refuses the connection or drops it before the response is complete and
  before any byte was streamed (every non-streaming request, and a streaming one not yet answered)
  is retried on another replica; the client sees an ordinary 200;
- a stream that had started is cut: the client's chunked response ends without `data: [DONE]`;
- the replica fails its /health checks (every 5 s, 2 failures) and gets no new requests; a circuit
  breaker stops retries to it meanwhile; once it answers /health again it gets traffic again.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.client import HTTPConnection, IncompleteRead
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.helpers.compose_cluster import Cluster
from tests.helpers.router_process import RouterProcess
from tests.helpers.server import ServerProcess, http

SYSTEM = "You are the support bot of a paged-attention serving system; answer in one short line. " * 3


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    c = Cluster(tiny_llama_dir, n=3).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def router(cluster: Cluster) -> Iterator[RouterProcess]:
    with cluster.router() as r:          # compose's default: cache_aware
        yield r


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def completion(url: str, prompt: str, **kw: Any) -> dict[str, Any]:
    status, out = http("POST", f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 1, **kw})
    assert status == 200, out
    return out


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def raw_stream(url: str, body: dict[str, Any]) -> tuple[str, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.getheader("Content-Type") or "", data


def test_sse_bytes_pass_through_the_router_intact(router: RouterProcess, cluster: Cluster) -> None:
    body = {"prompt": "Stream me through the router", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    ctype, via_router = raw_stream(router.url, body)
    _, direct = raw_stream(cluster.replicas[0].url, body)
    assert ctype.startswith("text/event-stream") and via_router.endswith(b"data: [DONE]\n\n")
    mask = re.compile(rb'"(id|created)":("[^"]*"|\d+)')      # per-request values; greedy text is the same
    assert mask.sub(b"", via_router) == mask.sub(b"", direct)
    assert via_router.count(b"data: ") == direct.count(b"data: ") >= 13
    with OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="prefixserve", prompt=body["prompt"], max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
    assert text == client_text(cluster.replicas[1], body["prompt"])


def client_text(replica: ServerProcess, prompt: str) -> str:
    out = completion(replica.url, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    return str(out["choices"][0]["text"])


def test_a_client_leaving_the_router_aborts_the_replica_request(router: RouterProcess, cluster: Cluster) -> None:
    finished = [r.metric("vllm:e2e_request_latency_seconds_count") for r in cluster.replicas]
    host, port = router.url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "abort me", "max_tokens": 400, "ignore_eos": True,
                                                        "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    running = [r.metric("vllm:num_requests_running") for r in cluster.replicas]
    assert sorted(running) == [0, 0, 1], running
    serving = cluster.replicas[running.index(1)]
    conn.close()                                                   # the client goes away
    wait_for(lambda: serving.metric("vllm:num_requests_running") == 0, 10, "the replica to abort")
    assert [r.metric("vllm:e2e_request_latency_seconds_count") for r in cluster.replicas] == finished
    assert serving.metric("prefixserve_kv_blocks_used") == serving.metric("prefixserve_kv_blocks_pinned")


def test_a_registered_prefix_hits_on_every_replica_whatever_the_policy(router: RouterProcess,
                                                                      cluster: Cluster) -> None:
    status, rec = http("POST", f"{router.url}/v1/prefixes", {"name": "support", "prompt": SYSTEM})
    assert status == 201, rec
    for r in cluster.replicas:                                   # Redis pub/sub pins it everywhere
        wait_for(lambda r=r: any(p["name"] == "support" and p["loaded"]
                                 for p in http("GET", f"{r.url}/v1/prefixes")[1]["data"]), what="pinning")
    pinned = rec["num_pinned_blocks"] * 16
    for policy in ("round_robin", "cache_aware", "power_of_two", "consistent_hash", "random", "kv_aware"):
        with cluster.router(policy) as r:
            for i in range(6):
                out = completion(r.url, f"{policy} user {i} asks", prefix="support")
                assert cached(out) >= pinned, (policy, i, out["usage"])
    hits = [r.metric('prefixserve_prefix_hit_requests_total{prefix="support"}') for r in cluster.replicas]
    assert all(h > 0 for h in hits) and sum(hits) == 36, hits
    assert http("DELETE", f"{router.url}/v1/prefixes/support")[0] == 200


def _hit_tokens(cluster: Cluster) -> list[float]:
    return [r.metric("vllm:prefix_cache_hits_total") for r in cluster.replicas]


@pytest.mark.parametrize("policy", ["kv_aware", "cache_aware", "round_robin"])
def test_an_unregistered_system_prompt_follows_the_policy(cluster: Cluster, policy: str) -> None:
    prompt = f"{policy}: {SYSTEM}"
    n = len(http("POST", f"{cluster.replicas[0].url}/tokenize", {"prompt": prompt})[1]["tokens"])
    floor = (n - 1) // 16 * 16                   # a hit on the system prompt's blocks caches at least this
    assert floor >= 64
    with cluster.router(policy, ["--log-level", "debug"]) as r:
        assert http("POST", f"{r.url}/flush_cache")[0] == 200    # every replica forgets (and says so)
        completion(r.url, prompt + " first question")
        time.sleep(1.0)                                          # its KV events reach the router
        before = _hit_tokens(cluster)
        hit = [cached(completion(r.url, f"{prompt} question {i}")) >= floor for i in range(5)]
        gained = [a - b > 0 for a, b in zip(_hit_tokens(cluster), before)]
        credited = [int(c) for c in re.findall(r"KV prefix decision .*credited_prefix_tokens=(\d+)", r.log())]
    if policy == "round_robin":    # the next two replicas meet it cold, then each has it
        assert hit == [False, False, True, True, True] and all(gained), (hit, gained)
    else:                          # every request goes where it is cached
        assert all(hit) and sum(gained) == 1, (hit, gained)
    if policy == "kv_aware":       # and the router says why: our BlockStored events, credited
        assert len(credited) == 6 and credited[0] == 0 and all(c >= floor for c in credited[1:]), credited


def _streams(url: str, n: int, body: dict[str, Any]) -> tuple[list[threading.Thread], dict[int, Any]]:
    results: dict[int, Any] = {}
    host, port = url.removeprefix("http://").split(":")

    def run(i: int) -> None:
        conn = HTTPConnection(host, int(port), timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps({**body, "prompt": f"request {i}"}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = b""
            try:
                data = resp.read()
            except IncompleteRead as exc:            # a cut chunked stream
                data = exc.partial
            results[i] = (resp.status, data)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            results[i] = ("error", repr(exc))
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started_streaming(cluster: Cluster) -> None:
    victim = cluster.replicas[2]
    body = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with cluster.router("round_robin") as r:
        for stream in (False, True):
            threads, results = _streams(r.url, 3, {**body, "stream": stream})
            wait_for(lambda: all(x.metric("vllm:num_requests_running") == 1 for x in cluster.replicas), 60,
                     "one request on each replica")
            os.kill(victim.proc.pid, signal.SIGKILL)             # mid-run
            victim.proc.wait()
            for t in threads:
                t.join(120)
            statuses = [results[i][0] for i in range(3)]
            if not stream:     # not started: retried elsewhere, complete
                assert statuses == [200] * 3, results
                assert all(json.loads(results[i][1])["usage"]["completion_tokens"] == 300 for i in range(3))
            else:              # the one stream it was serving is cut, the others end normally
                done = [results[i][1].endswith(b"data: [DONE]\n\n") for i in range(3)]
                assert statuses == [200] * 3 and sorted(done) == [False, True, True], results
            victim.start()                                       # back on the same ports; warm again
            wait_for(lambda: all(w["is_healthy"] for w in http("GET", f"{r.url}/workers")[1]["workers"]), 60,
                     "the router to take the restarted replica back")
        before = victim.metric("vllm:e2e_request_latency_seconds_count")
        for i in range(6):
            completion(r.url, f"after restart {i}")
        assert victim.metric("vllm:e2e_request_latency_seconds_count") == before + 2
