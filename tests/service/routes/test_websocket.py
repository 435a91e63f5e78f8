"""/v1/ws: several generations on one socket, cancel, an error in one, the frames on the wire."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.helpers.server import ServerThread


async def _collect(ws: aiohttp.ClientWebSocketResponse, until_done: set[Any]) -> list[dict]:
    frames = []
    while until_done:
        msg = await asyncio.wait_for(ws.receive(), 30)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        frame = json.loads(msg.data)
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            until_done.discard(frame["id"])
    return frames


async def test_multiplex_cancel_and_error(server: ServerThread, model_name: str) -> None:
    base = {"type": "generate", "model": model_name, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{server.url}/v1/ws") as ws:
        await ws.send_json({**base, "id": "a", "prompt": "hello world", "max_tokens": 40})
        await ws.send_json({**base, "id": 2, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40})
        await ws.send_json({**base, "id": "long", "prompt": "cache", "max_tokens": 200})
        await ws.send_json({**base, "id": "bad", "prompt": "x", "temperature": -5})
        await ws.send_str("{not json")
        # the long one is cancelled once it has streamed something
        frames: list[dict] = []
        while not any(f["type"] == "delta" and f["id"] == "long" for f in frames):
            frames.append(json.loads((await asyncio.wait_for(ws.receive(), 30)).data))
        await ws.send_json({"type": "cancel", "id": "long"})
        frames += await _collect(ws, {"a", 2, "long", "bad", None} - {f["id"] for f in frames
                                                                       if f["type"] in ("done", "error")})
        # the socket still works after all of that
        await ws.send_json({**base, "id": "after", "prompt": "hello world", "max_tokens": 40})
        after = await _collect(ws, {"after"})

    by_id: dict[Any, list[dict]] = {}
    for f in frames:
        by_id.setdefault(f["id"], []).append(f)
    assert [f["type"] for f in by_id["bad"]] == ["error"]
    assert by_id["bad"][0]["error"]["param"] == "temperature"
    assert by_id[None][0]["type"] == "error" and by_id[None][0]["error"]["type"] == "invalid_request_error"
    for gid in ("a", 2):
        kinds = [f["type"] for f in by_id[gid]]
        assert kinds[-1] == "done" and set(kinds[:-1]) == {"delta"}
        assert by_id[gid][-1]["finish_reason"] == "length"
        assert sum(len(f["token_ids"]) for f in by_id[gid][:-1]) == 40 == by_id[gid][-1]["usage"]["completion_tokens"]
    long_done = by_id["long"][-1]
    assert long_done["type"] == "done" and long_done["finish_reason"] == "cancelled"
    assert long_done["usage"]["completion_tokens"] < 200
    # interleaving: the generations really ran at once
    order = [f["id"] for f in frames if f["type"] == "delta"]
    first_done = min(i for i, f in enumerate(order) if f == "a"), max(i for i, f in enumerate(order) if f == "a")
    assert any(g != "a" for g in order[first_done[0]:first_done[1]])
    # same text as the HTTP API at temperature 0
    text = "".join(f["text"] for f in after if f["type"] == "delta")
    assert text == "".join(f["text"] for f in by_id["a"] if f["type"] == "delta")
    stats = server.state.engine.stats()
    assert stats.requests_running == 0


async def test_ws_text_equals_http(server: ServerThread, model_name: str) -> None:
    body = {"model": model_name, "prompt": "the block", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.url}/v1/completions", json=body) as r:
            http_text = (await r.json())["choices"][0]["text"]
        async with s.ws_connect(f"{server.url}/v1/ws") as ws:
            await ws.send_json({"type": "generate", "id": "x", **body})
            frames = await _collect(ws, {"x"})
    assert "".join(f.get("text", "") for f in frames) == http_text


async def test_duplicate_id_unknown_cancel_and_close_aborts(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(f"{server.url}/v1/ws")
        await ws.send_json({"type": "generate", "id": 1, "prompt": "hi", "max_tokens": 200, "ignore_eos": True})
        await ws.send_json({"type": "generate", "id": 1, "prompt": "hi", "max_tokens": 5})
        await ws.send_json({"type": "cancel", "id": "nope"})
        await ws.send_json({"type": "shout", "id": 3})
        errors = []
        while len(errors) < 3:
            f = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
            if f["type"] == "error":
                errors.append(f)
        assert [(e["id"], e["error"]["param"]) for e in errors] == [(1, "id"), ("nope", "id"), (3, "type")]
        await ws.close()        # closing the socket aborts generation 1
    for _ in range(100):
        st = server.state.engine.stats()
        if st.requests_running == 0:
            break
        await asyncio.sleep(0.02)
    assert st.requests_running == st.requests_waiting == 0 and st.kv_blocks_used == st.kv_blocks_pinned


async def test_cancel_right_behind_generate_always_ends_the_generation(server: ServerThread) -> None:
    """80 generate+cancel pairs sent back to back on one socket (more than the 64 live generations a
    socket may hold): each admitted generation ends with exactly one `done` (cancelled); one refused
    for the cap gets its 429 and its cancel a "no running generation"; none keeps running in the
    engine, and the socket takes new work afterwards."""
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{server.url}/v1/ws") as ws:
        for i in range(80):
            await ws.send_json({"type": "generate", "id": i, "prompt": "hi there", "max_tokens": 200,
                                "ignore_eos": True})
            await ws.send_json({"type": "cancel", "id": i})
        frames = await _collect(ws, set(range(80)))
        while True:                         # the cancels of refused ids answer after their 429
            try:
                frames.append(json.loads((await asyncio.wait_for(ws.receive(), 1.0)).data))
            except TimeoutError:
                break
        by_id: dict[int, list[dict]] = {}
        for f in frames:
            by_id.setdefault(f["id"], []).append(f)
        assert sorted(by_id) == list(range(80))
        admitted = 0
        for i, fs in by_id.items():
            kinds = [(f["type"], f.get("error", {}).get("code")) for f in fs if f["type"] != "delta"]
            if kinds == [("done", None)]:
                admitted += 1
                assert fs[-1]["choices"][0]["finish_reason"] == "cancelled", fs[-1]
            else:
                assert kinds == [("error", "too_many_generations"), ("error", None)], (i, fs)
        assert admitted >= 64
        for _ in range(200):
            st = server.state.engine.stats()
            if st.requests_running == st.requests_waiting == 0:
                break
            await asyncio.sleep(0.02)
        assert st.requests_running == st.requests_waiting == 0 and st.kv_blocks_used == st.kv_blocks_pinned
        await ws.send_json({"type": "generate", "id": "after", "prompt": "hi", "max_tokens": 3})
        done = [f for f in await _collect(ws, {"after"}) if f["type"] == "done"]
        assert done and done[0]["usage"]["completion_tokens"] >= 1


async def test_bad_frames_leave_the_socket_and_other_generations_alone(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{server.url}/v1/ws") as ws:
        await ws.send_json({"type": "generate", "id": "ok", "prompt": "hello", "max_tokens": 30, "ignore_eos": True})
        await ws.send_str("[" * 3000 + "]" * 3000)                                  # nesting too deep
        await ws.send_str('{"type": "generate", "id": "s", "prompt": "\\ud800"}')   # a lone surrogate
        await ws.send_str('{"type": "generate", "id": "x", "prompt": "hi", "bogus": 1}')
        frames = await _collect(ws, {"ok", "x"})
    errors = [f for f in frames if f["type"] == "error"]
    assert [(e["id"], e["error"]["param"]) for e in errors] == [(None, None), (None, None)]
    done = {f["id"]: f for f in frames if f["type"] == "done"}
    assert done["ok"]["choices"][0]["finish_reason"] == "length" and "ignored_fields" not in done["ok"]
    assert done["x"]["ignored_fields"] == ["bogus"]         # an unknown field: dropped and named, as on HTTP
