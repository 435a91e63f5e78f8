"""The aiohttp application: routes, middlewares, and the engine's lifetime (a cleanup_ctx).

The model loads on a worker thread after the server starts listening, so /health answers 503
(warming) meanwhile. On shutdown (SIGTERM or SIGINT under `web.run_app`), aiohttp stops accepting and runs
on_shutdown: we start draining (new requests get 503), idle WebSockets close, and running requests get
`shutdown_timeout` seconds to finish (`_drain`); then every generation still running is ended by the engine
(`AsyncEngine.abort_all`): its stream ends as any other, with a finish_reason ("abort") and `[DONE]`, a
whole answer with what it had, a WebSocket generation with its `done` frame. aiohttp then gives the handlers
HANDLER_GRACE_S to return and cancels the rest (their `finally` aborts their requests), then the cleanup_ctx
closes the registry (its registrations in flight cancelled, its store closed, within a few seconds) and stops
the engine.

NOTE: the waiting is ours, not aiohttp's `shutdown_timeout`: aiohttp waits that long for a handler, then
cancels only the request's payload and waits as long again before cancelling the handler itself, so a stream
got twice the timeout (~60 s for 30), and was then cut without its end (issue 34, item 11).
"""
from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine.config import EngineConfig
from prefix_store import MemoryPrefixStore, PrefixStore, StoreUnavailable
from prefix_store.registry import CLOSE_TIMEOUT_S, PrefixRegistry
from service import cache_diagnosis
from service.anthropic import messages as anthropic_messages
from service.config import ServiceConfig
from service.errors import error_middleware
from service.middleware import access_log, auth, cross_site, security_headers
from service.middleware.metrics import METRICS, Metrics, metrics_middleware
from service.openai import chat, completions
from service.openai.responses import api as responses
from service.routes import openapi, prefixes, status, tokens, websocket, worker_api
from service.state import STATE, ServiceState

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)
_LOADER = web.AppKey("engine_loader", asyncio.Task)
HANDLER_GRACE_S = 2.0       # after the drain: for handlers to write what ends their answers, then aiohttp cancels


def create_app(config: ServiceConfig) -> web.Application:
    # Outermost first: the access log sees every answer; errors raised by the cross-site and key
    # checks become OpenAI-shaped answers that the metrics count.
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[
        _in_flight_middleware, access_log.access_log_middleware, metrics_middleware, error_middleware,
        cross_site.cross_site_middleware, auth.auth_middleware])
    state = ServiceState(config)
    app[STATE] = state
    app[METRICS] = Metrics(state)
    access_log.setup(app)
    auth.setup(app, config)
    cross_site.setup(app, config)
    security_headers.setup(app)
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_start_draining)
    websocket.setup(app)
    prefixes.setup(app)
    app.router.add_post("/v1/completions", completions.create_completion)
    app.router.add_post("/v1/chat/completions", chat.create_chat_completion)
    responses.setup(app)
    anthropic_messages.setup(app)
    cache_diagnosis.setup(app)
    app.router.add_get("/v1/models", status.list_models)
    app.router.add_get("/v1/models/{model}", status.get_model)
    app.router.add_get("/version", status.version)
    tokens.setup(app)
    worker_api.setup(app)
    app.router.add_get("/health", status.health)
    app.router.add_get("/metrics", status.metrics)
    app.router.add_get("/openapi.json", openapi.handle)
    app.router.add_get("/", _index)
    app.router.add_static("/static", str(resources.files("service") / "static"))
    app.on_shutdown.append(_drain)        # last: after the drain flag is up and idle WebSockets are closed
    return app


