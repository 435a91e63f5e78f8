"""GET /health (200 ready, 503 warming / draining / failed), GET /v1/models, GET /metrics."""
from __future__ import annotations

from aiohttp import web

from service.metrics import METRICS
from service.state import STATE


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready:
        return web.json_response({"status": "ok", "model": state.model_name})
    if state.draining:
        status = "draining"
    elif state.load_error is not None:
        status = "failed"
    elif state.engine is not None:
        status = "dead"
    else:
        status = "warming"
    return web.json_response({"status": status}, status=503, headers={"Retry-After": "1"})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "prefixserve",
        "root": engine.model_name, "max_model_len": engine.max_model_len}]})


async def metrics(request: web.Request) -> web.Response:
    return request.app[METRICS].render()
