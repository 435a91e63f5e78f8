"""The SSE bytes on the wire, keep-alive comments, and client disconnects aborting their requests."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.helpers.server import ServerThread, tiny_config


async def _raw(url: str, body: dict) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as resp:
            return resp, await resp.read()


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return raw[:-2].split(b"\n\n")


async def test_completion_stream_bytes(server: ServerThread, model_name: str) -> None:
    body = {"model": model_name, "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    resp, raw = await _raw(f"{server.url}/v1/completions", body)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    events = _events(raw)
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events[:-1])
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


async def test_stream_refused_before_headers(server: ServerThread, model_name: str) -> None:
    """A bad request is refused before any SSE byte: plain JSON error, not a stream."""
    body = {"model": model_name, "messages": [{"role": "user", "content": "x"}], "stream": True,
            "max_tokens": 10_000}
    resp, raw = await _raw(f"{server.url}/v1/chat/completions", body)
    assert resp.status == 400 and resp.content_type == "application/json"
    assert json.loads(raw)["error"]["param"] == "max_tokens"


@pytest.fixture(scope="module")
def one_seat(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    """One running sequence at a time, a one-request waiting queue, quick keep-alives."""
    srv = ServerThread(tiny_config(tiny_llama_dir, max_num_seqs=1, max_num_waiting=1, keepalive_interval=0.05,
                                   max_body_bytes=4096)).start()
    yield srv
    srv.stop()


async def _first_event(resp: aiohttp.ClientResponse) -> bytes:
    buf = b""
    while b"\n\n" not in buf:
        buf += await resp.content.readany()
    return buf


async def test_keepalive_queue_full_and_disconnect(one_seat: ServerThread) -> None:
    """A holds the only seat; B waits (keep-alive comments); C gets 429; cutting A frees the seat for B."""
    url = f"{one_seat.url}/v1/completions"
    long = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        a = await s.post(url, json=long)
        assert (await _first_event(a)).startswith(b"data: {")
        b = await s.post(url, json={**long, "max_tokens": 3})
        first_b = await _first_event(b)
        assert first_b.startswith(b": keep-alive\n\n"), first_b
        c = await s.post(url, json={**long, "max_tokens": 3})
        assert c.status == 429 and c.headers["Retry-After"] == "1"
        assert (await c.json())["error"]["type"] == "rate_limit_error"
        t0 = time.monotonic()
        a.close()                       # client goes away mid-stream: A is aborted, B is admitted
        rest = await b.read()
        assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in rest
        assert time.monotonic() - t0 < 5
    stats = one_seat.state.engine.stats()
    assert stats.requests_running == stats.requests_waiting == 0
    assert stats.kv_blocks_used == stats.kv_blocks_pinned


async def test_body_too_large_is_413(one_seat: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{one_seat.url}/v1/completions", json={"prompt": "x" * 8000}) as resp:
            assert resp.status == 413
            err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and "4096" in err["message"]


def test_sse_json_one_call_for_a_chunk_pieces_for_a_large_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    # A streamed token's chunk is encoded by one json.dumps call (the event loop's cost per token); a payload of
    # thousands of elements (an echoed prompt's log-probabilities) still in pieces, none of them large (json's C
    # encoder holds the GIL for a whole call); both exactly json.dumps' text.
    from service.openai import sse
    real = json.dumps
    calls: list[int] = []

    def counting(obj: object, **kw: object) -> str:
        text = real(obj, **kw)
        calls.append(len(text))
        return text

    monkeypatch.setattr(sse.json, "dumps", counting)
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " Paris", "logprobs": None, "finish_reason": None}]}
    assert sse.dumps(chunk, compact=True) == real(chunk, ensure_ascii=False, separators=(",", ":"))
    assert len(calls) == 1
    calls.clear()
    large = {"choices": [{"index": 0, "logprobs": {"tokens": [f"t{i}" for i in range(3000)],
                                                   "top_logprobs": [{f"t{i}": -0.5, "x": -1.5} for i in range(3000)]}}]}
    assert sse.dumps(large) == real(large)
    assert len(calls) > 3000 and max(calls) < 64 * 1024
