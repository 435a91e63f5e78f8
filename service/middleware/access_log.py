"""One access-log line per request, and the request id that ties it to the client.

The id: a client's `X-Request-Id` is kept when it has any of [A-Za-z0-9._:-] (other characters are
dropped, the rest cut to 128), else a fresh uuid4 hex is made. It goes back in `X-Request-Id` on
every response (set when the response is prepared, so SSE streams and WebSocket upgrades carry it
too) and into the log line.

The line (logger `service.access`, level info) is written when the handler ends: for a stream or a
WebSocket that is when it closes, so the duration is the whole exchange. Fields: request_id, remote,
method, route (the route template: bounded), path, status, duration_ms, and prompt_tokens,
completion_tokens, cached_tokens when a generation ran (handlers report them with `record_usage`; a
WebSocket's line sums its generations). A client gone mid-request is status 499. With
`--log-format json` the fields are the JSON object's keys (service/logs.py); as text they are
key=value pairs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from service.usage import Usage

log = logging.getLogger("service.access")

REQUEST_ID_HEADER = "X-Request-Id"
MAX_ID_LEN = 128
_UNSAFE_ID = re.compile(r"[^A-Za-z0-9._:\-]")
_BARE = re.compile(r"[A-Za-z0-9._:/{}\-]+")
CLIENT_CLOSED = 499   # nginx's "client closed request": the handler was cancelled

REQUEST_ID = web.RequestKey("request_id", str)
USAGE = web.RequestKey("usage", Usage)


def request_id(header: str | None) -> str:
    """The client's id, sanitized and bounded, or a new one."""
    clean = _UNSAFE_ID.sub("", header or "")[:MAX_ID_LEN]
    return clean or uuid.uuid4().hex


def record_usage(request: web.Request, usage: Usage) -> None:
    """Called by a handler when a generation ends: its tokens go into the request's log line."""
    total = request.get(USAGE)
    if total is None:
        total = request[USAGE] = Usage()
    total.prompt_tokens += usage.prompt_tokens
    total.completion_tokens += usage.completion_tokens
    total.cached_tokens += usage.cached_tokens


def _text(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v if not isinstance(v, str) or _BARE.fullmatch(v) else json.dumps(v)}"
                    for k, v in fields.items())


def _log_line(request: web.Request, status: int, started: float) -> None:
    resource = request.match_info.route.resource
    fields: dict[str, Any] = {
        "request_id": request[REQUEST_ID], "remote": request.remote or "", "method": request.method,
        "route": resource.canonical if resource is not None else "unmatched",
        "path": request.rel_url.raw_path[:200], "status": status,
        "duration_ms": round((time.perf_counter() - started) * 1000, 2)}
    usage = request.get(USAGE)
    if usage is not None:
        fields.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                      cached_tokens=usage.cached_tokens)
    log.info(_text(fields), extra={"fields": fields})


@web.middleware
async def access_log_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    request[REQUEST_ID] = request_id(request.headers.get(REQUEST_ID_HEADER))
    started = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:     # statuses below 400 travel as exceptions (redirects)
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    finally:
        _log_line(request, status, started)


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare."""
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid


def setup(app: web.Application) -> None:
    app.on_response_prepare.append(add_request_id)
