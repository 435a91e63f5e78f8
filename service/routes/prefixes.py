"""HTTP handlers of the prefix registry: POST/GET /v1/prefixes, GET/PATCH/DELETE /v1/prefixes/{name}.

Whose prefix is whose (service/tenants.py): a caller registers prefixes for its own tenant; an admin
publishes them to every tenant (its default, or `published: false` for its own tenant's). A caller sees,
uses, changes and deletes its own and, by name, the published ones (only an admin changes or deletes
those); an admin sees all, and names another tenant's with `?tenant=`. What a name means and what of a
prefix a caller sees is prefix_store/access.py's rule: a `{name}` that is not a name (`acme%2Fsecret`),
another tenant's prefix and a missing one are the same 404. Listings are paginated (`limit`, `after`:
OpenAI's list shape) and leave out sources and block hashes (GET one for those).
"""
from __future__ import annotations

import hashlib
from typing import Any

from aiohttp import web

from prefix_store.base import PrefixRecord
from prefix_store.registry import PrefixRegistry
from service.errors import ApiError, invalid
from service.openai.pipeline import off_loop, read_body
from service.openai.render import encode_prompt, render_messages, template_messages
from service.openai.schema import PrefixPatch, PrefixRequest, parse_model
from service.state import STATE
from service.tenants import ANONYMOUS, caller_of

MAX_PAGE = 1000


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
    caller = caller_of(request)
    if caller.tenant == ANONYMOUS:
        raise ApiError(401, "registering a prefix needs a key: send it as `Authorization: Bearer <key>`.",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    published = caller.tenant is None or (caller.admin if body.published is None else body.published)
    if published and not caller.admin:
        raise ApiError(403, "only an admin key may publish a prefix to every tenant", type="permission_error",
                       code="admin_key_required", param="published")
    _check_ttl(body.ttl_seconds, state.config.max_lease_seconds)
    record, created = await registry.register(
        body.name, token_ids, source, body.description, owner=None if published else caller.owner,
        salt=caller.prefix_salt(body.name if published else None), ttl_seconds=body.ttl_seconds)
    described = registry.describe(registry.local.get(record.key), record, caller.reader)
    return web.json_response(described, status=201 if created else 200)


def _check_ttl(ttl: float | None, longest: float) -> None:
    if ttl is not None and not 1 <= ttl <= longest:
        raise invalid(f"ttl_seconds must be within [1, {longest:g}] (--max-lease-seconds)", "ttl_seconds")


def _tenant(request: web.Request) -> str | None:
    """`?tenant=`: an admin naming another tenant's prefix (a user may name only its own: 403 whatever the name,
    so it tells nothing of which exist)."""
    tenant = request.query.get("tenant")
    if tenant is not None and not caller_of(request).admin:
        raise ApiError(403, "only an admin key may name another tenant's prefixes", type="permission_error",
                       code="admin_key_required", param="tenant")
    return tenant


def _page(request: web.Request) -> tuple[int, str | None]:
    raw = request.query.get("limit", "100")
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise invalid(f"limit must be an integer within [1, {MAX_PAGE}]", "limit")
    return int(raw), request.query.get("after")


async def list_prefixes(request: web.Request) -> web.Response:
    registry = _registry(request)
    limit, after = _page(request)
    caller = caller_of(request)
    entries = await registry.list(caller.reader)
    ids = [_id(record) for record, _ in entries]
    start = ids.index(after) + 1 if after in ids else 0 if after is None else len(ids)
    page = [{k: v for k, v in e.items() if k not in ("source", "block_hashes")}
            for _, e in entries[start:start + limit]]
    return web.json_response({"object": "list", "data": page, "has_more": start + limit < len(entries),
                              "first_id": ids[start] if page else None,
                              "last_id": ids[start + len(page) - 1] if page else None})


def _id(record: PrefixRecord) -> str:
    """A listing's cursor: unique across tenants and models (a digest of the model's fingerprint: the
    fingerprint itself is for admins, it seeds the block hashes)."""
    model = hashlib.sha256(record.fingerprint.encode()).hexdigest()[:12]
    return f"{model}:{record.owner or ''}/{record.name}"


async def get_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    caller = caller_of(request)
    return web.json_response(await registry.get(request.match_info["name"], caller.reader, _tenant(request)))


async def patch_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    state = request.app[STATE]
    raw = await read_body(request, state.config.body_timeout)
    body = parse_model(PrefixPatch, raw, strict_fields=True)
    changes = body.model_dump(include=body.model_fields_set)
    if not changes:
        raise invalid("give ttl_seconds and/or description to change", "ttl_seconds")
    _check_ttl(changes.get("ttl_seconds"), state.config.max_lease_seconds)
    caller = caller_of(request)
    described = await registry.update(request.match_info["name"], caller.reader, _tenant(request), **changes)
    return web.json_response(described)


async def delete_prefix(request: web.Request) -> web.Response:
    registry = _registry(request)
    name = request.match_info["name"]
    caller = caller_of(request)
    await registry.delete(name, caller.reader, _tenant(request))
    return web.json_response({"name": name, "object": "prefix", "deleted": True})


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/prefixes", create_prefix)
    app.router.add_get("/v1/prefixes", list_prefixes)
    app.router.add_get("/v1/prefixes/{name}", get_prefix)
    app.router.add_patch("/v1/prefixes/{name}", patch_prefix)
    app.router.add_delete("/v1/prefixes/{name}", delete_prefix)
