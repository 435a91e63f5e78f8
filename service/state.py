"""ServiceState: what the handlers share (the config, the engine once it is loaded, the registry, the drain
flag), and `ready()`: everything a request needs of it, taken in one call, or the 503 that says why not."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from service.config import ServiceConfig
from service.errors import ApiError
from service.token_text import TokenText
from service.tokenizer_threads import TokenizerThreads

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from prefix_store.registry import PrefixRegistry


@dataclass(frozen=True)
class Ready:
    """A ready service, as one request sees it."""

    engine: AsyncEngine
    registry: PrefixRegistry | None       # None only between the engine's start and the first resync
    config: ServiceConfig
    model_name: str
    executor: ThreadPoolExecutor          # the tokenizer thread (the small bodies' lane of `tokenizers`)
    token_text: TokenText                 # token id -> text and bytes, for logprobs
    tokenizers: TokenizerThreads          # both lanes: small bodies, large ones (service/tokenizer_threads.py)


@dataclass
class ServiceState:
    config: ServiceConfig
    engine: AsyncEngine | None = None     # None while the model loads (warming)
    load_error: str | None = None         # set when loading the model failed
    draining: bool = False                # SIGTERM received: finish running streams, take no new ones
    in_flight: int = 0                    # handlers running (service/app.py counts them, for the drain)
    registry: PrefixRegistry | None = None  # set with the engine, once every registered prefix is warm
    tokenizers: TokenizerThreads = field(init=False, repr=False)
    _token_text: TokenText | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.tokenizers = TokenizerThreads(self.config.large_body_bytes)

    @property
    def tokenizer_executor(self) -> ThreadPoolExecutor:
        """The tokenizer thread: small bodies' lane, with the engine's tokenizer."""
        return self.tokenizers.small

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.engine.model_name if self.engine is not None else ""

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    def ready(self) -> Ready:
        """What a request needs, or a 503 while warming, draining or dead."""
        engine = self.ready_engine()
        if self._token_text is None:
            self._token_text = TokenText(engine.tokenizer)
        return Ready(engine, self.registry, self.config, self.model_name, self.tokenizer_executor, self._token_text,
                     self.tokenizers)

    def ready_engine(self) -> AsyncEngine:
        """The engine, or a 503 while warming, draining or dead."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable", code="draining")
        if self.engine is None:
            if self.load_error is not None:
                raise ApiError(503, f"the model failed to load: {self.load_error}",
                               type="service_unavailable", code="load_failed")
            raise ApiError(503, "the model is still loading; retry shortly", type="service_unavailable",
                           code="warming", headers={"Retry-After": "1"})
        if not self.engine.is_running:
            raise ApiError(503, "the engine is not running", type="service_unavailable", code="engine_dead")
        return self.engine


STATE = web.AppKey("state", ServiceState)
