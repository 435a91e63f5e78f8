"""GET /v1/ws: several generations multiplexed on one WebSocket by client-chosen id.

In:  {"type": "generate", "id": ..., "prompt" | "messages": ..., <HTTP sampling fields>}
     {"type": "cancel", "id": ...}
Out: {"type": "delta", "id", "index", "text", "token_ids"[, "logprobs"]}
     {"type": "done", "id", "finish_reason", "choices": [{"index", "finish_reason"}], "usage"}
     {"type": "error", "id", "error": {"message", "type", "param", "code"}}

Sampling fields are those of HTTP: `n`, `best_of`, `use_beam_search`, `length_penalty`,
`early_stopping`, and `logprobs` (an int with `prompt`; a bool plus `top_logprobs` with `messages`).
A delta's `index` is its choice (prompt * n + sample); its `logprobs`, when asked for, is the list of
chat-shaped entries ({"token", "logprob", "bytes", "top_logprobs"}) for its tokens.

Each generation is its own task; an error ends that generation only. A cancel or the socket closing
cancels the task, whose `finally` aborts its engine requests. A cancelled generation ends with a
`done` whose finish_reason is "cancelled".
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import WSMsgType, web

from engine.errors import EngineError
from service.errors import ApiError, from_engine, invalid
from service.generation import Generation
from service.logprobs import chat_logprobs
from service.metrics import METRICS
from service.prefix_hook import on_prefix_use, with_prefix
from service.protocol import check_choices, check_model, parse_json, parse_messages, parse_prompts, parse_request
from service.state import STATE


class Session:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.state = request.app[STATE]
        self.tasks: dict[str, asyncio.Task[None]] = {}     # json-encoded id -> its generation
        self.cancelled: set[str] = set()
        self.draining = False

    async def run(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self.send_error(None, invalid("binary frames are not supported; send JSON text"))
        finally:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def on_text(self, data: str) -> None:
        try:
            body = parse_json(data)
        except ApiError as exc:
            await self.send_error(None, exc)
            return
        gid = body.get("id")
        kind = body.get("type")
        if not isinstance(gid, (str, int)) or isinstance(gid, bool):
            await self.send_error(gid, invalid("id must be a string or an integer", "id"))
            return
        key = json.dumps(gid)
        if kind == "cancel":
            task = self.tasks.get(key)
            if task is None:
                await self.send_error(gid, invalid(f"no running generation has id {gid!r}", "id"))
                return
            self.cancelled.add(key)
            task.cancel()
        elif kind == "generate":
            try:
                gen = await self.prepare(gid, key, body)
            except (ApiError, EngineError) as exc:
                await self.send_error(gid, exc)
                return
            self.tasks[key] = asyncio.create_task(self.generate(gid, key, *gen))
        else:
            await self.send_error(gid, invalid("type must be 'generate' or 'cancel'", "type"))

    async def prepare(self, gid: Any, key: str, body: dict[str, Any]) -> tuple[Generation, int | None]:
        """The started generation and the top-k of logprobs asked for (None: none)."""
        engine = self.state.ready_engine()
        if key in self.tasks:
            raise invalid(f"a generation with id {gid!r} is already running on this socket", "id")
        if len(self.tasks) >= self.state.config.max_ws_generations:
            raise ApiError(429, f"at most {self.state.config.max_ws_generations} generations may run on one "
                           "socket", type="rate_limit_error", code="too_many_generations")
        check_model(body, self.state.model_name)
        chat = "messages" in body
        req = parse_request(body, chat=chat, max_choices=self.state.config.max_choices)
        tokenizer = engine.tokenizer
        prompts = [parse_messages(body["messages"], tokenizer)] if chat else parse_prompts(body, tokenizer)
        check_choices(len(prompts), req.params, self.state.config.max_choices)
        prompts = with_prefix(self.request.app, req.prefix, prompts)
        gen = Generation(engine, prompts, req.params, self.request.app[METRICS],
                         on_prefix_use(self.request.app, req.prefix))
        await gen.start()
        return gen, req.params.logprobs

    async def generate(self, gid: Any, key: str, gen: Generation, top_k: int | None) -> None:
        reasons: list[str | None] = [None] * gen.num_choices
        tokens = self.state.token_text() if top_k is not None else None
        try:
            async for d in gen.events():
                assert d is not None
                if d.text or d.token_ids:
                    frame = {"type": "delta", "id": gid, "index": d.index, "text": d.text, "token_ids": d.token_ids}
                    if tokens is not None and top_k is not None:
                        frame["logprobs"] = chat_logprobs(tokens, d.token_ids, d.logprobs or [], top_k)["content"]
                    await self.ws.send_json(frame)
                if d.finish_reason is not None:
                    reasons[d.index] = d.finish_reason
            await self.send_done(gid, reasons, gen)
        except asyncio.CancelledError:
            if key not in self.cancelled:
                raise  # the socket is closing
            await self.send_done(gid, [r or "cancelled" for r in reasons], gen)
        except EngineError as exc:
            await self.send_error(gid, exc)
        except ConnectionError:
            pass  # the peer went away mid-send; the finally aborts
        finally:
            gen.close()
            self.tasks.pop(key, None)
            self.cancelled.discard(key)
            if self.draining and not self.tasks:
                await self.ws.close(code=1001, message=b"server shutting down")

    async def send_done(self, gid: Any, reasons: list[str | None], gen: Generation) -> None:
        await self.ws.send_json({"type": "done", "id": gid, "finish_reason": reasons[0],
                                 "choices": [{"index": i, "finish_reason": r} for i, r in enumerate(reasons)],
                                 "usage": gen.usage.as_dict()})

    async def send_error(self, gid: Any, exc: ApiError | EngineError) -> None:
        err = exc if isinstance(exc, ApiError) else from_engine(exc)
        if not self.ws.closed:
            await self.ws.send_json({"type": "error", "id": gid, "error": err.body()["error"]})

    async def drain(self) -> None:
        """Shutdown: let running generations finish, then close with 1001 (going away)."""
        self.draining = True
        if not self.tasks:
            await self.ws.close(code=1001, message=b"server shutting down")


SESSIONS: web.AppKey[set[Session]] = web.AppKey("ws_sessions")


async def handle(request: web.Request) -> web.StreamResponse:
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=request.app[STATE].config.max_body_bytes)
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


def setup(app: web.Application) -> None:
    app[SESSIONS] = set[Session]()
    app.router.add_get("/v1/ws", handle)

    async def drain_all(app: web.Application) -> None:
        sessions: set[Session] = app[SESSIONS]
        await asyncio.gather(*(s.drain() for s in list(sessions)), return_exceptions=True)

    app.on_shutdown.append(drain_all)
