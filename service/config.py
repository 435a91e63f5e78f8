"""ServiceConfig: every service knob in one validated dataclass, holding the engine's EngineConfig.

One tree: `ServiceConfig.engine` is the EngineConfig the service builds its engine from. Flags and
PREFIXSERVE_* variables are generated from both dataclasses' fields (service/flags.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engine.config import EngineConfig, knob


@dataclass
class ServiceConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(8000, "port to listen on")
    redis_url: str | None = knob(None, "Redis for the prefix registry, redis:// rediss:// or unix:// "
                                       "(default: an embedded store)")
    served_model_name: str | None = knob(None, "model name in the API (default: the checkpoint's)")
    shutdown_timeout: float = knob(30.0, "seconds running streams may finish after SIGTERM")
    keepalive_interval: float = knob(5.0, "SSE comment after this many idle seconds")
    max_body_bytes: int = knob(4 * 2**20, "larger request bodies get 413")
    max_choices: int = knob(128, "most prompts x n (and x best_of) per request")
    max_ws_generations: int = knob(64, "most concurrent generations per WebSocket")
    max_prefixes: int = knob(1024, "most registered prefixes (per model); beyond it registrations get 507")
    keepalive_timeout: float = knob(30.0, "seconds an idle connection, or one whose request headers never "
                                          "complete, is kept open")
    body_timeout: float = knob(30.0, "seconds a request body may take to arrive (then 408)")

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (0 <= self.port <= 65535, f"port must be within [0, 65535], got {self.port}"),
            (bool(self.host), "host must not be empty"),
            (self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"),
            (self.keepalive_interval > 0, "keepalive_interval must be > 0"),
            (self.keepalive_timeout > 0, "keepalive_timeout must be > 0"),
            (self.body_timeout > 0, "body_timeout must be > 0"),
            (self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024"),
            (self.max_choices >= 1, "max_choices must be >= 1"),
            (self.max_prefixes >= 1, "max_prefixes must be >= 1"),
            (self.max_ws_generations >= 1, "max_ws_generations must be >= 1"),
            (self.served_model_name is None or bool(self.served_model_name.strip()),
             "served_model_name must not be blank"),
            (self.redis_url is None or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
             f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_flat(cls, **values: Any) -> ServiceConfig:
        """A config from one flat set of knobs (`model=..., port=...`): each goes to the dataclass that
        declares it. Raises TypeError for a name neither declares, ValueError for a bad value."""
        engine_names = {f.name for f in fields(EngineConfig)}
        service_names = {f.name for f in fields(cls)} - {"engine"}
        unknown = set(values) - engine_names - service_names
        if unknown:
            raise TypeError(f"unknown config knobs: {sorted(unknown)}")
        engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
        return cls(engine=engine, **{k: v for k, v in values.items() if k in service_names})
