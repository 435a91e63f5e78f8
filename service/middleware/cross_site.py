"""What other web sites may make a browser do here: the Host check, CORS, the WebSocket Origin check,
JSON-only bodies.

The Host check (DNS rebinding): a hostile page on a name its owner points at 127.0.0.1 after the page has
loaded is same-origin with this server in the browser's eyes; only the Host header (that name) tells it
apart. So a request whose Host names neither this server nor an allowed host is refused with 421, before
anything else. Allowed (`Hosts`): localhost, any IP address (a rebinding needs a DNS name: a page whose
origin is an address was served from that address), the bound `--host` when it is a name, and
`--allowed-hosts` (a `*` matches within one label: `prefixserve-engine-*` is not `prefixserve-engine-1.evil.net`;
`*` alone turns the check off). A wildcard bind (`--host 0.0.0.0`) adds no name: list the names clients use.
A request with no Host header at all (HTTP/1.0; never a browser) passes.

One list, `--allowed-origins` (default none; `*` for any), drives the other three:

- Preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here, before
  authentication (browsers send no key on it): 204 with the Access-Control-Allow-* headers for a
  listed origin, 403 for any other. Allowed headers: Authorization, Content-Type, X-Request-Id, and
  whatever else the listed origin's preflight names (the OpenAI JS client adds its own x-stainless-*
  headers; `*` would not do, it never covers Authorization).
- Every other response to a listed origin carries Access-Control-Allow-Origin (and exposes
  X-Request-Id); unlisted origins get no CORS header, so their pages cannot read the answer. The
  headers are set when the response is prepared, so SSE streams get them too.
- A WebSocket upgrade whose Origin is present, not this server's own and not listed is refused with
  403: the browser gives WebSockets no CORS protection, this check is it. "This server's own" is an
  Origin whose host passes the Host allow-list and whose host:port is the one the request reached (the
  Host header, itself checked first): a page on another allowed port (localhost:3000) is not ours.
- A POST/PUT/PATCH must say `Content-Type: application/json` (charset allowed), else 415. The
  types a cross-site form or `fetch` may send without a preflight (text/plain, form encodings, and
  none at all, e.g. a Blob body) are thereby refused, so no other page can make a visitor's browser
  generate or register prefixes. A request with no body at all (a router's POST /flush_cache) has
  nothing to misread and passes. NOTE: `curl -d` sends x-www-form-urlencoded: use `curl --json` or
  `-H 'Content-Type: application/json'`.

A middleware and a response-prepare hook rather than aiohttp-cors: that library wires CORS per route
and cannot refuse WebSocket origins; this is one policy over one list.
"""
from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from service.config import ServiceConfig, is_address
from service.errors import ApiError

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOW_HEADERS = ("Authorization", "Content-Type", "X-Request-Id")
MAX_EXTRA_HEADERS = 64
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]{1,64}")
EXPOSE_HEADERS = "X-Request-Id"
MAX_AGE_S = 600
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class Origins:
    def __init__(self, config: ServiceConfig) -> None:
        self._any = "*" in config.allowed_origins
        self._listed = frozenset(config.allowed_origins)

    def allowed(self, origin: str) -> bool:
        return self._any or origin.lower() in self._listed


ORIGINS = web.AppKey("allowed_origins", Origins)
_LOOPBACK_NAMES = ("localhost",)
_WILDCARD_BINDS = ("0.0.0.0", "::", "*", "")


def host_name(authority: str) -> str:
    """The name of a Host header or an Origin's authority: port, IPv6 brackets and a final dot dropped,
    lowercased (`[::1]:8000` -> `::1`, `Example.com.:80` -> `example.com`)."""
    h = authority.strip().lower()
    if h.startswith("["):
        h = h[1:h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


class Hosts:
    """The Host allow-list (see the module's docstring). A pattern's `*` matches one label's characters."""

    def __init__(self, config: ServiceConfig) -> None:
        entries = [host_name(h) if h != "*" else h for h in config.allowed_hosts]
        bound = host_name(config.host)
        names = {*_LOOPBACK_NAMES, *entries, *([bound] if bound not in _WILDCARD_BINDS else [])}
        self._any = "*" in names
        self._exact = frozenset(n for n in names if "*" not in n)
        self._patterns = [re.compile(re.escape(n).replace(r"\*", "[a-z0-9-]*"))
                          for n in names if "*" in n and n != "*"]

    def allowed(self, name: str) -> bool:
        return (self._any or name in self._exact or is_address(name)
                or any(p.fullmatch(name) for p in self._patterns))


HOSTS = web.AppKey("allowed_hosts", Hosts)


def same_origin(request: web.Request, origin: str) -> bool:
    """Origin names this server as the browser reached it (the demo page's own host): an allowed host, and
    the host:port of this request (the Host header, already checked against the allow-list)."""
    _, sep, authority = origin.partition("://")
    host = request.headers.get(hdrs.HOST)
    return (bool(sep) and host is not None and request.app[HOSTS].allowed(host_name(authority))
            and authority.lower() == host.strip().lower())


@web.middleware
async def cross_site_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    host = request.headers.get(hdrs.HOST)
    if host is not None and not request.app[HOSTS].allowed(host_name(host)):
        raise ApiError(421, f"this server does not answer to the host {host[:200]!r} (see --allowed-hosts)",
                       code="host_not_allowed")
    origins = request.app[ORIGINS]
    origin = request.headers.get(hdrs.ORIGIN)
    if request.method == "OPTIONS" and origin is not None and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers:
        if not origins.allowed(origin):
            raise ApiError(403, f"origin {origin[:200]!r} is not allowed (see --allowed-origins)",
                           type="permission_error", code="origin_not_allowed")
        return web.Response(status=204, headers={
            hdrs.ACCESS_CONTROL_ALLOW_METHODS: ALLOW_METHODS,
            hdrs.ACCESS_CONTROL_ALLOW_HEADERS: _allow_headers(request),
            hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S),
            hdrs.VARY: "Access-Control-Request-Method, Access-Control-Request-Headers"})
    if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket" and origin is not None \
            and not same_origin(request, origin) and not origins.allowed(origin):
        raise ApiError(403, f"WebSocket connections from origin {origin[:200]!r} are not allowed "
                       "(see --allowed-origins)", type="permission_error", code="origin_not_allowed")
    if request.method in _BODY_METHODS and request.can_read_body and \
            request.content_type != "application/json":
        raise ApiError(415, f"the body must be JSON sent as `Content-Type: application/json`, got "
                       f"{request.headers.get(hdrs.CONTENT_TYPE, 'none')[:100]!r}",
                       type="invalid_request_error", code="unsupported_media_type")
    return await handler(request)


def _allow_headers(request: web.Request) -> str:
    """Ours, then the well-formed names the preflight asks for (at most MAX_EXTRA_HEADERS)."""
    names = list(ALLOW_HEADERS)
    known = {n.lower() for n in names}
    for name in request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, "").split(","):
        name = name.strip()
        if _HEADER_NAME.fullmatch(name) and name.lower() not in known and len(names) < len(ALLOW_HEADERS) + \
                MAX_EXTRA_HEADERS:
            known.add(name.lower())
            names.append(name)
    return ", ".join(names)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the CORS headers of an allowed origin, on every response to it."""
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is None:
        return
    response.headers.add(hdrs.VARY, hdrs.ORIGIN)
    if request.app[ORIGINS].allowed(origin):
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = EXPOSE_HEADERS


def setup(app: web.Application, config: ServiceConfig) -> None:
    app[ORIGINS] = Origins(config)
    app[HOSTS] = Hosts(config)
    app.on_response_prepare.append(add_cors_headers)
