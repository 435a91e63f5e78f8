"""API keys: who may call what, decided once per request by one middleware.

Keys come from `--api-key` and `--admin-key` (several each). A request presents one as
`Authorization: Bearer <key>` (what the OpenAI clients send) or `x-api-key: <key>` (Anthropic's). A browser
cannot set headers on a WebSocket, so the upgrade of GET /v1/ws may instead offer the key as the subprotocol
`openai-insecure-api-key.<key>` (OpenAI's Realtime API convention) next to `prefixserve`, which is
the protocol the server selects; the key protocol is never echoed. No key in the URL: query strings
end up in proxy logs.

Roles, from the presented key:

    no keys configured at all          -> admin (everything open: the behaviour without keys)
    an admin key                       -> admin
    an API key, no admin keys set      -> admin (nobody is set apart)
    an API key, admin keys set         -> user
    no / another key, no API keys set  -> anonymous (may do what needs no key)
    no / another key, API keys set     -> 401 before any handler runs

Tenants (service/tenants.py): every key is a tenant of its own, or of the group `--tenant-keys` names
for it; keyless callers (where no API key is needed) are one tenant. The middleware puts the caller
(`tenants.CALLER`: tenant, admin or not) on the request.

Open to everyone: GET /health, and the demo page with its static files (they hold no data; the page
asks for the key). /metrics is open unless `metrics_require_key`. With admin keys configured, the
registry writes and cache flushes (ADMIN_ROUTES) need the admin role: 403 for a user, 401 for anonymous; reading a
published prefix's source text needs it too, on every path that returns tokens or text (prefix_store/access.py
decides for the registry's views, and through `Prepared.hidden` in service/openai/pipeline.py for render,
echo, prompt token ids and logprobs).

Keys are compared in constant time: both sides are hashed with SHA-256 and every configured key is
compared (no early exit), so neither the length nor which key matched shows in the timing.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web

from service.config import ServiceConfig
from service.errors import ApiError
from service.tenants import ANONYMOUS, CALLER, Caller, key_tenant

Role = Literal["admin", "user", "anonymous"]

WS_PROTOCOL = "prefixserve"
WS_KEY_PROTOCOL = "openai-insecure-api-key."
OPEN_ROUTES = frozenset({"/health", "/", "/static"})
# Registry writes, and flushing the prefix cache (every client's cached prompts: the router's or an operator's
# call, never a user's: a flush loop turns another client's cached TTFT of 0.16 s into 5.9 s)
# (a tenant registers, changes and deletes its own prefixes: service/routes/prefixes.py checks whose they are)
ADMIN_ROUTES = frozenset({("POST", "/flush_cache"), ("POST", "/reset_prefix_cache"),
                          ("GET", "/get_load")})    # and the replica's load


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Keys:
    """The configured keys (as digests) and the policy that follows from them."""

    def __init__(self, config: ServiceConfig) -> None:
        grouped = dict(reversed(pair.partition(":")[::2]) for pair in config.tenant_keys)   # key -> tenant
        self._api = [_digest(k) for k in (*config.api_key, *grouped)]
        self._admin = [_digest(k) for k in config.admin_key]
        self._tenants = {_digest(k): name for k, name in grouped.items()}
        self._metrics_open = not config.metrics_require_key
        self._isolated = config.cache_isolation == "tenant"

    @property
    def enabled(self) -> bool:
        return bool(self._api or self._admin)

    def role(self, presented: str | None) -> Role | None:
        """The caller's role, or None when API keys are set and the caller has none of them."""
        if not self.enabled:
            return "admin"
        digest = _digest(presented or "")
        is_admin = any([hmac.compare_digest(digest, k) for k in self._admin])
        is_user = any([hmac.compare_digest(digest, k) for k in self._api])
        if presented is not None and is_admin:
            return "admin"
        if presented is not None and is_user:
            return "user" if self._admin else "admin"
        return None if self._api else "anonymous"

    def caller(self, presented: str | None, role: Role) -> Caller:
        """The tenant behind a key (see the module docstring), with its role."""
        if not self.enabled:
            return Caller(None, admin=True)
        if presented is None or role == "anonymous":
            return Caller(ANONYMOUS, admin=False, isolated=self._isolated)
        digest = _digest(presented)
        tenant = self._tenants.get(digest) or key_tenant(presented)
        return Caller(tenant, admin=role == "admin", isolated=self._isolated)

    def is_open(self, route: str | None) -> bool:
        return route in OPEN_ROUTES or (route == "/metrics" and self._metrics_open)

    def needs_admin(self, method: str, route: str | None) -> bool:
        return bool(self._admin) and (method, route) in ADMIN_ROUTES


KEYS = web.AppKey("api_keys", Keys)
ROLE = web.RequestKey("role", str)


def _presented(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = request.headers.get("x-api-key", "").strip()     # Anthropic's clients send it so
    if api_key:
        return api_key
    if request.headers.get("Upgrade", "").lower() == "websocket":
        for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
            proto = proto.strip()
            if proto.startswith(WS_KEY_PROTOCOL) and len(proto) > len(WS_KEY_PROTOCOL):
                return proto[len(WS_KEY_PROTOCOL):]
    return None


def presented_key(request: web.Request) -> str | None:
    """The key this request presented, when keys are configured (None without keys: everyone is one caller).
    What owns per-caller state such as stored responses."""
    return _presented(request) if request.app[KEYS].enabled else None


def _route(request: web.Request) -> str | None:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else None


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


@web.middleware
async def auth_middleware(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    keys = request.app[KEYS]
    route = _route(request)
    if not keys.enabled or keys.is_open(route):
        open_role: Role = "admin" if not keys.enabled else "anonymous"
        request[ROLE] = open_role
        request[CALLER] = keys.caller(None, open_role)
        return await handler(request)
    presented = _presented(request)
    role = keys.role(presented)
    if role is None:
        raise _unauthorized("Incorrect API key provided." if presented else
                            "You didn't provide an API key: send it as `Authorization: Bearer <key>`.")
    if role != "admin" and keys.needs_admin(request.method, route):
        if role == "user":
            raise ApiError(403, "this operation needs an admin key", type="permission_error",
                           code="admin_key_required")
        raise _unauthorized("this operation needs an admin key: send it as `Authorization: Bearer <key>`.")
    request[ROLE] = role
    request[CALLER] = keys.caller(presented, role)
    return await handler(request)


def is_admin(request: web.Request) -> bool:
    """Whether the caller may read what only admins may (a prefix's source text, its tokens and block hashes)."""
    return request.get(ROLE) == "admin"


def setup(app: web.Application, config: ServiceConfig) -> None:
    app[KEYS] = Keys(config)
