"""AsyncEngine: the asyncio face of the engine. add / stream / abort, pin / unpin.

One asyncio task (the engine loop) drives steps. Every touch of the engine core (LLMEngine) happens
on one worker thread: commands from the event loop (add, abort, pin, unpin) are queued and applied
by that thread at the start of each step, then the step's forward pass runs there too, so the event
loop stays free to stream while the model computes.

Outputs go to one collector per request: a single slot that merges deltas when the consumer lags,
so `put` never blocks and the engine never waits for a slow client.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineDead, EngineError, InvalidRequest, PinCapExceeded, QueueFull
from engine.llm_engine import EngineStats, LLMEngine, PinnedPrefix
from engine.sequence import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class _Collector:
    """One slot of pending output for a request; deltas merge while the consumer is away."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        if self._pending is None:
            self._pending = out
        else:
            self._pending = _merge_delta(self._pending, out)
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        assert self._error is not None
        raise self._error


def _merge_delta(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    by_index = {o.index: o for o in a.outputs}
    for o in b.outputs:
        cur = by_index.get(o.index)
        if cur is None:
            a.outputs.append(o)
            continue
        cur.text += o.text
        cur.token_ids = cur.token_ids + o.token_ids
        if o.logprobs:
            cur.logprobs = (cur.logprobs or []) + o.logprobs
        cur.finish_reason, cur.stop_reason, cur.cumulative_logprob = o.finish_reason, o.stop_reason, o.cumulative_logprob
    a.outputs.sort(key=lambda o: o.index)
    a.finished, a.num_cached_tokens = b.finished, b.num_cached_tokens
    return a


@dataclass
class _StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    failures: list[tuple[str, BaseException]] = field(default_factory=list)      # request id, error
    resolved: list[tuple[asyncio.Future, Any, BaseException | None]] = field(default_factory=list)
    stats: EngineStats | None = None
    num_adds: int = 0


class AsyncEngine:
    def __init__(self, config: EngineConfig, core: LLMEngine | None = None) -> None:
        self.config = config
        self.core = core or LLMEngine(config)
        self.tokenizer = self.core.tokenizer
        self.fingerprint = self.core.fingerprint
        self.tokenizer_version = self.core.loaded.tokenizer_version
        self.max_model_len = self.core.max_model_len
        path = self.core.loaded.path
        self.model_name = "prefixserve-demo" if config.model is None else path.name
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._collectors: dict[str, _Collector] = {}
        self._pins: dict[str, tuple[asyncio.Future, list[int]]] = {}     # request id -> (future, prefix)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._wakeup: asyncio.Event | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._task: asyncio.Task | None = None
        self._stats = self.core.stats()
        self._pending_adds = 0
        self.dead: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for rid, c in list(self._collectors.items()):
            c.fail(EngineDead("the engine is shutting down"))
        self._executor.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead is None

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Deltas of one request; the last has `finished` set. Leaving the loop early aborts it."""
        if not self.is_running:
            raise EngineDead("the engine is not running")
        rid = request_id or uuid.uuid4().hex
        if rid in self._collectors:
            raise InvalidRequest(f"request id {rid!r} is already in use", param="id")
        self.core.validate(prompt_token_ids, params)
        if self._stats.requests_waiting + self._pending_adds >= self.config.max_num_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_num_waiting} requests); retry later")
        collector = _Collector()
        self._collectors[rid] = collector
        self._pending_adds += 1
        self._send(("add", rid, list(prompt_token_ids), params))
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self._collectors.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; the request's blocks are freed at the start of the next step."""
        self._send(("abort", request_id))

    async def pin_prefix(self, token_ids: list[int]) -> PinnedPrefix:
        """Computes (or reuses) the prefix's KV and pins its full blocks. Raises PinCapExceeded."""
        if not self.is_running:
            raise EngineDead("the engine is not running")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(("pin", fut, list(token_ids)))
        return await fut

    async def unpin_prefix(self, token_ids: list[int]) -> int:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(("unpin", fut, list(token_ids)))
        return await fut

    def prefix_block_hashes(self, token_ids: list[int]) -> list[str]:
        return [h.hex() for h in self.core.manager.block_hashes(token_ids)]

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its last step."""
        return self._stats

    def _send(self, cmd: tuple[Any, ...]) -> None:
        self._commands.put(cmd)
        if self._wakeup is None or self._event_loop is None or self._event_loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._wakeup.set()
        else:
            self._event_loop.call_soon_threadsafe(self._wakeup.set)

    # -- the loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while True:
                if self._commands.empty() and not self.core.has_unfinished():
                    await self._wakeup.wait()
                self._wakeup.clear()
                result = await loop.run_in_executor(self._executor, self._step_in_thread)
                self._deliver(result)
                await asyncio.sleep(0)  # let handlers write what they got before the next step
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine itself broke: fail everyone, report dead
            log.exception("engine loop died")
            self.dead = exc
            for c in self._collectors.values():
                c.fail(EngineDead(f"the engine stopped: {exc}"))
            raise

    def _step_in_thread(self) -> _StepResult:
        """Runs on the engine thread: apply queued commands, then one step."""
        res = _StepResult()
        core = self.core
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            kind = cmd[0]
            if kind == "add":
                _, rid, ids, params = cmd
                res.num_adds += 1
                try:
                    core.add_request(rid, ids, params)
                except EngineError as exc:
                    res.failures.append((rid, exc))
            elif kind == "abort":
                out = core.abort(cmd[1])
                if out is not None:
                    res.outputs.append(out)
            elif kind == "pin":
                self._start_pin(cmd[1], cmd[2], res)
            elif kind == "unpin":
                res.resolved.append((cmd[1], core.unpin_prefix(cmd[2]), None))
        if core.has_unfinished():
            try:
                res.outputs.extend(core.step())
            except Exception as exc:  # a failed forward pass fails the requests in flight, not the engine
                log.exception("engine step failed")
                for rid in list(core.requests):
                    aborted = core.abort(rid)
                    if rid in self._pins and aborted is not None:
                        res.outputs.append(aborted)      # resolved with an error below
                    else:
                        res.failures.append((rid, EngineError(f"internal error while generating: {exc}")))
        for out in res.outputs:
            pin = self._pins.pop(out.request_id, None) if out.finished else None
            if pin is not None:
                fut, ids = pin
                if out.outputs[0].finish_reason == "length" and out.error is None:
                    res.resolved.append((fut, core.pinned_prefix(ids), None))
                elif out.error is not None:
                    res.resolved.append((fut, None, PinCapExceeded(out.error, param="prompt")))
                else:
                    res.resolved.append((fut, None, EngineError("the prefix computation was aborted; nothing was pinned")))
        res.stats = core.stats()
        return res

    def _start_pin(self, fut: asyncio.Future, ids: list[int], res: _StepResult) -> None:
        core = self.core
        try:
            core.check_pin(ids)
            if core.manager.cached_prefix_blocks(ids) is not None:
                res.resolved.append((fut, core.pin_prefix(ids), None))
                return
            rid = f"pin-{uuid.uuid4().hex}"
            core.add_request(rid, ids, SamplingParams(max_tokens=0, temperature=0.0), pin_on_finish=True)
            self._pins[rid] = (fut, ids)
        except EngineError as exc:
            res.resolved.append((fut, None, exc))

    def _deliver(self, res: _StepResult) -> None:
        self._pending_adds -= res.num_adds
        if res.stats is not None:
            self._stats = res.stats
        for out in res.outputs:
            c = self._collectors.get(out.request_id)
            if c is not None:
                c.put(out)
        for rid, exc in res.failures:
            c = self._collectors.get(rid)
            if c is not None:
                c.fail(exc)
        for fut, value, error in res.resolved:
            if fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
