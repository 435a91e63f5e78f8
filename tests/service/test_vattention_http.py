"""The service on the vAttention backend: the same answers as on the paged one, named prefixes pinned and
hit, streams, and its metrics; nothing held once requests end."""
from __future__ import annotations

import errno
import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from engine.kv.backends.vattention import vmm
from tests.helpers.server import ServerThread, tiny_config

SYSTEM = "You are a terse assistant for a block-paged cache. Answer in five words or fewer, always. " * 2


def answers(url: str) -> list[str]:
    out = []
    for q in ("What is a page?", "Why map it twice?"):
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "max_tokens": 12, "temperature": 0}
        r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def metric(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_vattention_serves_like_paged(tiny_llama_dir: Path, server: ServerThread) -> None:
    expected = answers(server.url)
    srv = ServerThread(tiny_config(tiny_llama_dir, kv_backend="vattention")).start()
    try:
        assert answers(srv.url) == expected
        r = requests.post(f"{srv.url}/v1/prefixes", json={"name": "terse", "messages": [
            {"role": "system", "content": SYSTEM}]}, timeout=60)
        assert r.status_code == 201 and r.json()["num_pinned_blocks"] > 0, r.text
        body = {"prefix": "terse", "messages": [{"role": "user", "content": "What is a page?"}], "max_tokens": 12,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        lines = requests.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).text.splitlines()
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert [x for x in lines if x][-1] == "data: [DONE]"
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == expected[0]
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * r.json()["num_pinned_blocks"]
        deadline = time.monotonic() + 10
        while metric(srv.url, "prefixserve_vattention_busy_slots") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(srv.url, "prefixserve_kv_blocks_used") == metric(srv.url, "prefixserve_kv_blocks_pinned") > 0
        assert metric(srv.url, "prefixserve_vattention_mapped_pages") > 0
        assert metric(srv.url, "prefixserve_vattention_decode_stalls_total") == 0
        info = requests.get(f"{srv.url}/get_server_info", timeout=10).json()
        assert info["kv_backend"] == "vattention" and info["kv_block_size"] >= 16
    finally:
        srv.stop()


def test_a_broken_kv_cache_answers_503_and_health_says_why(tiny_llama_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, item 1: when a failed mapping leaves a range whose PROT_NONE cannot be put back (every mmap
    fails from then on), the cache marks itself failed: the request in flight and every later one get a
    503 naming it, and /health answers 503 with the reason instead of 200."""
    srv = ServerThread(tiny_config(tiny_llama_dir, kv_backend="vattention")).start()
    try:
        body = {"prompt": "a request that needs pages mapped", "max_tokens": 4}
        assert requests.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200

        def broken(*args: Any) -> int:
            raise OSError(errno.ENOMEM, "injected: out of memory mappings")
        monkeypatch.setattr(vmm, "sys_mmap", broken)
        monkeypatch.setattr(vmm, "sys_madvise", broken)
        fresh = {"prompt": "another, longer prompt that needs fresh pages " * 4, "max_tokens": 4}
        r = requests.post(f"{srv.url}/v1/completions", json=fresh, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_dead" and "KV cache is broken" in r.json()["error"]["message"]
        monkeypatch.undo()                                      # mmap works again: the cache stays failed
        r = requests.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        health = requests.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["status"] == "dead" and "KV cache is broken" in health.json()["reason"]
    finally:
        srv.stop()
