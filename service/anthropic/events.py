"""The Messages API's event stream (`event: <type>` + `data: {...}`), in Anthropic's order:

    message_start            the message with empty content and usage (input and cache counts; diagnostics)
    ping                     right after message_start, and while the model is quiet (keep-alive)
    content_block_start      {"type": "text", "text": ""} or {"type": "tool_use", "id", "name", "input": {}}
    content_block_delta      text_delta {"text"} or input_json_delta {"partial_json"}
    content_block_stop
    ... (one start / deltas / stop per block, index 0, 1, ...)
    message_delta            {"stop_reason", "stop_sequence"} and the final usage (cumulative)
    message_stop
    error                    instead of the rest, when the engine fails after the headers went out

message_start waits for the engine's first output (then the cache read is known). Tool calls come from the
chat pipeline's ToolCallStream (service/openai/tools.py): a forced call (tool_choice tool) streams its input
as it is generated; "any" and "auto" answers whose text turns out to be calls send each call whole at the end.
The last usage waits for the breakpoints' leases (the pins of blocks already computed: no generation).

NOTE: the caller closes the generation in its `finally`; a client that goes away or stops reading
(SSEResponse's write timeout) ends this stream, and with it the engine requests.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine.errors import EngineError
from service.anthropic.translate import tool_use_id
from service.errors import anthropic_error_type, to_api_error
from service.openai import pipeline
from service.openai.generation import ChoiceDelta, Generation
from service.openai.pipeline import Prepared
from service.openai.sse import SSE_HEADERS, SSEResponse
from service.openai.tools import ToolCallStream

if TYPE_CHECKING:
    from service.anthropic.messages import MessageShaper

log = logging.getLogger(__name__)


def frame(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **payload}, ensure_ascii=False,
                                                         separators=(",", ":")).encode() + b"\n\n"


class _Blocks:
    """Turns the answer's chat deltas into content block events (one block open at a time)."""

    def __init__(self, shape: MessageShaper) -> None:
        self.shape = shape
        plan = shape.prepared.req.tools
        self.calls = ToolCallStream(plan) if plan is not None else None
        self.index = -1
        self.open: str | None = None        # the open block's type
        self.called = False
        self.text = ""

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return out + frame("content_block_start", {"index": self.index, "content_block": block})

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return frame("content_block_stop", {"index": self.index})

    def _text(self, text: str) -> bytes:
        out = b"" if self.open == "text" else self._start({"type": "text", "text": ""})
        return out + frame("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})

    def feed(self, d: ChoiceDelta) -> bytes:
        self.text += d.text
        last = d.finish_reason is not None
        if self.calls is None:
            return self._text(d.text) if d.text else b""
        out = b""
        for delta in self.calls.feed(d.text, last):
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls", []):
                fn = call["function"]
                if "id" in call:
                    self.called = True
                    out += self._start({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                                        "input": {}})
                if fn.get("arguments"):
                    out += frame("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}})
        return out

    def close(self) -> bytes:
        return self._stop()


async def stream(request: web.Request, gen: Generation, prepared: Prepared, shape: MessageShaper,
                 headers: dict[str, str]) -> web.StreamResponse:
    config = prepared.ready.config
    resp = SSEResponse(request, config.write_timeout, {**SSE_HEADERS, **headers})
    await resp.prepare(request)
    blocks = _Blocks(shape)
    started = False
    last = ChoiceDelta(0, "", [], None)

    async def start() -> None:
        message = {**shape.head(gen), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": shape.usage(gen, final=False)}
        if shape.diagnose:
            message["diagnostics"] = shape.diagnostics(gen)
        await resp.write(frame("message_start", {"message": message}) + frame("ping", {}))

    try:
        async for d in gen.events(config.keepalive_interval):
            if d is None:
                await resp.write(frame("ping", {}))
                continue
            if d.index != 0:
                continue
            if not started:
                started = True
                await start()
            last = ChoiceDelta(0, "", [], d.finish_reason or last.finish_reason,
                               stop_reason=d.stop_reason if d.finish_reason else last.stop_reason)
            events = blocks.feed(d)
            if events:
                await resp.write(events)
        if not started:
            await start()
        await pipeline.leased(prepared)
        reason, sequence = shape.stop(last, blocks.called)
        usage = shape.usage(gen, final=True)
        shape.remember(gen)
        await resp.write(blocks.close() + frame("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}) + frame("message_stop", {}))
    except EngineError as exc:          # the headers went out: the error travels as an event
        err = to_api_error(exc)
        await _error(resp, anthropic_error_type(err.status), err.message)
    except ConnectionError:
        return resp
    except Exception:                   # a fault of ours after the headers: the stream still ends, with an error
        log.exception("a streamed message failed after its headers were sent")
        await _error(resp, "api_error", "internal error while streaming the message")
    try:
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


async def _error(resp: web.StreamResponse, kind: str, message: str) -> None:
    try:
        await resp.write(frame("error", {"error": {"type": kind, "message": message}}))
    except ConnectionError:
        pass
