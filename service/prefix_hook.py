"""The `prefix` request field: names a registered prefix whose tokens go before the prompt.

Names resolve in the replica's local view of the registry (never in Redis: the store is not on the
per-request path). A request that named a prefix is counted in the per-prefix metrics when it ends.
"""
from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from service.errors import ApiError
from service.generation import Usage
from service.metrics import METRICS
from service.state import STATE


def unknown_prefix(name: str) -> ApiError:
    return ApiError(404, f"prefix {name!r} is not registered", type="not_found_error", param="prefix",
                    code="prefix_not_found")


def with_prefix(app: web.Application, prefix: str | None, prompts: list[list[int]]) -> list[list[int]]:
    """Prepends the named prefix's tokens to every prompt (404 when the name is not registered here)."""
    if prefix is None:
        return prompts
    registry = app[STATE].registry
    if registry is None:
        raise unknown_prefix(prefix)
    head = registry.resolve(prefix)
    return [head + p for p in prompts]


def on_prefix_use(app: web.Application, prefix: str | None) -> Callable[[Usage], None] | None:
    """The Generation callback that counts a finished request against its named prefix."""
    registry = app[STATE].registry
    if prefix is None or registry is None:
        return None

    def record(usage: Usage) -> None:
        hit, saved = registry.record_use(prefix, usage.cached_tokens)
        app[METRICS].prefix_used(prefix, hit, saved)

    return record
