"""Generation: one API request's engine requests (one per prompt), run concurrently, deltas merged.

Each prompt is ONE engine request carrying the client's n / best_of / beam search: the engine computes
the prompt once and forks its samples (or beams) from it. Choice `i * n + j` is output j of prompt i
(the OpenAI order). With best_of > n or beam search the engine streams nothing until the end and then
hands back the n best, whole. Each engine request is drained by a pump task into one queue; closing
the Generation cancels the pumps, and leaving `AsyncEngine.generate` early aborts the request, so its KV
blocks (every fork's) are freed at the start of the next engine step.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
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
    logprobs: list[dict[int, float]] | None = None    # per token of this delta, when asked for


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
        self.usage = Usage(prompt_tokens=sum(len(p) for p in prompts))   # once per prompt, not per sample
        self._engine = engine
        self._params = params
        self._metrics = metrics
        self._queue: asyncio.Queue[tuple[int, RequestOutput | EngineError]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._refused: dict[int, EngineError] = {}
        self._open = len(prompts)                # engine requests not yet finished
        self._finished: set[int] = set()         # choices whose finish_reason went out
        self._on_finish = on_finish              # called once, when every request has finished

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    async def start(self) -> None:
        """Submits every engine request; raises the first refusal (the others are then aborted)."""
        for i, ids in enumerate(self.prompts):
            gen = self._engine.generate(ids, self._params, request_id=f"{self.id}-{i}")
            self._pumps.append(asyncio.create_task(self._pump(i, gen)))
        # NOTE: a pump's first step runs generate() up to its first await, which is where the engine
        # validates and enqueues (or refuses) the request. Tasks start in creation order, so after one
        # yield every pump has been admitted or refused.
        await asyncio.sleep(0)
        if self._refused:
            await self.aclose()
            raise self._refused[min(self._refused)]

    async def _pump(self, prompt: int, gen: AsyncIterator[RequestOutput]) -> None:
        t0 = time.perf_counter()
        first: float | None = None
        tokens: dict[int, int] = {}              # output index -> tokens so far
        try:
            async for out in gen:
                for o in out.outputs:
                    if o.token_ids and first is None:
                        first = time.perf_counter()
                        self._metrics.ttft.observe(first - t0)
                    tokens[o.index] = tokens.get(o.index, 0) + len(o.token_ids)
                self._queue.put_nowait((prompt, out))
        except EngineError as exc:
            if first is None and not tokens:
                self._refused[prompt] = exc
            self._queue.put_nowait((prompt, exc))
            return
        # per-sequence latency: the longest output stands for the request
        self._metrics.finished(time.perf_counter() - t0, first - t0 if first is not None else None,
                               max(tokens.values(), default=0))

    async def events(self, keepalive: float | None = None) -> AsyncIterator[ChoiceDelta | None]:
        """Deltas as they come; None after `keepalive` idle seconds. Raises EngineError if one fails."""
        while self._open:
            try:
                async with asyncio.timeout(keepalive):
                    prompt, out = await self._queue.get()
            except TimeoutError:
                yield None
                continue
            if isinstance(out, EngineError):
                raise out
            if out.error is not None:
                raise EngineError(out.error)
            deltas = []
            for o in out.outputs:
                index = prompt * self.n + o.index
                if index in self._finished or o.index >= self.n:
                    continue
                self.usage.completion_tokens += len(o.token_ids)
                if o.finish_reason is not None:
                    self._finished.add(index)
                deltas.append(ChoiceDelta(index, o.text, list(o.token_ids), o.finish_reason,
                                          list(o.logprobs) if o.logprobs is not None else None))
            if out.finished:
                self._open -= 1
                self.usage.cached_tokens += out.num_cached_tokens
                for j in range(self.n):          # every choice of a finished request ends, told or not
                    if prompt * self.n + j not in self._finished:
                        self._finished.add(prompt * self.n + j)
                        deltas.append(ChoiceDelta(prompt * self.n + j, "", [], "abort"))
                if self._open == 0 and self._on_finish is not None:
                    self._on_finish(self.usage)
            for d in deltas:
                yield d

    async def collect(self) -> list[ChoiceDelta]:
        """Runs to the end; one accumulated ChoiceDelta per choice, index ordered."""
        acc = [ChoiceDelta(i, "", [], None) for i in range(self.num_choices)]
        async for d in self.events():
            assert d is not None
            c = acc[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            c.finish_reason = d.finish_reason or c.finish_reason
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
        return acc

    async def aclose(self) -> None:
        """Aborts whatever still runs (idempotent)."""
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
