"""HTTP handlers of the prefix registry: POST/GET /v1/prefixes, GET/DELETE /v1/prefixes/{name}."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.errors import ApiError, invalid
from service.protocol import clean_messages, encode_prompt, read_json, render_messages
from service.registry import NAME_RE, PrefixRegistry
from service.state import STATE


def _registry(request: web.Request) -> PrefixRegistry:
    state = request.app[STATE]
    state.ready_engine()                       # 503 while warming, like every engine-backed endpoint
    registry = state.registry
    if registry is None:
        raise ApiError(503, "the prefix registry is still starting; retry shortly", type="service_unavailable",
                       code="warming", headers={"Retry-After": "1"})
    return registry


def _render(body: dict[str, Any], tokenizer: Any) -> tuple[list[int], dict[str, Any]]:
    """The prefix's tokens and its source: a prompt as completions encode it, or messages through the
    chat template without a generation prompt (a chat request naming the prefix renders after it)."""
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise invalid("give exactly one of prompt or messages", "prompt")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise invalid("prompt must be a non-empty string", "prompt")
        return encode_prompt(tokenizer, prompt), {"prompt": prompt}
    clean = clean_messages(body["messages"])
    return render_messages(clean, tokenizer, add_generation_prompt=False), {"messages": clean}


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise invalid("name must be 1-64 characters of letters, digits, '.', '_' or '-'", "name")
    return name


async def create_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    body = await read_json(request)
    name = _check_name(body.get("name"))
    description = body.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid("description must be a string", "description")
    token_ids, source = _render(body, registry.engine.tokenizer)
    record, created = await registry.register(name, token_ids, source, description)
    entry = registry.local.get(name)
    return web.json_response(registry.describe(entry, record, loaded=entry is not None), status=201 if created else 200)


async def list_prefixes(request: web.Request) -> web.Response:
    registry = _registry(request)
    return web.json_response({"object": "list", "data": await registry.list()})


async def get_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    return web.json_response(await registry.get(request.match_info["name"]))


async def delete_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    name = request.match_info["name"]
    await registry.delete(name)
    return web.json_response({"name": name, "object": "prefix", "deleted": True})


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/prefixes", create_prefix)
    app.router.add_get("/v1/prefixes", list_prefixes)
    app.router.add_get("/v1/prefixes/{name}", get_prefix)
    app.router.add_delete("/v1/prefixes/{name}", delete_prefix)
