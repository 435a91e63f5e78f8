"""The Responses API (service/openai/responses/api.py) through the openai SDK over real HTTP: text and item input,
instructions, previous_response_id (the conversation carried, and the prefix cache hit that follows), the
store (store: false, GET, DELETE, bounded, one key's responses invisible to another), streaming with the SDK's
event types, function tools and their outputs, and clear 400s for what is not supported."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from openai import OpenAI

from service.openai.responses.api import to_messages
from service.openai.responses.store import ResponseStore, Stored
from tests.helpers.server import ServerThread, tiny_config

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",   # short strings:
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},  # a random
                          "required": ["city"], "additionalProperties": False}}                          # model's


def test_text_input(client: OpenAI, model_name: str) -> None:
    r = client.responses.create(model=model_name, input="Tell me about the sea.", max_output_tokens=6,
                                temperature=0.0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model_name
    assert r.status in ("completed", "incomplete") and r.output and r.output[0].type == "message"
    assert r.usage is not None and r.usage.input_tokens > 0 and 1 <= r.usage.output_tokens <= 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.status == "incomplete") == (r.usage.output_tokens == 6)
    assert isinstance(r.output_text, str)


def test_previous_response_id_carries_the_conversation_and_hits_the_cache(client: OpenAI, model_name: str) -> None:
    first = client.responses.create(model=model_name, instructions="Answer briefly.", temperature=0.0,
                                    input=[{"role": "user", "content": [{"type": "input_text",
                                                                         "text": "Name a colour. " * 8}]}],
                                    max_output_tokens=4)
    second = client.responses.create(model=model_name, previous_response_id=first.id, input="And another?",
                                     instructions="Answer briefly.", temperature=0.0, max_output_tokens=4)
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    # the whole first exchange went before the new question (instructions are each request's own, as OpenAI's),
    # and was read from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=model_name, previous_response_id="resp_nope", input="hi")
    assert exc.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_get_and_delete(client: OpenAI, model_name: str) -> None:
    kept = client.responses.create(model=model_name, input="hi", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    gone = client.responses.create(model=model_name, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model_name, input="again", previous_response_id=gone.id)


def test_streaming_events(client: OpenAI, model_name: str) -> None:
    events = list(client.responses.create(model=model_name, input="Tell me a story.", max_output_tokens=8,
                                          temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):
        assert kinds.count(kind) == 1, kind
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage.output_tokens >= 1
    assert client.responses.retrieve(final.id).output_text == text        # stored when it ended


def test_function_tools_and_their_outputs(client: OpenAI, model_name: str) -> None:
    r = client.responses.create(model=model_name, input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=150,
                                temperature=1.0, extra_body={"seed": 5})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments), dict)
    follow = client.responses.create(model=model_name, previous_response_id=r.id, tools=[WEATHER],  # type: ignore[list-item]
                                     tool_choice="none", max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "18 C and sunny"}])
    assert follow.output and follow.output[0].type == "message"
    stream = list(client.responses.create(model=model_name, input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
                                          tool_choice="required", max_output_tokens=150, temperature=1.0,
                                          extra_body={"seed": 5}, stream=True))
    done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    assert done and all(json.loads(e.arguments) is not None for e in done)  # type: ignore[union-attr]


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({}, "input"),
])
def test_what_is_not_supported_is_a_400_naming_it(server: ServerThread, body: dict, param: str) -> None:
    r = requests.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_input_items_to_messages() -> None:
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                             {"type": "input_text", "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]}]
    msgs = to_messages(items)
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool", "tool"]
    assert msgs[1]["content"] == "Weather in Paris?" and msgs[2]["content"] == "Let me see."
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[4] == {"role": "tool", "tool_call_id": "c2", "content": "20 C"}


def test_the_store_is_bounded() -> None:
    store = ResponseStore(max_items=3, max_bytes=1000)
    for i in range(5):
        store.put(f"r{i}", Stored("", "", {"id": f"r{i}"}, [], 100))
    assert len(store) == 3 and store.get("r0", "") is None and store.get("r4", "") is not None
    store.get("r2", "")                               # used: the least recently used is now r3
    store.put("big", Stored("", "", {}, [], 800))
    assert store.get("r3", "") is None and store.get("r2", "") is not None and store.bytes <= 1000
    store.put("huge", Stored("", "", {}, [], 5000))   # larger than the store: not kept, nothing evicted
    assert store.get("huge", "") is None and store.get("big", "") is not None


def test_the_store_evicts_the_biggest_holders_least_recently_used() -> None:
    """Issue 34, item 3: one tenant's flood evicts its own responses, never those of a tenant holding less."""
    store = ResponseStore(max_items=6, max_bytes=10_000)
    for i in range(2):
        store.put(f"v{i}", Stored("kv", "victim", {}, [], 10))
    for i in range(10):
        store.put(f"f{i}", Stored("kf", "flood", {}, [], 10))
    assert [r for r in ("v0", "v1") if store.get(r, "kv")] == ["v0", "v1"]
    assert [r for r in (f"f{i}" for i in range(10)) if store.get(r, "kf")] == ["f6", "f7", "f8", "f9"]
    assert store.held("victim") == (2, 20) and store.held("flood") == (4, 40) and len(store) == 6
    store.put("v2", Stored("kv", "victim", {}, [], 10))       # the flood's tenant holds the most: its oldest goes
    assert store.get("f6", "kf") is None and store.held("victim") == (3, 30)
    store.put("f10", Stored("kf", "flood", {}, [], 10))       # a tie (3 and 3 + 1): the newcomer's tenant pays
    assert store.get("f7", "kf") is None and store.held("victim") == (3, 30)
    store.put("big", Stored("kf", "flood", {}, [], 9_955))    # over the count (f8 goes), then the bytes (f9)
    assert store.held("victim") == (3, 30) and store.held("flood") == (2, 9_965) and store.bytes == 9_995
    assert store.get("f10", "kf") is not None and store.get("f9", "kf") is None
    assert store.get("v0", "kf") is None and store.get("v0", "kv") is not None    # readable by its key only
    assert not store.delete("v0", "kf") and store.delete("v0", "kv") and store.held("victim") == (2, 20)


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(tiny_config(tiny_llama_dir, api_key=("key-a", "key-b"))).start()
    yield srv
    srv.stop()


