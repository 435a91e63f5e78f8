"""POST /v1/messages and /v1/messages/count_tokens on the tiny checkpoint, through the anthropic SDK and on the wire:
the answer's shape, Anthropic's event sequence byte for byte, count_tokens against the chat rendering, errors in
Anthropic's shape, and cache_control breakpoints as leases with Anthropic's usage."""
from __future__ import annotations

import http.client as httpc
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.helpers.server import ServerThread, fresh_system_prompt, http


@pytest.fixture()
def ac(server: ServerThread) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed answer, read off the socket as the bytes came."""
    host, port = url.removeprefix("http://").split(":")
    conn = httpc.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/messages", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    raw = resp.read().decode()
    conn.close()
    out = []
    for frame in raw.split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2, frame
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


def test_create_answers_in_anthropics_shape(ac: anthropic.Anthropic, model_name: str) -> None:
    msg = ac.messages.create(model=model_name, max_tokens=6, messages=[{"role": "user", "content": "Hello there"}],
                             extra_body={"temperature": 0.0})
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == model_name
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text      # type: ignore[union-attr]
    u = msg.usage
    assert u.output_tokens == 6 and u.cache_creation_input_tokens == 0 and u.cache_creation is not None
    assert u.cache_creation.ephemeral_5m_input_tokens == 0 and u.cache_creation.ephemeral_1h_input_tokens == 0
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == ac.messages.count_tokens(
        model=model_name, messages=[{"role": "user", "content": "Hello there"}]).input_tokens


def test_count_tokens_is_the_chat_rendering(ac: anthropic.Anthropic, server: ServerThread, model_name: str) -> None:
    system = "Be brief."
    messages: Any = [{"role": "user", "content": "What is two plus two?"},
                     {"role": "assistant", "content": [{"type": "text", "text": "Four."}]},
                     {"role": "user", "content": [{"type": "text", "text": "And three?"}]}]
    n = ac.messages.count_tokens(model=model_name, system=system, messages=messages).input_tokens
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"}]
    status, out = http("POST", f"{server.url}/tokenize", {"messages": chat})
    assert status == 200 and n == out["count"]


def test_the_stream_is_anthropics_event_sequence(server: ServerThread, ac: anthropic.Anthropic,
                                                 model_name: str) -> None:
    body = {"model": model_name, "max_tokens": 8, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Tell me a story"}]}
    events = _events(server.url, body)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert {"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"} <= set(start["usage"])
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8
    whole = ac.messages.create(model=model_name, max_tokens=8, messages=body["messages"],  # type: ignore[arg-type]
                               extra_body={"temperature": 0.0})
    assert text == whole.content[0].text                                   # type: ignore[union-attr]
    with ac.messages.stream(model=model_name, max_tokens=8, messages=body["messages"],     # type: ignore[arg-type]
                            extra_body={"temperature": 0.0}) as s:
        assert s.get_final_text() == text


def test_stop_sequences_say_which(ac: anthropic.Anthropic, model_name: str) -> None:
    free = ac.messages.create(model=model_name, max_tokens=12, messages=[{"role": "user", "content": "Go on"}],
                              extra_body={"temperature": 0.0})
    text = free.content[0].text                                            # type: ignore[union-attr]
    stop = text[3:5]
    assert stop.strip()
    msg = ac.messages.create(model=model_name, max_tokens=12, messages=[{"role": "user", "content": "Go on"}],
                             stop_sequences=[stop], extra_body={"temperature": 0.0})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]                  # type: ignore[union-attr]


def _error(status: int, out: Any, kind: str, *words: str) -> None:
    assert out["type"] == "error" and set(out) == {"type", "error"}, out
    assert out["error"]["type"] == kind, out
    assert all(w in out["error"]["message"] for w in words), out


@pytest.mark.parametrize("block", ["image", "document"])
def test_images_and_documents_are_refused_by_name(server: ServerThread, model_name: str, block: str) -> None:
    status, out = http("POST", f"{server.url}/v1/messages", {"model": model_name, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": block, "source": {"type": "base64", "data": "AAAA"}}]}]})
    assert status == 400
    _error(status, out, "invalid_request_error", repr(block), "messages[0].content[1]")


def test_errors_are_in_anthropics_shape(server: ServerThread, model_name: str) -> None:
    url = f"{server.url}/v1/messages"
    ask = [{"role": "user", "content": "hi"}]
    status, out = http("POST", url, {"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": ask})
    assert status == 404
    _error(status, out, "not_found_error", model_name)
    status, out = http("POST", url, {"model": model_name, "max_tokens": "4", "messages": ask})
    assert status == 400
    _error(status, out, "invalid_request_error", "max_tokens")
    status, out = http("POST", url, {"model": model_name, "messages": ask})
    _error(status, out, "invalid_request_error", "max_tokens")
    status, out = http("POST", url, {"model": model_name, "max_tokens": 0, "messages": ask})
    assert status == 400
    _error(status, out, "invalid_request_error", "cache_control")
    cc = {"type": "ephemeral"}
    many = [{"role": "user", "content": [{"type": "text", "text": f"part {i}", "cache_control": cc} for i in range(5)]}]
    status, out = http("POST", url, {"model": model_name, "max_tokens": 4, "messages": many})
    assert status == 400
    _error(status, out, "invalid_request_error", "at most 4")
    status, out = http("POST", url, {"model": model_name, "max_tokens": 4, "messages": ask,
                                     "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert status == 400
    _error(status, out, "invalid_request_error", "tools")
    status, out = http("POST", f"{server.url}/v1/messages/count_tokens", {"model": model_name, "messages": []})
    assert status == 400
    _error(status, out, "invalid_request_error", "messages")


def test_unknown_fields_are_named_not_refused(server: ServerThread, model_name: str) -> None:
    body = json.dumps({"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                       "betas_unheard_of": 1, "metadata": {"user_id": "u-1"}, "thinking": {"type": "disabled"}})
    host, port = server.url.removeprefix("http://").split(":")
    conn = httpc.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/messages", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("X-Ignored-Fields") == "betas_unheard_of"
    conn.close()


def _prefixes(server: ServerThread) -> dict[str, dict[str, Any]]:
    status, out = http("GET", f"{server.url}/v1/prefixes?limit=1000")
    assert status == 200
    return {p["name"]: p for p in out["data"] if p["type"] == "cache_control"}


def test_cache_control_writes_then_reads_with_both_ttls(ac: anthropic.Anthropic, server: ServerThread,
                                                       model_name: str) -> None:
    """The first request writes the tokens up to each breakpoint (split by their TTLs), the second reads them;
    input_tokens is what is left; each breakpoint is a lease of its TTL."""
    before = set(_prefixes(server))
    system: Any = [{"type": "text", "text": fresh_system_prompt(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    turn = "Here are the account notes: " + " ".join(f"note{i}" for i in range(6))
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": turn,
                                                   "cache_control": {"type": "ephemeral", "ttl": "5m"}},
                                                  {"type": "text", "text": "What now?"}]}]
    total = ac.messages.count_tokens(model=model_name, system=system, messages=messages).input_tokens
    sys_tokens = ac.messages.count_tokens(model=model_name, system=system[0]["text"],
                                          messages=[{"role": "user", "content": "x"}]).input_tokens
    first = ac.messages.create(model=model_name, max_tokens=2, system=system, messages=messages)
    u = first.usage
    assert u.cache_read_input_tokens == 0
    assert u.cache_creation is not None and u.cache_creation.ephemeral_1h_input_tokens > 0
    assert u.cache_creation.ephemeral_5m_input_tokens > 0
    assert u.cache_creation_input_tokens == u.cache_creation.ephemeral_1h_input_tokens + \
        u.cache_creation.ephemeral_5m_input_tokens
    assert u.cache_creation_input_tokens % 16 == 0 and u.cache_creation.ephemeral_1h_input_tokens < sys_tokens
    assert u.input_tokens == total - u.cache_creation_input_tokens
    leases = {n: p for n, p in _prefixes(server).items() if n not in before}
    assert sorted(p["ttl_seconds"] for p in leases.values()) == [300, 3600]
    assert sorted(p["num_tokens"] for p in leases.values()) == [u.cache_creation.ephemeral_1h_input_tokens,
                                                                u.cache_creation_input_tokens]
    second = ac.messages.create(model=model_name, max_tokens=2, system=system, messages=messages)
    v = second.usage
    # what the engine read: the breakpoints' blocks, and the first request's other full blocks still cached
    assert v.cache_creation_input_tokens == 0 and v.cache_read_input_tokens >= u.cache_creation_input_tokens
    assert v.input_tokens == total - v.cache_read_input_tokens
    assert set(_prefixes(server)) - before == set(leases)          # the same leases, refreshed


def test_a_warm_up_writes_and_generates_nothing(ac: anthropic.Anthropic, model_name: str) -> None:
    system: Any = [{"type": "text", "text": fresh_system_prompt(), "cache_control": {"type": "ephemeral"}}]
    ask: Any = [{"role": "user", "content": "Hi"}]
    warm = ac.messages.create(model=model_name, max_tokens=0, system=system, messages=ask)
    assert warm.content == [] and warm.usage.output_tokens == 0 and warm.usage.cache_creation_input_tokens >= 32
    assert warm.stop_reason == "max_tokens"
    hit = ac.messages.create(model=model_name, max_tokens=2, system=system, messages=ask)
    assert hit.usage.cache_read_input_tokens >= warm.usage.cache_creation_input_tokens


def test_a_lease_ends_after_its_ttl(ac: anthropic.Anthropic, server: ServerThread, model_name: str) -> None:
    """After its TTL without hits the breakpoint's lease is gone: unpinned, out of the listing. (Its end is
    moved to now rather than waiting 5 minutes; the sweep does the rest, as it does for any lease.)"""
    import dataclasses
    import time

    before = set(_prefixes(server))
    system: Any = [{"type": "text", "text": fresh_system_prompt(), "cache_control": {"type": "ephemeral"}}]
    ac.messages.create(model=model_name, max_tokens=1, system=system, messages=[{"role": "user", "content": "Hi"}])
    (name,) = set(_prefixes(server)) - before
    engine = server.state.engine
    assert engine is not None
    pinned = engine.stats().kv_blocks_pinned

    async def expire() -> None:         # as if 5 minutes had passed: its end, in the store and the view
        registry = server.state.registry
        assert registry is not None
        for entry in registry.local.values():
            if entry.record.name == name:
                entry.record = dataclasses.replace(entry.record, expires_at=time.time() - 1)
                await registry.store.update(entry.record, origin="test")
    server.call(expire())
    deadline = time.time() + 10
    while name in _prefixes(server) and time.time() < deadline:
        time.sleep(0.2)
    assert name not in _prefixes(server)
    assert engine.stats().kv_blocks_pinned < pinned
