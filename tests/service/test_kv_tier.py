"""The KV tier behind the service: a restarted replica restores its registered prefixes from disk before /health
says ready, a new replica reads another one's blocks from a shared tier directory, a deleted prefix leaves the
disk, and the tier's figures are in /metrics. Real servers (tiny Llama) on one real Redis."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.redis_server import RedisServer
from tests.helpers.server import ServerThread, http, tiny_config

PROMPT = "You are a careful assistant for questions about paged attention, KV caches and prefix sharing. " * 4


@pytest.fixture()
def redis() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


def complete(srv: ServerThread, prompt: str, prefix: str | None = None) -> tuple[str, int]:
    body: dict[str, Any] = {"model": srv.state.model_name, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    if prefix is not None:
        body["prefix"] = prefix
    status, out = http("POST", f"{srv.url}/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def block_files(root: Path) -> set[str]:
    return {p.stem for p in root.rglob("*.kv")}


def wait_for(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_restarted_replica_restores_its_prefixes_and_forgets_a_deleted_one(tiny_llama_dir: Path, tmp_path: Path,
                                                                            redis: RedisServer) -> None:
    tier = tmp_path / "tier"
    config = tiny_config(tiny_llama_dir, redis_url=redis.url, kv_tier_dir=str(tier))
    first = ServerThread(config).start()
    try:
        status, rec = http("POST", f"{first.url}/v1/prefixes", {"name": "sys", "prompt": PROMPT})
        assert status == 201, rec
        answer, _ = complete(first, "What is a block table?", prefix="sys")
    finally:
        first.stop()                                          # the engine's close writes what is queued
    hashes = set(rec["block_hashes"])
    assert hashes <= block_files(tier)
    second = ServerThread(tiny_config(tiny_llama_dir, redis_url=redis.url, kv_tier_dir=str(tier))).start()
    try:
        # ready means restored: the prefix's blocks came from the tier, only the tokens after its last
        # block computed (the prefill's last token is always computed)
        blocks = rec["num_pinned_blocks"]
        assert second.metric("prefixserve_kv_tier_hit_blocks_total") >= blocks - 1
        assert second.metric("vllm:prefix_cache_hits_total") >= (blocks - 1) * 16
        again, cached = complete(second, "What is a block table?", prefix="sys")
        assert again == answer and cached >= blocks * 16
        assert second.metric("prefixserve_kv_tier_local_files") >= blocks
        assert second.metric("prefixserve_kv_tier_faults_corrupt_total") == 0
        status, _ = http("DELETE", f"{second.url}/v1/prefixes/sys")
        assert status == 200
        wait_for(lambda: not hashes & block_files(tier), "the deleted prefix's files to go")
        # a lease that ends is not a deletion: its blocks stay on disk (until the LRU takes them)
        status, lease = http("POST", f"{second.url}/v1/prefixes", {"name": "brief", "prompt": "Lease. " + PROMPT,
                                                                    "ttl_seconds": 1})
        assert status == 201, lease
        wait_for(lambda: not http("GET", f"{second.url}/v1/prefixes")[1]["data"], "the lease to end")
        assert set(lease["block_hashes"]) <= block_files(tier)
    finally:
        second.stop()


def test_a_new_replica_reads_another_ones_blocks_from_the_shared_tier(tiny_llama_dir: Path, tmp_path: Path,
                                                                      redis: RedisServer) -> None:
    shared = tmp_path / "shared"

    def config(local: str) -> Any:
        return tiny_config(tiny_llama_dir, redis_url=redis.url, kv_tier_shared_dir=str(shared),
                           kv_tier_dir=str(tmp_path / local), num_kv_blocks=40)
    a = ServerThread(config("a")).start()
    b = None
    try:
        status, rec = http("POST", f"{a.url}/v1/prefixes", {"name": "sys", "prompt": PROMPT})
        assert status == 201, rec
        wait_for(lambda: set(rec["block_hashes"]) <= block_files(shared), "the pinned blocks in the shared tier")
        # an unregistered prompt computed on A, then evicted there by others: its blocks go to the shared tier
        lone = "A prompt nobody registered, long enough for several blocks of the tiny model's cache. " * 2
        text, _ = complete(a, lone)
        for i in range(6):
            complete(a, f"Filler prompt {i} " * 20)
        wait_for(lambda: a.metric("prefixserve_kv_tier_written_blocks_total") > 2 * rec["num_pinned_blocks"],
                 "evicted blocks written")
        b = ServerThread(config("b")).start()
        assert b.metric("prefixserve_kv_tier_hit_blocks_total") >= rec["num_pinned_blocks"] - 1
        _, cached = complete(b, "Hello", prefix="sys")
        assert cached >= rec["num_pinned_blocks"] * 16
        again, cached = complete(b, lone)
        assert again == text and cached > 0
    finally:
        a.stop()
        if b is not None:
            b.stop()
