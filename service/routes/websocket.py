"""GET /v1/ws: several generations multiplexed on one WebSocket by client-chosen id.

In:  {"type": "generate", "id": ..., "prompt" | "messages": ..., <HTTP sampling fields>}
     {"type": "cancel", "id": ...}
Out: {"type": "delta", "id", "index", "text", "token_ids"[, "logprobs"]}
     {"type": "done", "id", "finish_reason", "choices": [{"index", "finish_reason"}], "usage"
      [, "ignored_fields": [...]]}        (fields of the generate frame this server does not know, dropped)
     {"type": "error", "id", "error": {"message", "type", "param", "code"}}

A `generate` body is validated like HTTP's: as a chat completion when it has `messages`, else as a
completion (service/schema.py), `type` and `id` aside. A delta's `index` is its choice (prompt * n +
sample); its `logprobs`, when asked for, is the list of chat-shaped entries ({"token", "logprob",
"bytes", "top_logprobs"}) for its tokens.

Who owns what: the Session owns one _Generation per live id, registered the moment its `generate`
frame is read, so a `cancel` right behind it always finds it. Each runs as its own task (parse and
tokenize off the loop, admit, stream); every one ends with exactly one `done` or `error` frame, and its
engine requests are aborted in its `finally`. A cancel does not cancel the task: it closes the
generation (its engine requests are aborted at the next step) and the task ends it with a `done` whose
unfinished choices say "cancelled". A bad frame gets an `error` frame; the socket and its other
generations go on. Closing the socket cancels the tasks.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pydantic_core
from aiohttp import WSMsgType, web

from engine.errors import EngineError
from prefix_store.errors import RegistryError
from service.errors import ApiError, invalid, to_api_error
from service.middleware.access_log import record_usage
from service.middleware.auth import WS_PROTOCOL, is_admin
from service.middleware.metrics import METRICS
from service.openai import pipeline
from service.openai.generation import ChoiceDelta, Generation
from service.openai.logprobs import TokenText, chat_logprobs
from service.openai.sse import dumps, shaped
from service.state import STATE


@dataclass
class _Generation:
    gid: Any
    body: dict[str, Any]
    task: asyncio.Task[None] | None = None
    gen: Generation | None = None
    cancelled: bool = False
    reasons: list[str | None] = field(default_factory=list)

    def cancel(self) -> None:
        self.cancelled = True
        if self.gen is not None:
            self.gen.close()


class Session:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.state = request.app[STATE]
        self.live: dict[str, _Generation] = {}     # json-encoded id -> its generation
        self.draining = False

    async def run(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self.send_error(None, invalid("binary frames are not supported; send JSON text"))
        finally:
            tasks = [g.task for g in self.live.values() if g.task is not None]
            for g in list(self.live.values()):
                g.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def on_text(self, data: str) -> None:
        try:
            frame = pydantic_core.from_json(data)
        except ValueError as exc:         # bad JSON, a lone surrogate, nesting too deep
            await self.send_error(None, invalid(f"the frame is not valid JSON: {exc}"))
            return
        if not isinstance(frame, dict):
            await self.send_error(None, invalid("a frame must be a JSON object"))
            return
        gid = frame.pop("id", None)
        kind = frame.pop("type", None)
        if not isinstance(gid, (str, int)) or isinstance(gid, bool):
            await self.send_error(gid, invalid("id must be a string or an integer", "id"))
            return
        key = json.dumps(gid)
        if kind == "cancel":
            live = self.live.get(key)
            if live is None:
                await self.send_error(gid, invalid(f"no running generation has id {gid!r}", "id"))
                return
            live.cancel()
        elif kind == "generate":
            if key in self.live:
                await self.send_error(gid, invalid(f"a generation with id {gid!r} is already running on this "
                                                   "socket", "id"))
                return
            if len(self.live) >= self.state.config.max_ws_generations:
                await self.send_error(gid, ApiError(
                    429, f"at most {self.state.config.max_ws_generations} generations may run on one socket",
                    type="rate_limit_error", code="too_many_generations"))
                return
            live = _Generation(gid, frame)
            self.live[key] = live
            live.task = asyncio.create_task(self.generate(key, live))
        else:
            await self.send_error(gid, invalid("type must be 'generate' or 'cancel'", "type"))

    async def generate(self, key: str, live: _Generation) -> None:
        gid = live.gid
        try:
            ready = self.state.ready()
            prepared = await pipeline.prepare(ready, live.body, chat="messages" in live.body,
                                            may_read_prefix=is_admin(self.request))
            pipeline.ignored_fields(prepared.parsed.ignored)        # the log line (the done frame names them)
            gen = pipeline.generation(prepared, self.request.app[METRICS])
            live.gen, live.reasons = gen, [None] * gen.num_choices
            if not live.cancelled:
                await gen.start()
            top_k = prepared.req.params.logprobs
            tokens = ready.token_text if top_k is not None else None
            if not live.cancelled:
                async for d in gen.events():
                    assert d is not None
                    if live.cancelled:
                        break
                    if d.text or d.token_ids:
                        await self.ws.send_str(await shaped(len(d.token_ids), _delta_frame, gid, d, tokens, top_k))
                    if d.finish_reason is not None:
                        live.reasons[d.index] = d.finish_reason
            reasons: list[str | None] = [r or "cancelled" for r in live.reasons] if live.cancelled else live.reasons
            await self.send_done(gid, reasons, gen, prepared.parsed.ignored)
        except (ApiError, EngineError, RegistryError) as exc:
            await self.send_error(gid, exc)
        except ConnectionError:
            pass  # the peer went away mid-send; the finally aborts
        finally:
            if live.gen is not None:
                live.gen.close()
                record_usage(self.request, live.gen.usage)
            self.live.pop(key, None)
            if self.draining and not self.live:
                await self.ws.close(code=1001, message=b"server shutting down")

    async def send_done(self, gid: Any, reasons: list[str | None], gen: Generation, ignored: list[str]) -> None:
        if not self.ws.closed:
            frame = {"type": "done", "id": gid, "finish_reason": reasons[0] if reasons else None,
                     "choices": [{"index": i, "finish_reason": r} for i, r in enumerate(reasons)],
                     "usage": gen.usage.as_dict()}
            if ignored:
                frame["ignored_fields"] = ignored
            await self.ws.send_json(frame)

    async def send_error(self, gid: Any, exc: ApiError | EngineError | RegistryError) -> None:
        err = to_api_error(exc)
        if not self.ws.closed:
            await self.ws.send_json({"type": "error", "id": gid, "error": err.body()["error"]})

    async def drain(self) -> None:
        """Shutdown: let running generations finish, then close with 1001 (going away)."""
        self.draining = True
        if not self.live:
            await self.ws.close(code=1001, message=b"server shutting down")


SESSIONS: web.AppKey[set[Session]] = web.AppKey("ws_sessions")


async def handle(request: web.Request) -> web.StreamResponse:
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=request.app[STATE].config.max_body_bytes,
                               protocols=(WS_PROTOCOL,))  # offered with a key by browsers (service/auth.py)
    if not ws.can_prepare(request).ok:
        raise invalid("GET /v1/ws expects a WebSocket upgrade request")
    request.app[STATE].ready_engine()
    await ws.prepare(request)
    session = Session(request, ws)
    request.app[SESSIONS].add(session)
    try:
        await session.run()
    finally:
        request.app[SESSIONS].discard(session)
    return ws


def _delta_frame(gid: Any, d: ChoiceDelta, tokens: TokenText | None, top_k: int | None) -> str:
    frame: dict[str, Any] = {"type": "delta", "id": gid, "index": d.index, "text": d.text, "token_ids": d.token_ids}
    if tokens is not None and top_k is not None:
        frame["logprobs"] = chat_logprobs(tokens, d.token_ids, d.logprobs or [], top_k)["content"]
    return dumps(frame)


def setup(app: web.Application) -> None:
    app[SESSIONS] = set[Session]()
    app.router.add_get("/v1/ws", handle)

    async def drain_all(app: web.Application) -> None:
        sessions: set[Session] = app[SESSIONS]
        await asyncio.gather(*(s.drain() for s in list(sessions)), return_exceptions=True)

    app.on_shutdown.append(drain_all)
