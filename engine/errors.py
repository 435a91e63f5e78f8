"""Errors the engine raises at its boundary; the service maps each to one HTTP status."""
from __future__ import annotations


class EngineError(Exception):
    """Base class. `param` names the offending request field, when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(EngineError, ValueError):
    """Bad sampling parameters or a prompt that can never fit (HTTP 400)."""


class QueueFull(EngineError):
    """The waiting queue is at `max_num_waiting` (HTTP 429)."""


class CapacityExceeded(EngineError):
    """An admitted request can no longer fit the KV cache (pins took the room meanwhile) (HTTP 429)."""


class KVRefused(EngineError):
    """The KV backend cannot hold these sequences' KV in this step (HTTP 507): a limit of its own, such as
    the vattention backend's memory mappings. Nothing of the step ran: their requests end with this error
    and the other sequences run in the next step."""

    def __init__(self, message: str, seq_ids: list[int]) -> None:
        super().__init__(message)
        self.seq_ids = frozenset(seq_ids)


class PinCapExceeded(EngineError):
    """Pinning would exceed the pinned-block cap; nothing was pinned (HTTP 507)."""


class EngineDead(EngineError):
    """The engine loop has stopped (HTTP 503)."""
