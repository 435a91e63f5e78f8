"""Issue 24, items 9 and 10: client input that used to be a 500 (or a stream that never ended) is a 400, and
any failure after an SSE stream started ends it with an error event and [DONE] instead of leaving the client
waiting."""
from __future__ import annotations

import time
from typing import Any

import pytest
import requests

from tests.helpers.server import ServerThread

MSG = [{"role": "user", "content": "hi"}]
LOOP = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}   # no finite instance


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": LOOP}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": LOOP}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": LOOP}}},
], ids=["required", "named", "json_schema"])
def test_self_referencing_schemas_are_a_400_or_end_cleanly(server: ServerThread, body: dict[str, Any],
                                                           stream: bool) -> None:
    r = requests.post(f"{server.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 8, "stream": stream,
                                                                 **body}, timeout=60, stream=stream)
    if r.status_code == 200:                          # accepted: then it must end, with [DONE] when streamed
        text = r.text
        assert not stream or text.rstrip().endswith("data: [DONE]"), text[-300:]
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert requests.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                         timeout=60).status_code == 200                 # and nothing else broke


def _deep(depth: int) -> str:
    """A tool parameters schema nested `depth` objects deep, as JSON text (too deep for json.dumps)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + '},"required":["a"]}' * depth


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("depth", [200, 2000])
def test_deeply_nested_tool_schemas_are_a_400_or_end_cleanly(server: ServerThread, depth: int, stream: bool) -> None:
    flag = "true" if stream else "false"
    body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": ' + flag + ', '
            '"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": '
            + _deep(depth) + '}}]}')
    r = requests.post(f"{server.url}/v1/chat/completions", data=body, timeout=120, stream=stream,
                      headers={"Content-Type": "application/json"})
    if r.status_code == 200:
        assert not stream or r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.status_code in (400, 413), r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert requests.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                         timeout=60).status_code == 200


def test_a_fault_after_the_headers_still_ends_the_stream(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, item 9: any exception once an SSE answer has started ends it with an error event and [DONE]
    (the client used to wait forever), and the request's engine work is aborted."""
    from service.openai.chat import ChatShaper
    real = ChatShaper.chunks
    calls: list[int] = []

    def broken(self: ChatShaper, gen: Any, d: Any) -> list[dict[str, Any]]:
        calls.append(1)
        if len(calls) == 3:
            raise RecursionError("a shaping fault")
        return real(self, gen, d)

    monkeypatch.setattr(ChatShaper, "chunks", broken)
    r = requests.post(f"{server.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 30, "stream": True,
                                                                 "ignore_eos": True}, timeout=60, stream=True)
    text = r.text
    assert r.status_code == 200 and '"internal_error"' in text and text.rstrip().endswith("data: [DONE]")
    monkeypatch.setattr(ChatShaper, "chunks", real)
    st = server.state.engine.stats()
    for _ in range(100):
        if st.requests_running == st.requests_waiting == 0:
            break
        time.sleep(0.05)
        st = server.state.engine.stats()
    assert st.requests_running == st.requests_waiting == 0
