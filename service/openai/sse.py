"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last, `: keep-alive` comments
while a stream is idle, and headers that keep proxies from buffering."""
from __future__ import annotations

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


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def stream(request: web.Request, gen: Generation, chunks: Callable[[ChoiceDelta], list[dict[str, Any]]],
                 usage_chunk: dict[str, Any] | None, keepalive: float,
                 headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Writes the generation as SSE. `usage_chunk` (usage filled in at the end) goes before [DONE].

    NOTE: the caller closes `gen` in its `finally`; a client that goes away makes a write fail or
    (handler_cancellation) cancels this task, and either way its engine requests are aborted.
    """
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
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
            await resp.write(event(usage_chunk))
    await resp.write(DONE)
    await resp.write_eof()
    return resp
