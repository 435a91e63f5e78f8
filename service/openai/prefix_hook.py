"""The `prefix` request field: names a registered prefix that goes before the prompt (composed as
service/prepare.py says).

Names resolve in the replica's local view of the registry (never in Redis: the store is not on the
per-request path). A request that named a prefix is counted against it in the registry's local view
when it ends (the per-prefix metrics read those counts).
"""
from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from prefix_store.errors import PrefixNotFound
from service.openai.generation import Usage
from service.openai.pipeline import PrefixSnapshot
from service.state import STATE


def snapshot(app: web.Application, prefix: str | None) -> PrefixSnapshot | None:
    """The named prefix as a request uses it (404 when the name is not registered here). Event loop only."""
    if prefix is None:
        return None
    registry = app[STATE].registry
    if registry is None:
        raise PrefixNotFound(f"prefix {prefix!r} is not registered", param="prefix")
    record = registry.resolve(prefix)
    messages = record.source.get("messages")
    return PrefixSnapshot(prefix, tuple(record.token_ids),
                          tuple(dict(m) for m in messages) if isinstance(messages, list) else None)


def on_prefix_use(app: web.Application, prefix: str | None) -> Callable[[Usage], None] | None:
    """The Generation callback that counts a finished request against its named prefix."""
    registry = app[STATE].registry
    if prefix is None or registry is None:
        return None

    def record(usage: Usage) -> None:
        registry.record_use(prefix, usage.cached_tokens)

    return record
