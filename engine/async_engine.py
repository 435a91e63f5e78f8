"""AsyncEngine: the asyncio face of the engine, and the service's whole view of it.

    add, generate, abort, abort_all             requests and their streams (RequestStream); a request
                                                with structured output is admitted once its grammar
                                                compiled, on a grammar thread of its own
    pin_prefix, unpin_prefix                    named prefixes: compute and pin, unpin
    reset_prefix_cache, stats                   the router's cache flush; a snapshot for metrics and load
    tokenizer, fingerprint, tokenizer_version,  what never changes once the model is loaded
    max_model_len, block_size, vocab_size,
    model_name, model_path, kv_cache_dtype,
    attention_backend, kernels, config

Who owns what:
- The engine (LLMEngine: core, output processor, pins) belongs to ONE worker thread, the engine thread.
  The event loop never reads or writes it; it sends commands (add, abort, pin, release, unpin) through a
  queue that the engine thread applies at the start of each step, then runs the step there, so the loop
  stays free to stream while the model computes. The one call the loop makes into the engine is
  `core.make_request`, which checks a request against what never changes (length, vocabulary, context
  size); everything that depends on the cache (pinned blocks, the waiting queue) is checked on the
  engine thread and refused through the stream.
- The loop owns the streams (RequestStream) and the pin futures. After each step the engine thread
  returns a StepResult that the loop delivers.
- Tokenizers: a Hugging Face fast tokenizer reconfigures its one Rust object on every encode (special tokens
  split or not, truncation, padding), so two threads encoding with one tokenizer can get each other's
  settings (a grammar's vocabulary read with special tokens split, say). Rule: a tokenizer object is encoded
  with by one thread only; others may only decode with it. The engine's own (`LLMEngine.tokenizer`) serves
  the engine thread (detokenizing) and the grammar thread (xgrammar reads its vocabulary once);
  `AsyncEngine.tokenizer` is a copy for the caller's one encoding thread (the service's tokenizer thread);
  whoever decodes elsewhere keeps a copy of its own (the service's TokenText).

Outputs go to a RequestStream (request_stream.py), which merges them while its consumer lags.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.config import EngineConfig
from engine.engine_thread import EngineThreadSide, StepResult
from engine.errors import EngineDead, EngineError, InvalidRequest
from engine.kv.block_pool import CacheSalt
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, PinnedPrefix, RequestOutput
from engine.request_stream import RequestStream
from engine.sample.grammar_probe import CompileCancelled
from engine.sequence import EngineRequest, SamplingParams

GATHER_S = 0.05     # the longest a step from idle waits for requests already arriving (`AsyncEngine.arriving`)
log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        # NOTE: one thread runs every torch operation of the engine, its construction (the model load)
        # included. GNU OpenMP keeps a team of worker threads per thread that opens a parallel region, and
        # once the process holds more OpenMP threads than cores it stops spinning between regions and
        # sleeps instead: a decode step (hundreds of small regions) then took 24 ms instead of 13 here,
        # with 160,000 context switches a minute. Loaded on one thread and stepped on another is two teams.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._engine = engine or self._executor.submit(LLMEngine, config).result()
        # NOTE: the engine thread's state; the service never touches it (tests may read it between steps)
        self._core = self._engine.core
        # What never changes after loading, readable from any thread:
        self.tokenizer = copy.deepcopy(self._engine.tokenizer)     # the caller's: see "Who owns what"
        self.fingerprint = self._engine.fingerprint
        self.tokenizer_version = self._engine.loaded.tokenizer_version
        self.max_model_len = self._engine.max_model_len
        self.block_size = self._core.block_size             # tokens per KV block (a backend may round it up)
        self.vocab_size = self._core.vocab_size
        self.model_name = self._engine.loaded.name
        self.model_path = str(self._engine.loaded.path)
        self.kv_cache_dtype = self._core.kv_cache_dtype
        self.attention_backend = self._core.attention_backend
        self.kernels = self._core.ops.report.as_dict()          # which kernels run each op (kernels/ops.py)
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread_side = EngineThreadSide(self._engine, self._commands)    # what runs on the engine thread
        self._streams: dict[str, RequestStream] = {}                        # loop side, by engine id
        # NOTE: a request's engine id is unique per life: the id its caller gave, or, while an earlier request of
        # that id is being aborted (outputs of a step that ran before the abort reached the engine thread may
        # still come), that id with a suffix, so the old life's outputs never reach the new one's stream.
        self._ids: dict[str, str] = {}                                      # loop side: caller's id -> engine id
        self._retiring: set[str] = set()                                    # loop side: aborted, not yet applied
        self._pin_futures: dict[str, asyncio.Future[PinnedPrefix]] = {}      # loop side
        self._pin_ids = itertools.count()
        # structured output's grammars compile here, off the loop and the engine thread, a few at once, each
        # within grammar_compile_timeout (engine/sample/grammar_probe.py); a client that leaves stops its own
        self._grammar_executor = ThreadPoolExecutor(max_workers=config.grammar_compile_workers,
                                                    thread_name_prefix="grammar")
        self._compiling: dict[str, threading.Event] = {}    # request id -> its cancel flag (set: any thread)
        self._wakeup: asyncio.Event | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._arriving = 0          # requests on their way in (`arriving`): loop thread only
        self._task: asyncio.Task[None] | None = None
        self._closing = False       # abort_all was called (shutdown): new requests are refused
        self._stats = self._engine.stats()
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
            except Exception:
                if self.dead is None:
                    raise
                # the loop died already, and said why (`dead`): shutting down goes on
            self._task = None
        for rid, stream in list(self._streams.items()):
            stream._fail(rid, EngineDead("the engine is shutting down"))
        self._executor.shutdown(wait=True)
        self._grammar_executor.shutdown(wait=False, cancel_futures=True)
        self._core.close()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead is None

    # -- requests -----------------------------------------------------------------------------
    def add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
            stream: RequestStream | None = None, tenant: str = "") -> RequestStream:
        """Submits a request; its outputs arrive on `stream` (a new one unless given, so several requests
        can share one). `tenant`: whose it is, an opaque key the scheduler shares its turns between (and the
        waiting queue's cap applies to). Raises InvalidRequest (checks on fixed inputs) or EngineDead at once;
        refusals that depend on the cache arrive through the stream."""
        if not self.is_running:
            raise EngineDead("the engine is not running")
        if self._closing:
            raise EngineDead("the engine is shutting down")
        public = request_id or uuid.uuid4().hex
        if public in self._ids:
            raise InvalidRequest(f"request id {public!r} is already in use", param="id")
        rid = public
        while rid in self._retiring or rid in self._streams:
            rid = f"{public}#{uuid.uuid4().hex[:8]}"
        request = self._core.make_request(rid, prompt_token_ids, params, tenant)
        stream = stream or RequestStream(self._end_lives)
        stream._submitted(rid, public)
        self._streams[rid] = stream
        self._ids[public] = rid
        if params.structured is None:
            self._send(("add", request))
        else:   # its grammar compiles first, on a grammar thread: neither the loop nor the engine waits
            loop = asyncio.get_running_loop()
            cancelled = self._compiling[rid] = threading.Event()
            fut = self._grammar_executor.submit(self._core.grammars.compile, params.structured, cancelled)
            fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._compiled, request, stream, f))
        return stream

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Marks a request on its way in (its body read, parsed, tokenized; `add` right after, before any await):
        a step that starts from idle waits for such requests, up to GATHER_S, so that a burst of requests
        is prefilled in one step instead of the first arrival's step and then the rest's (a prefill step
        of a prompt over a cached 1,024-token prefix takes ~70 ms here, one of eight ~300 ms: splitting a
        burst costs the late ones a whole step). Loop thread only."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            if self._wakeup is not None:
                self._wakeup.set()

    async def _gather(self) -> None:
        """Before a step from idle: wait while requests are arriving (see `arriving`), GATHER_S at most."""
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GATHER_S
        while self._arriving and (left := deadline - loop.time()) > 0:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return

    def _compiled(self, request: EngineRequest, stream: RequestStream, fut: Future[Any]) -> None:
        """On the loop, once a request's grammar compiled: admit it, or refuse it through its stream. A
        request aborted meanwhile (its stream no longer holds it) is dropped."""
        rid = request.request_id
        self._compiling.pop(rid, None)
        if self._streams.get(rid) is not stream or rid not in stream._open:
            return
        exc = fut.exception()
        if exc is None:
            self._send(("add", dataclasses.replace(request, grammar=fut.result())))
            return
        self._ended(rid)
        if isinstance(exc, CompileCancelled):       # `abort(rid)` called while it compiled
            exc = EngineError("the request was aborted while its grammar compiled")
        stream._fail(rid, exc if isinstance(exc, EngineError) else
                     EngineError(f"structured output: the grammar failed to compile: {exc}"))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, tenant: str = "") -> AsyncIterator[RequestOutput]:
        """Deltas of one request; the last has `finished` set. Leaving the loop early aborts it."""
        stream = self.add(prompt_token_ids, params, request_id, tenant=tenant)
        try:
            while not stream.finished:
                for out in await stream.get():
                    yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Idempotent; the request's blocks are freed at the start of the next step, its grammar's compile
        (when it is still compiling) is stopped. Any thread."""
        self._stop(self._ids.get(request_id, request_id))

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet ended (compiling their grammar, waiting or running). Loop thread."""
        return len(self._streams)

    def abort_all(self) -> int:
        """Shutdown: ends every request now, each with its last output on its stream (every unfinished sequence
        with finish_reason "abort", as `abort` does), and refuses new ones from here on (EngineDead). A request
        still compiling its grammar fails instead. Returns how many it ended. Loop thread."""
        self._closing = True
        rids = list(self._streams)
        for rid in rids:
            self._stop(rid)
        return len(rids)

    def _abort_life(self, rid: str) -> None:
        """Loop side: aborts the request of engine id `rid`; until the engine thread applied it, a new request
        of the same caller's id runs under another engine id."""
        self._retiring.add(rid)
        self._stop(rid)

    def _stop(self, rid: str) -> None:
        cancelled = self._compiling.get(rid)
        if cancelled is not None:
            cancelled.set()
        self._send(("abort", rid))

    def _end_lives(self, rids: set[str]) -> None:
        """Loop side, for a stream's `abort`: aborts each engine id of `rids` (`_abort_life`), then forgets
        their streams."""
        for rid in rids:
            self._abort_life(rid)
        for rid in rids:
            self._ended(rid)

    def _ended(self, rid: str) -> None:
        """Loop side: engine id `rid` has no stream any more (finished, failed, aborted)."""
        stream = self._streams.pop(rid, None)
        public = stream._public.get(rid) if stream is not None else None
        if public is not None and self._ids.get(public) == rid:
            del self._ids[public]

    async def pin_prefix(self, token_ids: list[int], salt: CacheSalt = (), tenant: str = "") -> PinnedPrefix:
        """Computes (or reuses) the prefix's KV and pins its full blocks; the pins are the caller's once
        this returns. Cancelled at any point, it undoes what it did. `tenant`: whose pin it is (an opaque key:
        its computation is that tenant's turn in the scheduler, its blocks count in that tenant's share of the
        pin cap; unpin with the same). Raises PinCapExceeded (nothing pinned), InvalidRequest or EngineDead."""
        if not self.is_running:
            raise EngineDead("the engine is not running")
        job_id = f"pin-{next(self._pin_ids)}"
        fut: asyncio.Future[PinnedPrefix] = asyncio.get_running_loop().create_future()
        self._pin_futures[job_id] = fut
        self._send(("pin", job_id, list(token_ids), tuple(salt), tenant))
        kept = False
        try:
            result = await fut
            kept = True
            return result
        finally:
            self._pin_futures.pop(job_id, None)
            self._send(("release", job_id, kept))

    async def unpin_prefix(self, token_ids: list[int], salt: CacheSalt = (), tenant: str = "",
                           forget: bool = False) -> int:
        """Drops the prefix's pins (of `tenant`, as it pinned it); `forget` (a deleted prefix): its blocks also
        leave the KV tier."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._send(("unpin", fut, list(token_ids), tuple(salt), tenant, forget))
        return await fut

    async def reset_prefix_cache(self) -> int:
        """Drops every evictable cached block on the engine thread; returns how many."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._send(("reset", fut))
        return await fut

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
        running: asyncio.Future[StepResult] | None = None
        try:
            while True:
                if running is None:
                    if self._commands.empty() and not self._stats.requests_running and \
                            not self._stats.requests_waiting:
                        await self._wakeup.wait()
                    await self._gather()
                    self._wakeup.clear()
                    running = loop.run_in_executor(self._executor, self._thread_side.step)
                result = await running
                running = None
                # NOTE: pipelined. While requests run, the next step starts before this one's outputs are
                # delivered, so the engine thread computes while the loop hands tokens to their streams
                # (measured: batch-1 decode 60 -> 68 tok/s). A command sent meanwhile (an abort) is
                # applied at the start of the step after that one.
                if result.stats is not None and (result.stats.requests_running or result.stats.requests_waiting):
                    self._wakeup.clear()
                    running = loop.run_in_executor(self._executor, self._thread_side.step)
                self._deliver(result)
                await asyncio.sleep(0)  # let handlers write what they got
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine itself broke: fail everyone, report dead
            log.exception("engine loop died")
            self.dead = exc
            for rid, stream in list(self._streams.items()):
                stream._fail(rid, EngineDead(f"the engine stopped: {exc}"))
            raise

    def _deliver(self, res: StepResult) -> None:
        if res.stats is not None:
            self._stats = res.stats
        for rid in res.accepted:
            stream = self._streams.get(rid)
            if stream is not None:
                stream._accept(rid)
        for out in res.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if out.finished:
                    self._ended(out.request_id)
                stream._put(out)
        for rid, exc in res.failures:
            stream = self._streams.get(rid)
            if stream is not None:
                self._ended(rid)
                stream._fail(rid, exc)
        self._retiring.difference_update(res.retired)
        for job_id, result, error in res.pins:
            fut = self._pin_futures.get(job_id)
            if fut is None or fut.done():
                continue            # its waiter is gone; its "release" (keep=False) undoes the pin
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)  # type: ignore[arg-type]
        for ufut, n in res.unpins:
            if not ufut.done():
                ufut.set_result(n)
        for ufut, error in res.refused:
            if not ufut.done():
                ufut.set_exception(error)
