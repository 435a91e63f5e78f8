"""The service on the vAttention backend: the same answers as on the paged one, named prefixes pinned and
hit, streams, and its metrics; nothing held once requests end."""
from __future__ import annotations

import json
import time
from pathlib import Path

import requests

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
