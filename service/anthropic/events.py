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

NOTE: these are sse.Frames: sse.stream writes them (and the pipeline closes the generation), so a client that
goes away or stops reading ends this stream, and with it the engine requests, as on every other surface.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from service.anthropic.translate import tool_use_id
from service.errors import ApiError, anthropic_error_type
from service.openai import pipeline
from service.openai.generation import ChoiceDelta, Generation
from service.openai.tools import ToolCallStream

if TYPE_CHECKING:
    from service.anthropic.messages import MessageShaper


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


class MessageFrames:
    """The Messages API's stream as sse.Frames (sse.stream writes them behind its disconnect guard)."""

    def __init__(self, shape: MessageShaper, gen: Generation) -> None:
        self.shape, self.gen = shape, gen
        self.blocks = _Blocks(shape)
        self.started = False
        self.last = ChoiceDelta(0, "", [], None)

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        shape, gen = self.shape, self.gen
        message = {**shape.head(gen), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": shape.usage(gen, final=False)}
        if shape.diagnose:
            message["diagnostics"] = shape.diagnostics(gen)
        return frame("message_start", {"message": message}) + frame("ping", {})

    def opening(self) -> bytes:
        return b""                      # message_start waits for the first output: the cache read is known then

    def keepalive(self) -> bytes:
        return frame("ping", {})

    def delta(self, d: ChoiceDelta) -> bytes:
        if d.index != 0:
            return b""
        last = self.last
        self.last = ChoiceDelta(0, "", [], d.finish_reason or last.finish_reason,
                                stop_reason=d.stop_reason if d.finish_reason else last.stop_reason)
        return self._start() + self.blocks.feed(d)

    async def closing(self) -> bytes:
        head = self._start()
        await pipeline.leased(self.shape.prepared)
        reason, sequence = self.shape.stop(self.last, self.blocks.called)
        usage = self.shape.usage(self.gen, final=True)
        self.shape.remember(self.gen)
        return head + self.blocks.close() + frame("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}) + frame("message_stop", {})

    def failed(self, error: ApiError) -> bytes:
        return frame("error", {"error": {"type": anthropic_error_type(error.status), "message": error.message}})