def server_options(config: ServiceConfig) -> dict[str, Any]:
    """aiohttp's server options, for `prefixserve serve` (run_app) and `make_runner` alike.

    keepalive_timeout also bounds a connection that never completes its request headers (aiohttp
    starts the timer when the connection opens), so trickled headers cannot hold a connection forever."""
    return {"handler_cancellation": True, "shutdown_timeout": HANDLER_GRACE_S, "access_log": None,
            "keepalive_timeout": config.keepalive_timeout}


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner tests and benchmarks use."""
    return web.AppRunner(app, **server_options(app[STATE].config))


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(str(resources.files("service") / "static" / "index.html"),
                            headers={"Cache-Control": "no-cache"})


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    app[_LOADER] = asyncio.create_task(_load(state), name="engine-load")
    yield
    # Each step is bounded, whatever is in flight: a load still running unwinds what it built, the
    # registry cancels its registrations and closes the store within CLOSE_TIMEOUT_S, then the engine stops.
    app[_LOADER].cancel()
    await asyncio.wait([app[_LOADER]], timeout=CLOSE_TIMEOUT_S)
    if state.registry is not None:
        await state.registry.close()
    if state.engine is not None:
        await state.engine.shutdown()
    state.tokenizers.shutdown()
    gc.unfreeze()       # what _load froze is collectable again (native objects are freed at exit, not reported)


async def _load(state: ServiceState) -> None:
    config = state.config.engine
    try:
        engine = await asyncio.get_running_loop().run_in_executor(None, _build_engine, config)
        await engine.start()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("loading the model failed")
        state.load_error = f"{type(exc).__name__}: {exc}"
        return
    # Warm every registered prefix before /health says ready (the registry pins through the engine).
    address = f"{state.config.host}:{state.config.port}"
    try:
        registry = PrefixRegistry(await _open_store(state.config), engine, address=address,
                                  max_prefixes=state.config.max_prefixes,
                                  max_prefixes_per_tenant=state.config.max_prefixes_per_tenant)
        try:
            await registry.start()
            await registry.ready.wait()
        except BaseException:       # shut down while warming: the registry's tasks end with it
            await registry.close()
            raise
    except BaseException:
        await engine.shutdown()
        raise
    state.registry = registry
    state.engine = engine
    # NOTE: what loading left (torch, transformers, the model: ~400,000 objects) is moved out of the cyclic
    # garbage collector's sight, as vLLM does: else each full collection walks it all, holding the GIL, and a
    # request that allocates much (an echo with prompt logprobs) stalled every thread, the event loop's
    # included, for 0.3-0.5 s here (tests/service/test_reliability.py).
    gc.collect()
    gc.freeze()
    log.info("ready: %s (max_model_len %d, %d prefixes pinned)", state.model_name, engine.max_model_len,
             len(registry.local))


async def _open_store(config: ServiceConfig) -> PrefixStore:
    """Redis when a URL is given (even if it is down now: the store reconnects), else the embedded one."""
    if config.redis_url is None:
        return MemoryPrefixStore()
    from prefix_store.redis import RedisPrefixStore, connect
    try:
        return await connect(config.redis_url)
    except StoreUnavailable as exc:
        log.warning("Redis is unavailable at start (%s); serving without it until it comes back", exc)
        from redis.asyncio import Redis
        client = Redis.from_url(config.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                health_check_interval=10)
        return RedisPrefixStore(client)


def _build_engine(config: EngineConfig) -> AsyncEngine:
    from engine.async_engine import AsyncEngine  # the model loads here, off the event loop
    return AsyncEngine(config)


async def _start_draining(app: web.Application) -> None:
    app[STATE].draining = True


@web.middleware
async def _in_flight_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Counts the handlers running (a stream or a WebSocket until it ends), for the drain."""
    state = request.app[STATE]
    state.in_flight += 1
    try:
        return await handler(request)
    finally:
        state.in_flight -= 1


async def _drain(app: web.Application) -> None:
    """Shutdown: running requests get `shutdown_timeout` s to finish; then the engine ends every generation still
    running (its stream ends with a finish_reason and [DONE]) and the handlers get HANDLER_GRACE_S to say so."""
    state = app[STATE]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.shutdown_timeout
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.engine is None or not state.in_flight:
        return
    ended = state.engine.abort_all()
    log.info("shutdown: %d requests still running after %g s were ended", ended, state.config.shutdown_timeout)
    deadline = loop.time() + HANDLER_GRACE_S
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
