"""The prefix registry over HTTP on one server with the embedded store: register, use, list, delete,
bad input, the pinned-block cap, and pinned vs LRU-cached prefixes under memory pressure."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server import ServerThread, http, tiny_config

SYSTEM = "You are a helpful assistant. Answer briefly and cite the page, the block and the cache. " * 3


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, max_model_len=1024, num_kv_blocks=64, block_size=16)).start()
    yield s
    s.stop()


def completion(srv: ServerThread, **body: object) -> dict:
    status, out = http("POST", f"{srv.url}/v1/completions",
                       {"model": srv.state.model_name, "max_tokens": 2, "temperature": 0, **body})
    assert status == 200, out
    return out


def test_register_use_list_delete(srv: ServerThread) -> None:
    status, rec = http("POST", f"{srv.url}/v1/prefixes", {"name": "sys-1", "prompt": SYSTEM, "description": "d"})
    assert status == 201, rec
    assert rec["name"] == "sys-1" and rec["model"] == srv.state.model_name and rec["created_at"] > 0
    assert rec["num_pinned_blocks"] == rec["num_tokens"] // 16 == len(rec["block_hashes"]) > 0
    assert http("POST", f"{srv.url}/v1/prefixes", {"name": "sys-1", "prompt": SYSTEM})[0] == 200   # idempotent
    status, err = http("POST", f"{srv.url}/v1/prefixes", {"name": "sys-1", "prompt": SYSTEM + " more"})
    assert status == 409 and err["error"]["param"] == "name"

    out = completion(srv, prompt=" and now the question?", prefix="sys-1")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == rec["num_pinned_blocks"] * 16
    out = completion(srv, prompt=SYSTEM + " another question?")        # same tokens, prefix not named
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= rec["num_pinned_blocks"] * 16

    status, listing = http("GET", f"{srv.url}/v1/prefixes")
    (entry,) = [p for p in listing["data"] if p["name"] == "sys-1"]
    assert entry["hit_requests"] == 1 and entry["tokens_saved"] == rec["num_pinned_blocks"] * 16
    assert http("GET", f"{srv.url}/v1/prefixes/sys-1")[1]["num_tokens"] == rec["num_tokens"]
    metrics = http("GET", f"{srv.url}/metrics")[1]
    assert 'prefixserve_prefix_hit_requests_total{prefix="sys-1"} 1.0' in metrics

    assert http("DELETE", f"{srv.url}/v1/prefixes/sys-1")[0] == 200
    assert http("GET", f"{srv.url}/v1/prefixes/sys-1")[0] == 404
    assert http("DELETE", f"{srv.url}/v1/prefixes/sys-1")[0] == 404
    assert completion_status(srv, prompt="x", prefix="sys-1") == 404
    assert srv.state.engine is not None and srv.state.engine.stats().kv_blocks_pinned == 0


def completion_status(srv: ServerThread, **body: object) -> int:
    return http("POST", f"{srv.url}/v1/completions", {"model": srv.state.model_name, "max_tokens": 1, **body})[0]


@pytest.mark.parametrize("body, param", [
    ({"name": "bad name!", "prompt": "x"}, "name"),
    ({"name": "", "prompt": "x"}, "name"),
    ({"name": "a" * 65, "prompt": "x"}, "name"),
    ({"name": 5, "prompt": "x"}, "name"),
    ({"name": "ok"}, "prompt"),
    ({"name": "ok", "prompt": "x", "messages": [{"role": "system", "content": "y"}]}, "prompt"),
    ({"name": "ok", "prompt": ""}, "prompt"),
    ({"name": "ok", "messages": "nope"}, "messages"),
    ({"name": "ok", "prompt": "x", "description": 3}, "description"),
])
def test_bad_registrations_are_400(srv: ServerThread, body: dict, param: str) -> None:
    status, err = http("POST", f"{srv.url}/v1/prefixes", body)
    assert status == 400 and err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"


def test_unknown_names_are_404(srv: ServerThread) -> None:
    assert http("GET", f"{srv.url}/v1/prefixes/nope")[1]["error"]["code"] == "prefix_not_found"
    assert http("DELETE", f"{srv.url}/v1/prefixes/nope")[0] == 404
    assert completion_status(srv, prompt="x", prefix="nope") == 404


def test_over_the_pinned_cap_is_507_and_pins_nothing(srv: ServerThread) -> None:
    assert srv.state.engine is not None
    before = srv.state.engine.stats().kv_blocks_pinned
    huge = "block cache page token " * 80                   # ~720 tokens: > 32 blocks (half of 64)
    status, err = http("POST", f"{srv.url}/v1/prefixes", {"name": "huge", "prompt": huge})
    assert status == 507 and "cap" in err["error"]["message"]
    assert srv.state.engine.stats().kv_blocks_pinned == before
    assert http("GET", f"{srv.url}/v1/prefixes/huge")[0] == 404


def test_messages_prefix_with_chat(srv: ServerThread) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block?"},
            {"role": "assistant", "content": "A page of the KV cache."}]
    status, rec = http("POST", f"{srv.url}/v1/prefixes", {"name": "few-shot", "messages": msgs})
    assert status == 201, rec
    status, out = http("POST", f"{srv.url}/v1/chat/completions",
                       {"model": srv.state.model_name, "prefix": "few-shot", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "And a hash?"}]})
    assert status == 200, out
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == rec["num_pinned_blocks"] * 16
    assert http("DELETE", f"{srv.url}/v1/prefixes/few-shot")[0] == 200


def test_pinned_prefix_survives_pressure_lru_one_does_not(srv: ServerThread) -> None:
    pinned_text = "pinned system prompt about pages and blocks " * 6
    seen_text = "another long preamble on hashes tokens and keys " * 6
    status, rec = http("POST", f"{srv.url}/v1/prefixes", {"name": "keep", "prompt": pinned_text})
    assert status == 201, rec
    full = rec["num_pinned_blocks"] * 16
    seen = completion(srv, prompt=seen_text + "?")
    assert completion(srv, prompt=seen_text + "!")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for i in range(10):                                                 # flood 64 blocks with unrelated prompts
        completion(srv, prompt=f"{i} unrelated filler text number {i} " * 30, max_tokens=1)
    assert completion(srv, prompt="q", prefix="keep")["usage"]["prompt_tokens_details"]["cached_tokens"] == full
    again = completion(srv, prompt=seen_text + "?")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (seen, again)
    assert http("DELETE", f"{srv.url}/v1/prefixes/keep")[0] == 200


async def test_clients_that_leave_mid_registration_leak_no_pins(srv: ServerThread) -> None:
    """A client that disconnects while POST /v1/prefixes pins: the registration completes or never
    happened, never half; the pinned blocks always equal the registry's."""
    import asyncio

    import aiohttp

    def pinned_now() -> int:
        return srv.call(_snapshot_pins(srv))

    async with aiohttp.ClientSession() as s:
        for i in range(12):
            try:
                async with asyncio.timeout(0.002 * i):
                    body = {"name": f"gone-{i % 3}", "prompt": f"{i % 3} {SYSTEM}"}
                    await s.post(f"{srv.url}/v1/prefixes", json=body)
            except TimeoutError:
                pass
    for _ in range(200):                                   # what was started, ends
        engine_pins, registry_pins = pinned_now()
        if engine_pins == registry_pins:
            break
        await asyncio.sleep(0.02)
    assert engine_pins == registry_pins
    for i in range(3):                                     # a repeat is 201 (new) or 200 (it completed)
        status, _ = http("POST", f"{srv.url}/v1/prefixes", {"name": f"gone-{i}", "prompt": f"{i} {SYSTEM}"})
        assert status in (200, 201)
        assert http("DELETE", f"{srv.url}/v1/prefixes/gone-{i}")[0] == 200
    assert pinned_now() == (0, 0)


