"""GET /v1/ws: several generations multiplexed on one WebSocket by client-chosen id.

In:  {"type": "generate", "id": ..., "prompt" | "messages": ..., <HTTP sampling fields>}
     {"type": "cancel", "id": ...}
Out: {"type": "delta", "id", "index", "text", "token_ids"[, "logprobs"]}
     {"type": "done", "id", "finish_reason", "choices": [{"index", "finish_reason"}], "usage"
      [, "ignored_fields": [...]]}        (fields of the generate frame this server does not know, dropped)
     {"type": "error", "id", "error": {"message", "type", "param", "code"}}

A `generate` body is validated like HTTP's: as a chat completion when it has `messages`, else as a
completion (service/openai/schema.py), `type` and `id` aside. A delta's `index` is its choice (prompt * n +
sample); its `logprobs`, when asked for, is the list of chat-shaped entries ({"token", "logprob",
"bytes", "top_logprobs"}) for its tokens.

Who owns what: the Session owns one _Generation per live id, registered the moment its `generate`
frame is read, so a `cancel` right behind it always finds it. Each runs as its own task (parse and
tokenize off the loop, admit, stream); every one ends with exactly one `done` or `error` frame, and its
engine requests are aborted in its `finally`. A cancel does not cancel the task: it closes the
generation (its engine requests are aborted at the next step) and the task ends it with a `done` whose
unfinished choices say "cancelled". A bad frame gets an `error` frame; the socket and its other
generations go on. Closing the socket cancels the tasks.

Bounds: one client (its API key, or its address when no keys are configured) holds at most
`max_ws_per_client` sockets (the next upgrade gets 429 `too_many_websockets`, before the handshake); a
socket with no generation running that receives no text frame for `ws_idle_timeout` seconds (pings and
pongs do not count) is closed with code 4408 (ours, after HTTP's 408); a frame the client leaves unread
for `write_timeout` seconds (its receive window full) aborts the connection, and with it every generation on
it. A `generate` frame takes the tokenizer lane of a body of its length, and joins the burst gathering
(AsyncEngine.arriving) as an HTTP request does.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pydantic_core
from aiohttp import WSMsgType, web

from engine.errors import EngineError
from prefix_store.errors import RegistryError
from service.errors import ApiError, invalid, to_api_error
from service.middleware.access_log import record_usage
from service.middleware.auth import WS_PROTOCOL, presented_key
from service.middleware.metrics import METRICS
from service.openai import pipeline
from service.openai.generation import ChoiceDelta, Generation
from service.openai.logprobs import chat_logprobs
from service.openai.sse import dumps, shaped
from service.state import STATE
from service.tenants import caller_of
from service.token_text import TokenText


@dataclass
class _Generation:
    gid: Any
    body: dict[str, Any]
    size: int                   # the frame's length (characters): which tokenizer lane it takes
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
        self.last_active = 0.0                      # loop time of the last frame in, or the last generation's end

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        idle = self.state.config.ws_idle_timeout
        self.last_active = loop.time()
        try:
            while True:
                # NOTE: our own timer, not receive(timeout=...): aiohttp restarts that one on every control frame
                # it answers itself (a PONG to our heartbeat, a client's PING), so a socket that sent nothing but
                # those was never idle (issue 34, item 7). Pings and pongs do not count as activity here.
                deadline = loop.time() + idle if self.live else self.last_active + idle
                try:
                    async with asyncio.timeout_at(deadline):
                        msg = await self.ws.receive()
                except TimeoutError:
                    if self.live or loop.time() - self.last_active < idle:
                        continue
                    await self.ws.close(code=IDLE_CLOSE_CODE, message=f"idle for {idle:g} s".encode())
                    break
                self.last_active = loop.time()
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self.send_error(None, invalid("binary frames are not supported; send JSON text"))
                elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
        except ConnectionError:
            pass            # the peer went away, or stopped reading (send): the finally cancels its generations
        finally:
            tasks = [g.task for g in self.live.values() if g.task is not None]
            for g in list(self.live.values()):
                g.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def send(self, frame: dict[str, Any] | str) -> None:
        """Sends one frame (a dict, or its JSON already serialized); ConnectionResetError when the peer is
        gone or has left it unread for `write_timeout` seconds (then the connection is aborted: nothing more
        can reach that client)."""
        timeout = self.state.config.write_timeout
        try:
            async with asyncio.timeout(timeout):
                await self.ws.send_str(frame if isinstance(frame, str) else dumps(frame))
        except TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()
            raise ConnectionResetError(f"the client left a frame unread for {timeout:g} s") from None

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
            live = _Generation(gid, frame, len(data))
            self.live[key] = live
            live.task = asyncio.create_task(self.generate(key, live))
        else:
            await self.send_error(gid, invalid("type must be 'generate' or 'cancel'", "type"))

    async def generate(self, key: str, live: _Generation) -> None:
        gid = live.gid
        try:
            ready = self.state.ready()
            # as an HTTP body: by its size on the small or the large bodies' tokenizer lane, and gathered with
            # the requests arriving beside it into one step (AsyncEngine.arriving)
            with ready.engine.arriving():
                prepared = await pipeline.prepare(ready, live.body, chat="messages" in live.body,
                                                  caller=caller_of(self.request), size=live.size)
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
                        await self.send(await shaped(len(d.token_ids), _delta_frame, gid, d, tokens, top_k))
                    if d.finish_reason is not None:
                        live.reasons[d.index] = d.finish_reason
            reasons: list[str | None] = [r or "cancelled" for r in live.reasons] if live.cancelled else live.reasons
            await self.send_done(gid, reasons, gen, prepared.parsed.ignored)
        except (ApiError, EngineError, RegistryError) as exc:
            with contextlib.suppress(ConnectionError):
                await self.send_error(gid, exc)
        except ConnectionError:
            pass  # the peer went away mid-send, or stopped reading; the finally aborts
        finally:
            if live.gen is not None:
                live.gen.close()
                record_usage(self.request, live.gen.usage)
            self.live.pop(key, None)
            self.last_active = asyncio.get_running_loop().time()       # idle from the end of its last generation
            if self.draining and not self.live:
                await self.ws.close(code=1001, message=b"server shutting down")

    async def send_done(self, gid: Any, reasons: list[str | None], gen: Generation, ignored: list[str]) -> None:
        if not self.ws.closed:
            frame = {"type": "done", "id": gid, "finish_reason": reasons[0] if reasons else None,
                     "choices": [{"index": i, "finish_reason": r} for i, r in enumerate(reasons)],
                     "usage": gen.usage.as_dict()}
            if ignored:
                frame["ignored_fields"] = ignored
            await self.send(frame)

    async def send_error(self, gid: Any, exc: ApiError | EngineError | RegistryError) -> None:
        err = to_api_error(exc)
        if not self.ws.closed:
            await self.send({"type": "error", "id": gid, "error": err.body()["error"]})

    async def drain(self) -> None:
        """Shutdown: let running generations finish, then close with 1001 (going away)."""
        self.draining = True
        if not self.live:
            await self.ws.close(code=1001, message=b"server shutting down")


SESSIONS: web.AppKey[set[Session]] = web.AppKey("ws_sessions")
CLIENTS: web.AppKey[Counter[str]] = web.AppKey("ws_clients")      # client -> its open sockets (no zero entries)
IDLE_CLOSE_CODE = 4408


def _client(request: web.Request) -> str:
    """Who a socket counts against: its API key (a digest), or its peer address when keys are off."""
    key = presented_key(request)
    return "key:" + hashlib.sha256(key.encode()).hexdigest() if key is not None else f"addr:{request.remote}"


async def handle(request: web.Request) -> web.StreamResponse:
    config = request.app[STATE].config
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=config.max_body_bytes,
                               protocols=(WS_PROTOCOL,))  # offered with a key by browsers (service/middleware/auth.py)
    if not ws.can_prepare(request).ok:
        raise invalid("GET /v1/ws expects a WebSocket upgrade request")
    request.app[STATE].ready_engine()
    clients, client = request.app[CLIENTS], _client(request)
    if clients[client] >= config.max_ws_per_client:
        raise ApiError(429, f"this client already holds {clients[client]} WebSockets, the most one may "
                       f"(--max-ws-per-client {config.max_ws_per_client}); close one, or multiplex generations "
                       "on one socket", type="rate_limit_error", code="too_many_websockets")
    clients[client] += 1
    try:
        await ws.prepare(request)
        session = Session(request, ws)
        request.app[SESSIONS].add(session)
        try:
            await session.run()
        finally:
            request.app[SESSIONS].discard(session)
    finally:
        clients[client] -= 1
        if clients[client] <= 0:
            del clients[client]
    return ws


def _delta_frame(gid: Any, d: ChoiceDelta, tokens: TokenText | None, top_k: int | None) -> str:
    frame: dict[str, Any] = {"type": "delta", "id": gid, "index": d.index, "text": d.text, "token_ids": d.token_ids}
    if tokens is not None and top_k is not None:
        frame["logprobs"] = chat_logprobs(tokens, d.token_ids, d.logprobs or [], top_k)["content"]
    return dumps(frame)


def setup(app: web.Application) -> None:
    app[SESSIONS] = set[Session]()
    app[CLIENTS] = Counter()
    app.router.add_get("/v1/ws", handle)

    async def drain_all(app: web.Application) -> None:
        sessions: set[Session] = app[SESSIONS]
        await asyncio.gather(*(s.drain() for s in list(sessions)), return_exceptions=True)

    app.on_shutdown.append(drain_all)
