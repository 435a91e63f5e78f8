"""Server-sent events: one streamed answer per generation, in its surface's frames (`Frames`: chat's and
completions' `data: {json}\\n\\n` chunks and `data: [DONE]\\n\\n` last, or the Responses API's typed events),
`: keep-alive` comments while a stream is idle, and headers that keep proxies from buffering.

`stream` is the one writer of every surface's streams: after the headers, whatever happens (the engine's
error, a fault of ours, a client gone or not reading), the stream ends with the surface's own error frame
or not at all, never with an exception out of the handler.

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
from typing import Any, Protocol, TypeVar

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
T = TypeVar("T")


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
    return b"data: " + dumps(payload, compact=True).encode() + b"\n\n"


def dumps(obj: Any, compact: bool = False) -> str:
    """json.dumps (compact: no spaces, UTF-8 as is), but in pieces: a container holding containers, and a long
    list, is written one element at a time. json's C encoder holds the GIL for a whole call: one call over an
    echoed prompt's log-probabilities (~7 MB) kept the event loop from running for 0.2 s even on another thread."""
    kw: dict[str, Any] = {"ensure_ascii": False, "separators": (",", ":")} if compact else {}
    if _small(obj, _SMALL_NODES) >= 0:       # a streamed token's chunk: one call (~5 us, not ~24 in pieces)
        return json.dumps(obj, **kw)
    out: list[str] = []
    _pieces(obj, out, kw, *((",", ":") if compact else (", ", ": ")))
    return "".join(out)


_FLAT_LIST = 512     # elements of a list of scalars encoded in one call
_SMALL_NODES = 64    # containers' elements in all, below which a payload is encoded in one call


def _small(obj: Any, budget: int) -> int:
    """budget less obj's containers' elements (counted through nested dicts and lists), or -1 once it runs out."""
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, list):
        items = obj
    else:
        return budget
    budget -= len(items)
    for v in items:
        if budget < 0:
            return -1
        if isinstance(v, (dict, list)):
            budget = _small(v, budget)
    return budget


def _pieces(obj: Any, out: list[str], kw: dict[str, Any], item_sep: str, key_sep: str) -> None:
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and \
            any(isinstance(v, (dict, list)) for v in obj.values()):
        out.append("{")
        for i, (k, v) in enumerate(obj.items()):
            out.append((item_sep if i else "") + json.dumps(k, **kw) + key_sep)
            _pieces(v, out, kw, item_sep, key_sep)
        out.append("}")
    elif isinstance(obj, list) and (len(obj) > _FLAT_LIST or any(isinstance(v, (dict, list)) for v in obj)):
        out.append("[")
        for i, v in enumerate(obj):
            if i:
                out.append(item_sep)
            _pieces(v, out, kw, item_sep, key_sep)
        out.append("]")
    else:
        out.append(json.dumps(obj, **kw))


# A delta of more tokens than this (an echoed prompt, with its log-probabilities: up to --max-echo-logprobs
# entries, ~0.5 s of Python to shape and serialize) is shaped on a worker thread, not on the event loop.
LARGE_DELTA_TOKENS = 256


async def shaped(num_tokens: int, shape: Callable[..., T], *args: Any) -> T:
    """`shape(*args)` on the loop when it is small, else on a worker thread (the loop keeps serving meanwhile).
    NOTE: the shaping objects (a Shaper, TokenText) are then touched by that thread while the caller awaits it,
    never by two threads at once; TokenText's tokenizer only decodes there (engine/async_engine.py's rule)."""
    if num_tokens <= LARGE_DELTA_TOKENS:
        return shape(*args)
    return await asyncio.to_thread(shape, *args)


class Frames(Protocol):
    """A surface's streamed answer, as bytes for `stream` to write (each its own SSE events)."""

    def opening(self) -> bytes: ...                 # right after the headers (may be b"")

    def delta(self, d: ChoiceDelta) -> bytes: ...   # one delta of the generation

    def keepalive(self) -> bytes: ...               # while the model is quiet (an SSE comment, or an event)

    async def closing(self) -> bytes: ...           # after the last delta

    def failed(self, error: ApiError) -> bytes: ... # instead of closing(): a failure after the headers


class DataFrames:
    """OpenAI's chat and completions stream: `data: {chunk}` per chunk, then (stream_options.include_usage) a
    chunk with the usage, then `data: [DONE]`; an error is one more `data:` event, then [DONE]."""

    def __init__(self, gen: Generation, chunks: Callable[[ChoiceDelta], list[dict[str, Any]]],
                 usage_chunk: dict[str, Any] | None) -> None:
        self.gen, self.chunks, self.usage_chunk = gen, chunks, usage_chunk

    def opening(self) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def delta(self, d: ChoiceDelta) -> bytes:
        return b"".join(event(c) for c in self.chunks(d))

    async def closing(self) -> bytes:
        if self.usage_chunk is None:
            return DONE
        return event({**self.usage_chunk, "usage": self.gen.usage.as_dict()}) + DONE

    def failed(self, error: ApiError) -> bytes:
        return event(error.body()) + DONE


async def stream(request: web.Request, gen: Generation, frames: Frames, keepalive: float, write_timeout: float,
                 headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Writes the generation as SSE in `frames`.

    NOTE: the caller closes `gen` in its `finally`; a client that goes away makes a write fail or
    (handler_cancellation) cancels this task, and one that stops reading makes a write time out
    (SSEResponse); either way its engine requests are aborted. The last write (the closing or the error
    frame, and the EOF) is guarded like every other: a client gone by then just misses it.
    """
    resp = SSEResponse(request, write_timeout, {**SSE_HEADERS, **(headers or {})})
    await resp.prepare(request)
    try:
        opening = frames.opening()
        if opening:
            await resp.write(opening)
        async for delta in gen.events(keepalive):
            if delta is None:
                await resp.write(frames.keepalive())
                continue
            await resp.write(await shaped(len(delta.token_ids), frames.delta, delta))
        tail = await frames.closing()
    except EngineError as exc:  # headers are sent: the error travels as one more event
        tail = frames.failed(to_api_error(exc))
    except ConnectionError:     # the client went away between two events
        return resp
    except Exception:           # a fault of ours after the headers: the stream still ends, with an error event
        log.exception("a streamed answer failed after its headers were sent")
        tail = frames.failed(ApiError(500, "internal error while streaming the answer", type="internal_error",
                                      code="internal_error"))
    try:
        await resp.write(tail)
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp
