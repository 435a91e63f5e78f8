"""RequestStream: the outputs of a caller's engine requests, delivered by the async engine's loop.

One pending output per request, merging deltas while the consumer lags (RequestOutput.merge), so delivery
never blocks and the engine never waits for a slow client. The async engine (async_engine.py) creates the
streams and feeds them on the event loop (`_submitted`, `_accept`, `_put`, `_fail`); the caller reads them.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.errors import EngineError
from engine.outputs import RequestOutput


class RequestStream:
    """The outputs of one or more engine requests, merged per request while the consumer is away.

    `accepted()` waits until the engine thread admitted every request (or raises the first refusal);
    `get()` returns what arrived since the last call, one merged RequestOutput per request, and raises
    the error of a request the engine refused or ended with an error; `abort()` ends every request
    that has not finished. Loop-side object: touched only on the event loop.
    """

    def __init__(self, end: Callable[[set[str]], None]) -> None:
        self._end = end                       # aborts these engine ids and forgets their streams (its engine's)
        self._public: dict[str, str] = {}     # engine id -> the id its caller gave (AsyncEngine.add)
        self._pending: dict[str, RequestOutput] = {}
        self._errors: list[EngineError] = []
        self._open: set[str] = set()          # submitted, not finished
        self._unaccepted: set[str] = set()
        self._ready = asyncio.Event()
        self._admitted = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self._open and not self._pending

    def _submitted(self, request_id: str, public_id: str) -> None:
        self._public[request_id] = public_id
        self._open.add(request_id)
        self._unaccepted.add(request_id)
        self._admitted.clear()

    def _accept(self, request_id: str) -> None:
        self._unaccepted.discard(request_id)
        if not self._unaccepted:
            self._admitted.set()

    def _put(self, out: RequestOutput) -> None:
        self._accept(out.request_id)
        prev = self._pending.get(out.request_id)
        self._pending[out.request_id] = out if prev is None else prev.merge(out)
        if out.finished:
            self._open.discard(out.request_id)
        self._ready.set()

    def _fail(self, request_id: str, exc: EngineError) -> None:
        self._open.discard(request_id)
        self._errors.append(exc)
        self._accept(request_id)
        self._admitted.set()
        self._ready.set()

    async def accepted(self) -> None:
        await self._admitted.wait()
        if self._errors:
            raise self._errors[0]

    async def get(self) -> list[RequestOutput]:
        await self._ready.wait()
        self._ready.clear()
        return self._take()

    def _take(self) -> list[RequestOutput]:
        if self._errors:
            raise self._errors[0]
        outs = list(self._pending.values())
        self._pending.clear()
        for out in outs:
            if out.error is not None:
                raise out.error
            out.request_id = self._public.get(out.request_id, out.request_id)
        return outs

    async def final(self) -> list[RequestOutput]:
        """Waits until every request has finished; their whole outputs (for a consumer that never
        called `get`). Raises like `get`."""
        while self._open and not self._errors:
            await self._ready.wait()
            self._ready.clear()
        return self._take()

    def abort(self) -> None:
        """Ends every unfinished request of the stream (idempotent); blocks are freed at the next step.
        A consumer waiting in `accepted`, `get` or `final` wakes up (with what had arrived)."""
        self._end(self._open)
        self._open.clear()
        self._unaccepted.clear()
        self._admitted.set()
        self._ready.set()
