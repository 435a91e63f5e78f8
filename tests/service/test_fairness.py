"""One tenant's flood leaves the others their share (issue 34, items 5 and 6), against a real server with two
API keys: the pinned budget (a tenant at its share gets 507 naming it; another tenant still registers, and its
prompt_cache_key lease is kept) and the scheduler (another tenant's 4-token completion is answered while a burst
of long prompts is still queued, not after it)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import requests

from tests.helpers.server import ServerThread, tiny_config

A, B, ADMIN = "key-flood", "key-other", "key-admin"
BLOCKS, BLOCK = 512, 16                   # pin cap: half (256 blocks); one tenant's share: a quarter of it (64)


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, api_key=(A, B), admin_key=(ADMIN,), max_model_len=1024,
                                 num_kv_blocks=BLOCKS, max_num_batched_tokens=64)).start()
    try:
        yield s
    finally:
        s.stop()


def api(srv: ServerThread, method: str, path: str, key: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{srv.url}{path}", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})


def text(i: int, words: int = 110) -> str:
    return " ".join(f"w{i}x{j}" for j in range(words))


def test_a_tenant_at_its_pin_share_gets_507_and_the_others_keep_theirs(srv: ServerThread) -> None:
    made = []
    try:
        for i in range(12):                # 12 x 34 blocks: more than the whole cap (256)
            resp = api(srv, "POST", "/v1/prefixes", A, {"name": f"flood{i}", "prompt": text(i)})
            if resp.status_code != 201:
                break
            made.append(f"flood{i}")
        err = resp.json()["error"]
        assert resp.status_code == 507 and "share of 64 pinned blocks" in err["message"], err
        assert "--pinned-tenant-fraction" in err["message"] and len(made) == 1
        pinned = sum(p["num_pinned_blocks"] for p in api(srv, "GET", "/v1/prefixes", A).json()["data"])
        assert pinned == 34
        # the other tenant registers, and its prompt_cache_key lease is kept (it used to be dropped silently)
        assert api(srv, "POST", "/v1/prefixes", B, {"name": "mine", "prompt": text(100, 40)}).status_code == 201
        warm = api(srv, "POST", "/v1/completions", B, {"prompt": text(101, 60), "max_tokens": 0,
                                                        "prompt_cache_key": "agent-1"})
        assert warm.status_code == 200, warm.text
        kinds = sorted(p["type"] for p in api(srv, "GET", "/v1/prefixes", B).json()["data"])
        assert kinds == ["named", "prompt_cache_key"], kinds
        # the flooding tenant's own leases are held to its share too: refused, the request still answered
        over = api(srv, "POST", "/v1/completions", A, {"prompt": text(102), "max_tokens": 0,
                                                        "prompt_cache_key": "agent-2"})
        assert over.status_code == 200
        assert all(p["type"] == "named" for p in api(srv, "GET", "/v1/prefixes", A).json()["data"])
        # deleting gives the share back
        api(srv, "DELETE", f"/v1/prefixes/{made.pop()}", A)
        assert api(srv, "POST", "/v1/prefixes", A, {"name": "again", "prompt": text(103)}).status_code == 201
        made.append("again")
    finally:
        for name in made:
            api(srv, "DELETE", f"/v1/prefixes/{name}", A)
        for p in api(srv, "GET", "/v1/prefixes", B).json()["data"]:
            api(srv, "DELETE", f"/v1/prefixes/{p['name']}", B)


def test_a_burst_of_long_prompts_does_not_hold_another_tenants_short_request(srv: ServerThread) -> None:
    """48 cold ~900-token prompts from one key (the budget of 64 tokens a step makes each take 15 steps), then
    another key's 4-token completion: it is answered while most of the burst still waits (FCFS served the
    whole burst first)."""
    async def run() -> tuple[float, int]:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {A}"}) as flood, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {B}"}) as other:
            done: list[float] = []

            async def warm(i: int) -> None:
                async with flood.post(f"{srv.url}/v1/completions",
                                      json={"prompt": text(1000 + i, 105), "max_tokens": 1}) as r:
                    body = await r.read()
                    assert r.status == 200, body
                    done.append(time.monotonic())
            burst = [asyncio.create_task(warm(i)) for i in range(48)]
            await asyncio.sleep(0.5)                                 # queued, the first ones computing
            t0 = time.monotonic()
            async with other.post(f"{srv.url}/v1/completions",
                                  json={"prompt": "a short question", "max_tokens": 4, "ignore_eos": True}) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
            t1 = time.monotonic()
            for task in burst:                                       # the rest of the burst goes away
                task.cancel()
            await asyncio.gather(*burst, return_exceptions=True)
            return t1 - t0, len(done)

    took, burst_done = asyncio.run(run())
    assert burst_done < 24 and took < 10, (took, burst_done)
    deadline = time.monotonic() + 30                                 # the burst's requests were aborted
    while srv.state.engine.stats().requests_running + srv.state.engine.stats().requests_waiting:  # type: ignore
        assert time.monotonic() < deadline
        time.sleep(0.1)
