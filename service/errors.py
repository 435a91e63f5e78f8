"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the middleware that
turns every failure into one. Bad input is a 4xx; a 500 means a bug in prefixserve, and is logged."""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engine.errors import CapacityExceeded, EngineDead, EngineError, InvalidRequest, PinCapExceeded, QueueFull
from prefix_store import PrefixConflict, StoreUnavailable
from prefix_store.errors import InvalidPrefix, PrefixNotFound, RegistryError, RegistryFull

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


def from_engine(exc: EngineError) -> ApiError:
    """Maps the engine's boundary errors to HTTP: 400, 429 (with Retry-After), 507, 503, else 500."""
    if isinstance(exc, InvalidRequest):
        return ApiError(400, exc.message, param=exc.param)
    if isinstance(exc, QueueFull):
        return ApiError(429, exc.message, type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, CapacityExceeded):
        return ApiError(429, exc.message, type="rate_limit_error", code="kv_cache_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, PinCapExceeded):
        return ApiError(507, exc.message, type="insufficient_storage", param=exc.param, code="pin_cap_exceeded")
    if isinstance(exc, EngineDead):
        return ApiError(503, exc.message, type="service_unavailable", code="engine_dead")
    return ApiError(500, exc.message, type="internal_error", code="engine_error")


def from_registry(exc: RegistryError | PrefixConflict | StoreUnavailable) -> ApiError:
    """Maps the prefix registry's domain errors to HTTP: 404, 400, 409, 503."""
    if isinstance(exc, PrefixNotFound):
        return ApiError(404, exc.message, type="not_found_error", param=exc.param, code="prefix_not_found")
    if isinstance(exc, RegistryFull):
        return ApiError(507, exc.message, type="insufficient_storage", param=exc.param, code="registry_full")
    if isinstance(exc, InvalidPrefix):
        return ApiError(400, exc.message, param=exc.param, code="invalid_prefix")
    if isinstance(exc, PrefixConflict):
        return ApiError(409, str(exc), type="conflict_error", param="name", code="prefix_conflict")
    if isinstance(exc, StoreUnavailable):
        return ApiError(503, f"the prefix store is unavailable ({exc}); registry writes are refused until it is "
                        "back, generation is not affected", type="service_unavailable",
                        code="prefix_store_unavailable", headers={"Retry-After": "2"})
    return ApiError(400, exc.message, param=exc.param)


_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except EngineError as exc:
        return from_engine(exc).response()
    except (RegistryError, PrefixConflict, StoreUnavailable) as exc:
        return from_registry(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if exc.status == 413:
            message = f"request body too large (limit {request.client_max_size} bytes)"
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        return ApiError(exc.status, message, type=_HTTP_TYPES.get(exc.status, "invalid_request_error"),
                        code=str(exc.status), headers=headers).response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(500, "internal server error", type="internal_error", code="internal_error").response()
