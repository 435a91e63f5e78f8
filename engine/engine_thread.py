"""The engine thread's side of AsyncEngine (async_engine.py says who owns what): each turn applies the commands the
loop queued (add, abort, pin, release, unpin, reset), then runs one engine step, and returns what happened as a
StepResult. A command that raises fails what it was for (`_contain` undoes what it started), a failed step
fails the requests in flight; neither stops the engine."""
from __future__ import annotations

import asyncio
import logging
import queue
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineDead, EngineError
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, PinnedPrefix, RequestOutput
from engine.sequence import EngineRequest

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one turn of the engine thread did, for the loop to deliver (AsyncEngine._deliver)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    failures: list[tuple[str, EngineError]] = field(default_factory=list)            # request id, error
    pins: list[tuple[str, PinnedPrefix | None, EngineError | None]] = field(default_factory=list)
    unpins: list[tuple[asyncio.Future[int], int]] = field(default_factory=list)   # unpin and reset answers
    refused: list[tuple[asyncio.Future[int], EngineError]] = field(default_factory=list)  # unpins / resets that failed
    retired: list[str] = field(default_factory=list)     # engine ids whose abort was applied: no output follows
    stats: EngineStats | None = None


class EngineThreadSide:
    """Runs only on the engine thread: it owns `engine` and the pins in flight."""

    def __init__(self, engine: LLMEngine, commands: queue.SimpleQueue[tuple[Any, ...]]) -> None:
        self.engine = engine
        self.commands = commands
        self.pins_waiting: set[str] = set()        # pin jobs started, their result not yet returned

    def step(self) -> StepResult:
        """Applies the queued commands, then runs one step."""
        res = StepResult()
        engine = self.engine
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            try:
                self._apply(cmd, res)
            except Exception as exc:    # a fault of ours in one command fails what it was for, not the engine
                log.exception("engine command %r failed", cmd[0])
                self._contain(cmd, EngineError(f"internal error: {exc!r}"), res)
        if engine.has_unfinished():
            try:
                res.outputs.extend(engine.step())
            except EngineDead:        # a part of the engine is broken for good (the KV cache): the loop ends
                raise
            except Exception as exc:  # a failed forward pass fails the requests in flight, not the engine
                log.exception("engine step failed")
                error = EngineError(f"internal error while generating: {exc}")
                for rid in engine.request_ids:
                    out = engine.abort(rid, error)
                    if out is not None:
                        res.outputs.append(out)
        for job_id in list(self.pins_waiting):
            job = engine.pins.jobs.get(job_id)
            if job is None or job.settled:
                self.pins_waiting.discard(job_id)
            if job is not None and job.settled:
                res.pins.append((job_id, job.result, job.error))
        res.stats = engine.stats()
        return res

    def _contain(self, cmd: tuple[Any, ...], error: EngineError, res: StepResult) -> None:
        """After `cmd` raised, undo what it started and tell its caller (its request fails, its
        future gets the error); what cannot be undone is logged."""
        kind = cmd[0]
        try:
            if kind == "add":
                res.failures.append((cmd[1].request_id, error))
                self.engine.abort(cmd[1].request_id)   # whatever part of it was admitted
            elif kind == "pin":
                self.engine.release_pin(cmd[1], keep=False)
                self.pins_waiting.discard(cmd[1])
                res.pins.append((cmd[1], None, error))
            elif kind in ("unpin", "reset"):
                res.refused.append((cmd[1], error))
            elif kind == "abort":
                res.retired.append(cmd[1])
        except Exception:
            log.exception("undoing the failed %r command failed too", kind)

    def _apply(self, cmd: tuple[Any, ...], res: StepResult) -> None:
        engine = self.engine
        kind = cmd[0]
        if kind == "add":
            request: EngineRequest = cmd[1]
            try:
                engine.add(request)
                res.accepted.append(request.request_id)
            except EngineError as exc:
                res.failures.append((request.request_id, exc))
        elif kind == "abort":
            out = engine.abort(cmd[1])
            if out is not None:
                res.outputs.append(out)
            res.retired.append(cmd[1])
        elif kind == "pin":
            engine.start_pin(cmd[1], cmd[2], cmd[3], cmd[4])
            self.pins_waiting.add(cmd[1])
        elif kind == "release":
            engine.release_pin(cmd[1], keep=cmd[2])
            self.pins_waiting.discard(cmd[1])
        elif kind == "unpin":
            res.unpins.append((cmd[1], engine.unpin_prefix(cmd[2], cmd[3], cmd[4], cmd[5])))
        elif kind == "reset":
            res.unpins.append((cmd[1], engine.core.reset_prefix_cache()))


__all__ = ["EngineThreadSide", "StepResult"]
