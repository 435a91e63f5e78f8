"""Browser hardening headers, set when each response is prepared (streams and files included).

Every response: `X-Content-Type-Options: nosniff` (a JSON error or an SSE stream is never run as a
script or rendered as HTML). The demo page and its static files also get:

- a Content-Security-Policy: scripts, styles and images from this origin only (no inline script, no
  eval), fetches and WebSockets to this origin only, no plugins, no <base> rewriting, and no framing
  (`frame-ancestors 'none'`, with `X-Frame-Options: DENY` for browsers that predate CSP 2);
- `Referrer-Policy: no-referrer`.

connect-src names ws:// and wss:// of the page's own host explicitly: browsers before CSP 3 do not
count a WebSocket to the same host as 'self'. The host comes from the Host header, used only when it
is a plain host[:port].
"""
from __future__ import annotations

import re

from aiohttp import web

PAGE_ROUTES = frozenset({"/", "/static"})
_HOST_RE = re.compile(r"[A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


def content_security_policy(host: str | None) -> str:
    connect = "'self'"
    if host is not None and _HOST_RE.fullmatch(host):
        connect += f" ws://{host} wss://{host}"
    return ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            f"connect-src {connect}; object-src 'none'; base-uri 'none'; form-action 'self'; "
            "frame-ancestors 'none'")


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare."""
    response.headers["X-Content-Type-Options"] = "nosniff"
    resource = request.match_info.route.resource
    if resource is not None and resource.canonical in PAGE_ROUTES:
        response.headers["Content-Security-Policy"] = content_security_policy(request.host)
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "no-referrer"


def setup(app: web.Application) -> None:
    app.on_response_prepare.append(add_security_headers)