async def _snapshot_pins(srv: ServerThread) -> tuple[int, int]:
    """(pinned blocks in the engine, pinned blocks the registry accounts for), after a step."""
    engine = srv.state.engine
    registry = srv.state.registry
    assert engine is not None and registry is not None
    await engine.unpin_prefix([1])                         # a no-op command: a step, then fresh stats
    return engine.stats().kv_blocks_pinned, sum(e.pinned_blocks for e in registry.local.values())


@pytest.mark.parametrize("name", ["a\n", ".", "..", "x" * 65, "a b", "é"])
def test_bad_prefix_names(srv: ServerThread, name: str) -> None:
    status, err = http("POST", f"{srv.url}/v1/prefixes", {"name": name, "prompt": SYSTEM})
    assert status == 400 and err["error"]["param"] == "name"


def test_description_is_bounded(srv: ServerThread) -> None:
    status, err = http("POST", f"{srv.url}/v1/prefixes", {"name": "big", "prompt": SYSTEM, "description": "d" * 5000})
    assert status == 400 and err["error"]["param"] == "description"


def test_registry_entries_are_capped(tiny_llama_dir: Path) -> None:
    srv = ServerThread(tiny_config(tiny_llama_dir, max_model_len=1024, num_kv_blocks=64, max_prefixes=2)).start()
    try:
        for i in range(2):
            assert http("POST", f"{srv.url}/v1/prefixes", {"name": f"p{i}", "prompt": f"{i} {SYSTEM}"})[0] == 201
        status, err = http("POST", f"{srv.url}/v1/prefixes", {"name": "p2", "prompt": f"2 {SYSTEM}"})
        assert status == 507 and err["error"]["code"] == "registry_full"
        assert http("POST", f"{srv.url}/v1/prefixes", {"name": "p1", "prompt": f"1 {SYSTEM}"})[0] == 200
        assert http("DELETE", f"{srv.url}/v1/prefixes/p0")[0] == 200
        assert http("POST", f"{srv.url}/v1/prefixes", {"name": "p2", "prompt": f"2 {SYSTEM}"})[0] == 201
    finally:
        srv.stop()
