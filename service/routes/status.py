"""GET /health (200 ready, 503 warming / draining / failed), GET /v1/models[/{model}], GET /version,
GET /metrics."""
from __future__ import annotations

from aiohttp import web

from engine.errors import EngineDead
from service import __version__
from service.errors import ApiError
from service.middleware.metrics import METRICS
from service.state import STATE


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.is_ready:
        return web.json_response({"status": "ok", "model": state.model_name})
    if state.draining:
        status = "draining"
    elif state.load_error is not None:
        status = "failed"
    elif state.engine is not None:
        status = "dead"
    else:
        status = "warming"
    body = {"status": status}
    if status == "dead" and state.engine is not None and isinstance(state.engine.dead, EngineDead):
        body["reason"] = state.engine.dead.message      # the engine's own words (a broken KV cache), no internals
    return web.json_response(body, status=503, headers={"Retry-After": "1"})


def _model_card(request: web.Request) -> dict[str, object]:
    state = request.app[STATE]
    engine = state.ready_engine()
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "prefixserve",
            "root": engine.model_name, "max_model_len": engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def get_model(request: web.Request) -> web.Response:
    card = _model_card(request)
    name = request.match_info["model"]
    if name != card["id"]:
        raise ApiError(404, f"The model `{name}` does not exist. This server serves `{card['id']}`.",
                       type="not_found_error", param="model", code="model_not_found")
    return web.json_response(card)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    return request.app[METRICS].render()
