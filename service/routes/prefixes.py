"""HTTP handlers of the prefix registry: POST/GET /v1/prefixes, GET/DELETE /v1/prefixes/{name}."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from prefix_store.registry import PrefixRegistry
from service.errors import ApiError, invalid
from service.middleware.auth import is_admin
from service.openai.pipeline import off_loop, read_body
from service.openai.render import encode_prompt, render_messages, template_messages
from service.openai.schema import PrefixRequest, parse_model
from service.state import STATE


def _registry(request: web.Request) -> PrefixRegistry:
    state = request.app[STATE]
    state.ready_engine()                       # 503 while warming, like every engine-backed endpoint
    registry = state.registry
    if registry is None:
        raise ApiError(503, "the prefix registry is still starting; retry shortly", type="service_unavailable",
                       code="warming", headers={"Retry-After": "1"})
    return registry


def _render(raw: bytes, tokenizer: Any) -> tuple[PrefixRequest, list[int], dict[str, Any]]:
    """The request, the prefix's tokens and its source: a prompt as completions encode it, or messages
    through the chat template without a generation prompt (a chat request naming the prefix renders
    after it)."""
    body = parse_model(PrefixRequest, raw, strict_fields=True)   # our own API: a misspelt field is an error
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of prompt or messages", "prompt")
    if body.prompt is not None:
        return body, encode_prompt(tokenizer, body.prompt), {"prompt": body.prompt}
    assert body.messages is not None
    clean = template_messages(body.messages)
    tokens = render_messages(clean, tokenizer, add_generation_prompt=False)
    # A chat request naming the prefix renders its messages + the request's at once; pinning helps only
    # if that rendering starts with these tokens (templates may render a message differently when
    # another follows). Checked on a probe conversation.
    probe = render_messages(clean + [{"role": "user", "content": "Hello?"}], tokenizer, add_generation_prompt=True)
    if probe[:len(tokens)] != tokens:
        raise invalid("this model's chat template renders these messages differently when a conversation follows "
                      "them, so no chat request would reuse the pinned tokens; register the rendered text as a "
                      "prompt instead, or change the messages", "messages")
    return body, tokens, {"messages": clean}


async def create_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    state = request.app[STATE]
    tokenizer = state.ready_engine().tokenizer
    raw = await read_body(request, state.config.body_timeout)
    body, token_ids, source = await off_loop(state.tokenizer_executor, lambda: _render(raw, tokenizer))
    record, created = await registry.register(body.name, token_ids, source, body.description)
    entry = registry.local.get(body.name)
    return web.json_response(registry.describe(entry, record, loaded=entry is not None), status=201 if created else 200)


def _visible(request: web.Request, entry: dict[str, Any]) -> dict[str, Any]:
    """A prefix as this caller may see it: its source text (a system prompt) only for admins; nor, for the
    others, its block hashes and the model fingerprint that seeds them (with both, a guessed block of tokens
    could be checked offline)."""
    return entry if is_admin(request) else {**entry, "source": None, "block_hashes": None, "fingerprint": None}


async def list_prefixes(request: web.Request) -> web.Response:
    registry = _registry(request)
    return web.json_response({"object": "list", "data": [_visible(request, e) for e in await registry.list()]})


async def get_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    return web.json_response(_visible(request, await registry.get(request.match_info["name"])))


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