def test_one_keys_responses_are_invisible_to_another(keyed: ServerThread) -> None:
    a = OpenAI(base_url=f"{keyed.url}/v1", api_key="key-a", max_retries=0)
    b = OpenAI(base_url=f"{keyed.url}/v1", api_key="key-b", max_retries=0)
    name = keyed.state.model_name
    r = a.responses.create(model=name, input="my secret plan", max_output_tokens=2)
    assert a.responses.retrieve(r.id).id == r.id
    for attempt in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                    lambda: b.responses.create(model=name, input="continue", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert a.responses.retrieve(r.id).id == r.id      # b's delete did nothing


def test_a_whole_response_waits_for_its_prompt_cache_key_lease(server: ServerThread) -> None:
    """Issue 34, item 9: a whole Responses answer came back before its prompt_cache_key lease was pinned (chat's and
    completions' wait for it). The registry is held busy here, so the lease cannot be pinned until it is let go."""
    registry = server.state.registry
    assert registry is not None
    body = {"input": "A long agent prompt, resent with every turn of the conversation. " * 4, "max_output_tokens": 1,
            "prompt_cache_key": "responses-lease-wait"}
    server.call(registry.lock.acquire())
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(requests.post, f"{server.url}/v1/responses", json=body, timeout=60)
            time.sleep(1.5)
            assert not pending.done()             # answered only once the lease is pinned
            server.loop.call_soon_threadsafe(registry.lock.release)
            r = pending.result(30)
    finally:
        if registry.lock.locked():
            server.loop.call_soon_threadsafe(registry.lock.release)
    assert r.status_code == 200, r.text
    name = "pck-" + hashlib.sha256(b"responses-lease-wait").hexdigest()[:32]
    lease = requests.get(f"{server.url}/v1/prefixes/{name}", timeout=10)
    assert lease.status_code == 200 and lease.json()["type"] == "prompt_cache_key"
    assert requests.delete(f"{server.url}/v1/prefixes/{name}", timeout=10).status_code == 200


def test_a_failure_after_the_headers_ends_a_response_stream_through_the_guard(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 34, item 9: the engine's error mid-stream became an `error` event written without the disconnect guard
    of sse.stream: a client gone by then made the handler raise (aiohttp's "Error handling request"). Here the
    engine fails on the second output and the client is gone when the error event is written."""
    from engine.errors import CapacityExceeded
    from service.openai.generation import Generation
    from service.openai.sse import SSEResponse
    real_deltas, real_write = Generation._deltas, SSEResponse.write
    outputs: list[int] = []

    def failing(self: Generation, out: Any) -> Any:
        outputs.append(1)
        if len(outputs) == 2:
            raise CapacityExceeded("the KV cache was taken meanwhile")
        return real_deltas(self, out)

    async def gone(self: SSEResponse, data: Any) -> None:
        if b"event: error" in bytes(data):
            raise ConnectionResetError("the client went away")
        await real_write(self, data)

    monkeypatch.setattr(Generation, "_deltas", failing)
    monkeypatch.setattr(SSEResponse, "write", gone)
    caplog.set_level(logging.ERROR)
    with requests.post(f"{server.url}/v1/responses", json={"input": "Tell me a story.", "max_output_tokens": 20,
                                                           "stream": True}, timeout=60, stream=True) as r:
        assert r.status_code == 200
        with contextlib.suppress(requests.RequestException):
            assert b"response.created" in r.content
    monkeypatch.setattr(Generation, "_deltas", real_deltas)
    monkeypatch.setattr(SSEResponse, "write", real_write)
    assert len(outputs) >= 2
    assert not [rec for rec in caplog.records if rec.exc_info], [rec.getMessage() for rec in caplog.records]
    st = server.state.engine.stats()
    for _ in range(100):
        if st.requests_running == st.requests_waiting == 0:
            break
        time.sleep(0.05)
        st = server.state.engine.stats()
    assert st.requests_running == st.requests_waiting == 0
