"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, the one mapping from the
domains' errors to HTTP, and the middleware that turns every failure into an answer.

Errors are raised where their meaning lives and become HTTP here only (STYLE 20):

    engine.errors.EngineError          the engine's refusals (bad request, queue full, pin cap, dead)
    prefix_store.errors.RegistryError  the named-prefix domain's (not found, full, conflict, store down)
    ApiError                           the service's own (schema, limits, timeouts), already HTTP

`to_api_error` maps the first two by class through one table; bad input is a 4xx, and a 500 means a
bug in prefixserve (logged).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engine.errors import (
    CapacityExceeded,
    EngineDead,
    EngineError,
    InvalidRequest,
    KVRefused,
    PinCapExceeded,
    QueueFull,
)
from prefix_store.errors import (
    InvalidPrefix,
    PrefixConflict,
    PrefixForbidden,
    PrefixNotFound,
    RegistryError,
    RegistryFull,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answer: HTTP status plus the OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# class -> (status, type, code, headers); the first class an error is an instance of wins.
_HTTP: list[tuple[type[Exception], int, str, str | None, dict[str, str]]] = [
    (InvalidRequest, 400, "invalid_request_error", None, {}),
    (QueueFull, 429, "rate_limit_error", "queue_full", {"Retry-After": str(RETRY_AFTER_S)}),
    (CapacityExceeded, 429, "rate_limit_error", "kv_cache_full", {"Retry-After": str(RETRY_AFTER_S)}),
    (PinCapExceeded, 507, "insufficient_storage", "pin_cap_exceeded", {}),
    (KVRefused, 507, "insufficient_storage", "kv_mapping_limit", {}),
    (EngineDead, 503, "service_unavailable", "engine_dead", {}),
    (EngineError, 500, "internal_error", "engine_error", {}),
    (PrefixNotFound, 404, "not_found_error", "prefix_not_found", {}),
    (RegistryFull, 507, "insufficient_storage", "registry_full", {}),
    (InvalidPrefix, 400, "invalid_request_error", "invalid_prefix", {}),
    (PrefixConflict, 409, "conflict_error", "prefix_conflict", {}),
    (PrefixForbidden, 403, "permission_error", "prefix_forbidden", {}),
    (StoreUnavailable, 503, "service_unavailable", "prefix_store_unavailable", {"Retry-After": "2"}),
    (RegistryError, 400, "invalid_request_error", None, {}),
]


def to_api_error(exc: ApiError | EngineError | RegistryError) -> ApiError:
    """The HTTP answer of a domain error (an ApiError is its own)."""
    if isinstance(exc, ApiError):
        return exc
    for cls, status, kind, code, headers in _HTTP:
        if isinstance(exc, cls):
            message = exc.message
            if isinstance(exc, StoreUnavailable):
                message = (f"the prefix store is unavailable ({exc.message}); registry writes are refused until it "
                           "is back, generation is not affected")
            param = exc.param if not isinstance(exc, EngineDead | QueueFull | CapacityExceeded) else None
            return ApiError(status, message, type=kind, param=param, code=code, headers=dict(headers))
    raise TypeError(f"not a domain error: {exc!r}")


_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}

# Anthropic's Messages API answers its errors in its own shape: {"type": "error", "error": {"type", "message"}},
# the type by status (its documented list); 503 and 507 are its overloaded_error (529 there).
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 507: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def _answer(request: web.Request, err: ApiError) -> web.Response:
    """The error in the shape of the API the request was for."""
    if not request.path.startswith(ANTHROPIC_PATHS):
        return err.response()
    message = err.message if err.param is None or err.param in err.message else f"{err.param}: {err.message}"
    return web.json_response({"type": "error", "error": {"type": anthropic_error_type(err.status),
                                                         "message": message}},
                             status=err.status, headers=err.headers)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except (ApiError, EngineError, RegistryError) as exc:
        return _answer(request, to_api_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if exc.status == 413:
            message = f"request body too large (limit {request.client_max_size} bytes)"
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        return _answer(request, ApiError(exc.status, message, type=_HTTP_TYPES.get(exc.status, "invalid_request_error"),
                                         code=str(exc.status), headers=headers))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _answer(request, ApiError(500, "internal server error", type="internal_error", code="internal_error"))
