"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last, `: keep-alive` comments
while a stream is idle, and headers that keep proxies from buffering.

A client that stops reading fills its receive window, then the kernel's and aiohttp's send buffers, and
from then on a write waits for room. `SSEResponse` gives each write `write_timeout` seconds: then the
connection is aborted and the write raises ClientStalled (a ConnectionError), so the handler ends like
for a client that went away: its generation is aborted, its KV blocks freed, its buffered output dropped.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine.errors import EngineError
from service.errors import ApiError, to_api_error
from service.openai.generation import ChoiceDelta, Generation

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
KEEPALIVE = b": keep-alive\n\n"
log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


class ClientStalled(ConnectionResetError):
    """The client left a write unread for write_timeout seconds; the connection was aborted."""


class SSEResponse(web.StreamResponse):
    """A streamed answer whose every write (and the final flush) must find room within `write_timeout`."""

    def __init__(self, request: web.Request, write_timeout: float, headers: dict[str, str]) -> None:
        super().__init__(status=200, headers=headers)
        self._request = request
        self._write_timeout = write_timeout

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            async with asyncio.timeout(self._write_timeout):
                await super().write(data)
        except TimeoutError:
            self._stalled()

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            async with asyncio.timeout(self._write_timeout):
                await super().write_eof(data)
        except TimeoutError:
            self._stalled()

    def _stalled(self) -> None:
        if self._request.transport is not None:
            self._request.transport.abort()
        raise ClientStalled(f"the client left the stream unread for {self._write_timeout:g} s") from None


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def stream(request: web.Request, gen: Generation, chunks: Callable[[ChoiceDelta], list[dict[str, Any]]],
                 usage_chunk: dict[str, Any] | None, keepalive: float, write_timeout: float,
                 headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Writes the generation as SSE. `usage_chunk` (usage filled in at the end) goes before [DONE].

    NOTE: the caller closes `gen` in its `finally`; a client that goes away makes a write fail or
    (handler_cancellation) cancels this task, and one that stops reading makes a write time out
    (SSEResponse); either way its engine requests are aborted.
    """
    resp = SSEResponse(request, write_timeout, {**SSE_HEADERS, **(headers or {})})
    await resp.prepare(request)
    try:
        async for delta in gen.events(keepalive):
            if delta is None:
                await resp.write(KEEPALIVE)
                continue
            await resp.write(b"".join(event(c) for c in chunks(delta)))
    except EngineError as exc:  # headers are sent: the error travels as one more event
        await resp.write(event(to_api_error(exc).body()))
    except ConnectionError:     # the client went away between two events
        return resp
    except Exception:           # a fault of ours after the headers: the stream still ends, with an error event
        log.exception("a streamed answer failed after its headers were sent")
        try:
            await resp.write(event(ApiError(500, "internal error while streaming the answer", type="internal_error",
                                            code="internal_error").body()))
        except ConnectionError:
            return resp
    else:
        if usage_chunk is not None:
            usage_chunk["usage"] = gen.usage.as_dict()
            try:
                await resp.write(event(usage_chunk))
            except ConnectionError:
                return resp
    try:
        await resp.write(DONE)
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp
