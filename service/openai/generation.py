"""Generation: one API request's engine requests (one per prompt), sharing one RequestStream.

Each prompt is ONE engine request carrying the client's n / best_of / beam search: the engine computes
the prompt once and forks its samples (or beams) from it. Choice `i * n + j` is output j of prompt i
(the OpenAI order). With best_of > n or beam search the engine streams nothing until the end and then
hands back the n best, whole. Merging of a lagging consumer's deltas happens in the stream
(RequestOutput.merge); this class only turns outputs into choices. Closing the Generation aborts every
request that has not finished, so their KV blocks (every fork's) are freed at the next engine step.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from engine.request_stream import RequestStream
from engine.sequence import SamplingParams
from service.middleware.metrics import Metrics
from service.usage import Usage

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # set on a choice's last delta
    logprobs: list[dict[int, float] | None] | None = None   # per token of this delta, when asked for
                                                            # (None for an echoed prompt's first token)
    stop_reason: str | int | None = None    # with finish_reason "stop": the stop string or token id that matched


class Generation:
    def __init__(self, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                 metrics: Metrics, on_finish: Callable[[Usage], None] | None = None,
                 echo: list[str] | None = None, hidden: list[int] | None = None, tenant: str = "") -> None:
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.prompts = prompts
        self.n = params.n
        self.usage = Usage(prompt_tokens=sum(len(p) for p in prompts))   # once per prompt, not per sample
        self._engine = engine
        self._params = params
        self._metrics = metrics
        self._stream: RequestStream | None = None
        self._prompt_of: dict[str, int] = {}      # engine request id -> prompt index
        self._open = len(prompts)                 # engine requests not yet finished
        self._finished: set[int] = set()          # choices whose finish_reason went out
        self._started: set[int] = set()           # prompts whose first token went out
        self._generated: dict[int, int] = {}      # prompt -> tokens sampled, as counted in the metrics
        self._on_finish = on_finish               # called once, when every request has finished (or was stopped)
        self._closed = False
        self._accepted = False                    # the engine admitted every request (else none ran)
        self._cached: dict[int, int] = {}         # prompt -> prompt tokens served from the cache, as last told
        self._written: dict[int, int] = {}        # prompt -> prompt tokens it wrote into the cache, as last told
        self._done: set[int] = set()              # prompts whose engine request finished (counted in the metrics)
        self._echo = echo                         # per prompt, its text, put before each of its choices
        self._echoed: set[int] = set()            # choices whose first delta carried the prompt
        # per prompt, its leading tokens the caller may not see (a named prefix's: pipeline.Prepared.hidden)
        self._hidden = hidden or [0] * len(prompts)
        self._tenant = tenant                     # the caller's tenant: the engine's scheduler is fair between them

    def shown_prompt(self, i: int) -> list[int]:
        """Prompt i's tokens as the caller may see them (what echo, prompt token ids and logprobs show)."""
        return self.prompts[i][self._hidden[i]:]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens read from the prefix cache: as the engine told so far, all of them once every request
        has ended."""
        if len(self._done) == len(self.prompts):
            return self.usage.cached_tokens
        return sum(self._cached.values())

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @classmethod
    async def begin(cls, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, metrics: Metrics,
                    on_finish: Callable[[Usage], None] | None = None, echo: list[str] | None = None,
                    hidden: list[int] | None = None, tenant: str = "") -> Generation:
        """A Generation, started: every engine request admitted (else the first refusal is raised and
        nothing is left running)."""
        gen = cls(engine, prompts, params, metrics, on_finish, echo, hidden, tenant)
        await gen.start()
        return gen

    async def start(self) -> None:
        """Submits every engine request and waits until the engine admitted them all; raises the first
        refusal (the others are then aborted)."""
        try:
            for i, ids in enumerate(self.prompts):
                rid = f"{self.id}-{i}"
                self._stream = self._engine.add(ids, self._params, request_id=rid, stream=self._stream,
                                                tenant=self._tenant)
                self._prompt_of[rid] = i
            assert self._stream is not None
            await self._stream.accepted()
            self._accepted = True
        except BaseException:
            self.close()
            raise

    async def events(self, keepalive: float | None = None) -> AsyncIterator[ChoiceDelta | None]:
        """Deltas as they come; None after `keepalive` idle seconds. Raises EngineError if one fails."""
        assert self._stream is not None, "start() first"
        while self._open and not self._closed:
            try:
                async with asyncio.timeout(keepalive):
                    outs = await self._stream.get()
            except TimeoutError:
                yield None
                continue
            for out in outs:
                for d in self._deltas(out):
                    yield d

    def _deltas(self, out: RequestOutput) -> list[ChoiceDelta]:
        prompt = self._prompt_of[out.request_id]
        self._generated[prompt] = self._metrics.progress(out, self._generated.get(prompt, 0))
        self._cached[prompt] = out.num_cached_tokens
        self._written[prompt] = out.num_written_tokens
        if prompt not in self._started and out.num_generated_tokens:
            self._started.add(prompt)
            self._metrics.first_token(out)
        deltas = []
        for o in out.outputs:
            index = prompt * self.n + o.index
            if index in self._finished or o.index >= self.n:
                continue
            self.usage.completion_tokens += len(o.token_ids)
            if o.finish_reason is not None:
                self._finished.add(index)
            d = ChoiceDelta(index, o.text, list(o.token_ids), o.finish_reason,
                            list(o.logprobs) if o.logprobs is not None else None, o.stop_reason)
            if self._echo is not None and index not in self._echoed:
                self._echoed.add(index)
                d.text = self._echo[prompt] + d.text
                d.token_ids = self.shown_prompt(prompt) + d.token_ids
                if d.logprobs is not None or out.prompt_logprobs is not None:
                    shown = out.prompt_logprobs or [None] * len(self.prompts[prompt])
                    d.logprobs = list(shown[self._hidden[prompt]:]) + (d.logprobs or [])
            deltas.append(d)
        if out.finished:
            self._open -= 1
            self._done.add(prompt)
            self.usage.cached_tokens += out.num_cached_tokens
            self.usage.cache_write_tokens += out.num_written_tokens
            self._metrics.request_finished(out, self._params.best_of or self.n)
            for j in range(self.n):          # every choice of a finished request ends, told or not
                if prompt * self.n + j not in self._finished:
                    self._finished.add(prompt * self.n + j)
                    deltas.append(ChoiceDelta(prompt * self.n + j, "", [], "abort"))
            if self._open == 0 and self._on_finish is not None:
                self._on_finish(self.usage)
        return deltas

    async def collect(self) -> list[ChoiceDelta]:
        """Runs to the end; one whole ChoiceDelta per choice, index ordered (the stream merged them)."""
        assert self._stream is not None, "start() first"
        acc = [ChoiceDelta(i, "", [], None) for i in range(self.num_choices)]
        for out in await self._stream.final():
            for d in self._deltas(out):
                acc[d.index] = d
        return acc

    def close(self) -> None:
        """Aborts whatever still runs (idempotent); a consumer in `events` stops there. Requests stopped here
        (their client went away or cancelled) are counted as what they are: aborted, with the cached prompt
        tokens and the tokens generated that their client was told of (usage, the access log, the metrics)."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._stream.abort()
        stopped = [p for p in range(len(self.prompts)) if p not in self._done] if self._accepted else []
        for prompt in stopped:
            self._done.add(prompt)
            self.usage.cached_tokens += self._cached.get(prompt, 0)
            self.usage.cache_write_tokens += self._written.get(prompt, 0)
            self._metrics.request_aborted(len(self.prompts[prompt]), self._generated.get(prompt, 0))
        if stopped and self._on_finish is not None:
            self._on_finish(self.usage)
