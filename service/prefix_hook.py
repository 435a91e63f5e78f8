"""The `prefix` request field: names a registered prefix whose tokens go before the prompt.

NOTE: the prefix registry (issue 5) replaces `app[PREFIX_RESOLVER]` with a lookup in its store. Until
then no prefix is registered, so naming one is a 404 in the OpenAI error shape.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from service.errors import ApiError

PrefixResolver = Callable[[str], Awaitable[list[int]]]   # name -> token ids, or raises ApiError


def unknown_prefix(name: str) -> ApiError:
    return ApiError(404, f"prefix {name!r} is not registered", type="not_found_error", param="prefix",
                    code="prefix_not_found")


async def no_prefixes(name: str) -> list[int]:
    raise unknown_prefix(name)


PREFIX_RESOLVER: web.AppKey[PrefixResolver] = web.AppKey("prefix_resolver")
