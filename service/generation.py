"""Generation: one API request's engine requests (prompts x n), run concurrently, deltas merged.

Choice `i * n + j` is sample j of prompt i (the OpenAI order). n > 1 runs n engine requests (seed + j
when seeded) until the engine forks sequences itself. Each engine request is drained by a pump task
into one queue; closing the Generation cancels the pumps, and leaving `AsyncEngine.generate` early
aborts the request, so its KV blocks are freed at the start of the next engine step.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.sequence import RequestOutput, SamplingParams
from service.metrics import Metrics

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # set on a choice's last delta


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Generation:
    def __init__(self, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                 metrics: Metrics, on_finish: Callable[[Usage], None] | None = None) -> None:
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.prompts = prompts
        self.n = params.n
        self.usage = Usage(prompt_tokens=sum(len(p) for p in prompts))
        self._engine = engine
        self._params = params
        self._metrics = metrics
        self._queue: asyncio.Queue[tuple[int, RequestOutput | EngineError]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._refused: dict[int, EngineError] = {}
        self._open = len(prompts) * self.n
        self._on_finish = on_finish           # called once, when every choice has finished

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    async def start(self) -> None:
        """Submits every engine request; raises the first refusal (the others are then aborted)."""
        for i, ids in enumerate(self.prompts):
            for j in range(self.n):
                seed = self._params.seed
                params = replace(self._params, n=1, best_of=None, seed=None if seed is None else seed + j)
                gen = self._engine.generate(ids, params, request_id=f"{self.id}-{i * self.n + j}")
                self._pumps.append(asyncio.create_task(self._pump(i * self.n + j, gen)))
        # NOTE: a pump's first step runs generate() up to its first await, which is where the engine
        # validates and enqueues (or refuses) the request. Tasks start in creation order, so after one
        # yield every pump has been admitted or refused.
        await asyncio.sleep(0)
        if self._refused:
            await self.aclose()
            raise self._refused[min(self._refused)]

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        t0 = time.perf_counter()
        first: float | None = None
        tokens = 0
        try:
            async for out in gen:
                o = out.outputs[0]
                if o.token_ids and first is None:
                    first = time.perf_counter()
                    self._metrics.ttft.observe(first - t0)
                tokens += len(o.token_ids)
                self._queue.put_nowait((index, out))
        except EngineError as exc:
            if first is None and tokens == 0:
                self._refused[index] = exc
            self._queue.put_nowait((index, exc))
            return
        self._metrics.finished(time.perf_counter() - t0, first - t0 if first is not None else None, tokens)

    async def events(self, keepalive: float | None = None) -> AsyncIterator[ChoiceDelta | None]:
        """Deltas as they come; None after `keepalive` idle seconds. Raises EngineError if one fails."""
        while self._open:
            try:
                async with asyncio.timeout(keepalive):
                    index, out = await self._queue.get()
            except TimeoutError:
                yield None
                continue
            if isinstance(out, EngineError):
                raise out
            if out.error is not None:
                raise EngineError(out.error)
            o = out.outputs[0]
            self.usage.completion_tokens += len(o.token_ids)
            if out.finished:
                self._open -= 1
                if index % self.n == 0:
                    self.usage.cached_tokens += out.num_cached_tokens
                if self._open == 0 and self._on_finish is not None:
                    self._on_finish(self.usage)
            yield ChoiceDelta(index, o.text, list(o.token_ids), o.finish_reason if out.finished else None)

    async def collect(self) -> list[ChoiceDelta]:
        """Runs to the end; one accumulated ChoiceDelta per choice, index ordered."""
        acc = [ChoiceDelta(i, "", [], None) for i in range(self.num_choices)]
        async for d in self.events():
            assert d is not None
            c = acc[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            c.finish_reason = d.finish_reason or c.finish_reason
        return acc

    async def aclose(self) -> None:
        """Aborts whatever still runs (idempotent)."""
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
