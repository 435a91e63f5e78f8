"""ServiceConfig: every service knob in one validated dataclass, holding the engine's EngineConfig.

One tree: `ServiceConfig.engine` is the EngineConfig the service builds its engine from. Flags and
PREFIXSERVE_* variables are generated from both dataclasses' fields (service/flags.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config import EngineConfig, knob

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# A key is an RFC 7230 token: browsers send it as a WebSocket subprotocol, which must be one.
_KEY_RE = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")
_ORIGIN_RE = re.compile(r"https?://[a-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9a-f:.]+\](:[0-9]{1,5})?")


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
    strict_fields: bool = knob(False, "refuse request fields this server does not know with a 400 (default: "
                                      "accept them, ignored, and name them in a warning and X-Ignored-Fields)")
    max_echo_logprobs: int = knob(262_144, "most prompt log-probabilities one completion with echo and logprobs "
                                           "returns: prompt tokens x n x (logprobs + 1); more get a 400")
    max_ws_generations: int = knob(64, "most concurrent generations per WebSocket")
    max_prefixes: int = knob(1024, "most registered prefixes (per model); beyond it registrations get 507")
    keepalive_timeout: float = knob(30.0, "seconds an idle connection, or one whose request headers never "
                                          "complete, is kept open")
    body_timeout: float = knob(30.0, "seconds a request body may take to arrive (then 408)")
    api_key: tuple[str, ...] = knob((), "API keys, comma-separated: every endpoint but /health (and the demo "
                                        "page's files) then needs `Authorization: Bearer <key>`")
    admin_key: tuple[str, ...] = knob((), "admin keys, comma-separated: then required for registry writes and "
                                          "to read a prefix's source; an admin key is also an API key")
    metrics_require_key: bool = knob(True, "/metrics needs a key like the API (with --api-key set)")
    allowed_origins: tuple[str, ...] = knob((), "web origins allowed cross-origin (CORS) and on the WebSocket, "
                                                "comma-separated, e.g. https://app.example.com; * for any")
    log_format: str = knob("text", "log lines as text or as one JSON object each", LOG_FORMATS)
    log_level: str = knob("info", "least severe level logged (access lines are info)", LOG_LEVELS)

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
            (self.max_echo_logprobs >= 1, "max_echo_logprobs must be >= 1"),
            (self.max_prefixes >= 1, "max_prefixes must be >= 1"),
            (self.max_ws_generations >= 1, "max_ws_generations must be >= 1"),
            (self.served_model_name is None or bool(self.served_model_name.strip()),
             "served_model_name must not be blank"),
            (self.redis_url is None or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
             f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"),
            (self.log_format in LOG_FORMATS, f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}"),
            (self.log_level in LOG_LEVELS, f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}"),
        ]
        for name in ("api_key", "admin_key"):
            checks += [(_KEY_RE.fullmatch(k) is not None, f"{name}: a key must be letters, digits or "
                        "!#$%&'*+-.^_`|~ (it may travel as a WebSocket subprotocol)") for k in getattr(self, name)]
        self.allowed_origins = tuple(o.lower().rstrip("/") for o in self.allowed_origins)
        checks += [(o == "*" or _ORIGIN_RE.fullmatch(o) is not None, f"allowed_origins: {o!r} is not an "
                    "origin (scheme://host[:port], or *)") for o in self.allowed_origins]
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
