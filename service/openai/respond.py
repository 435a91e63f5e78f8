"""The shared shape of a generation endpoint: prefix, submit, then stream (SSE) or answer once."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from service.middleware.access_log import record_usage
from service.middleware.metrics import METRICS
from service.openai import sse
from service.openai.generation import ChoiceDelta, Generation
from service.openai.params import GenerationRequest
from service.openai.pipeline import Parsed, off_loop, parse_request, tokenize
from service.openai.prefix_hook import on_prefix_use, snapshot
from service.state import STATE

ChunkFn = Callable[[Generation, ChoiceDelta], list[dict[str, Any]]]   # one delta -> SSE chunks
BodyFn = Callable[[Generation, list[ChoiceDelta]], dict[str, Any]]    # all choices -> JSON body
HeadFn = Callable[[Generation], dict[str, Any]]                       # id, object, created, model


async def prepare(app: web.Application, raw: bytes | dict[str, Any], chat: bool) -> tuple[Parsed, list[list[int]]]:
    """Parse and validate (tokenizer thread), resolve the named prefix (here, on the loop), tokenize
    (tokenizer thread): the request and its prompts' token ids."""
    state = app[STATE]
    engine = state.ready_engine()
    executor, served, max_choices = state.tokenizer_executor, state.model_name, state.config.max_choices
    parsed = await off_loop(executor, lambda: parse_request(raw, chat, served, max_choices))
    prefix = snapshot(app, parsed.req.prefix)
    prompts = await off_loop(executor, lambda: tokenize(parsed, engine.tokenizer, prefix, max_choices,
                                                         lambda: engine.core.grammars))
    return parsed, prompts


async def respond(request: web.Request, prompts: list[list[int]], req: GenerationRequest, *,
                  head: HeadFn, chunks: ChunkFn, body: BodyFn, texts: list[str] | None = None) -> web.StreamResponse:
    """`texts`: the prompts as the client wrote them, when it did (echo returns them as written)."""
    state = request.app[STATE]
    engine = state.ready_engine()
    echo = None
    if req.echo:
        echo = texts if texts is not None and req.prefix is None else [engine.tokenizer.decode(p) for p in prompts]
    gen = Generation(engine, prompts, req.params, request.app[METRICS], on_prefix_use(request.app, req.prefix),
                     echo=echo)
    try:
        await gen.start()
        if req.stream:
            usage_chunk = {**head(gen), "choices": []} if req.include_usage else None
            return await sse.stream(request, gen, lambda d: chunks(gen, d), usage_chunk,
                                    state.config.keepalive_interval)
        choices = await gen.collect()
        return web.json_response({**body(gen, choices), "usage": gen.usage.as_dict()})
    finally:
        gen.close()
        record_usage(request, gen.usage)
