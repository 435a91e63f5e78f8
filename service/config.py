"""ServiceConfig: every service knob in one validated dataclass, holding the engine's EngineConfig.

One tree: `ServiceConfig.engine` is the EngineConfig the service builds its engine from. Flags and
PREFIXSERVE_* variables are generated from both dataclasses' fields (service/flags.py).
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config import EngineConfig, knob

LOG_FORMATS = ("text", "json")
CACHE_ISOLATION = ("tenant", "shared")
_TENANT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
LOG_LEVELS = ("debug", "info", "warning", "error")
# A key is an RFC 7230 token: browsers send it as a WebSocket subprotocol, which must be one.
_KEY_RE = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")
_HOST_PATTERN_RE = re.compile(r"\*|[a-z0-9*\-]{1,63}(\.[a-z0-9*\-]{1,63})*")
_ORIGIN_RE = re.compile(r"https?://[a-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9a-f:.]+\](:[0-9]{1,5})?")


def is_address(text: str) -> bool:
    """An IPv4 or IPv6 address (no brackets, no port)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


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
    max_prompt_chars: int = knob(2**20, "most characters of text one request may have tokenized (its prompts, or "
                                        "its messages' contents, together); more gets 400 before any tokenizing")
    large_body_bytes: int = knob(64 * 1024, "request bodies this large or larger are parsed and tokenized on a "
                                            "thread of their own, so that small requests never wait behind them")
    strict_fields: bool = knob(False, "refuse request fields this server does not know with a 400 (default: "
                                      "accept them, ignored, and name them in a warning and X-Ignored-Fields)")
    max_echo_logprobs: int = knob(262_144, "most prompt log-probabilities one completion with echo and logprobs "
                                           "returns: prompt tokens x n x (logprobs + 1); more get a 400")
    max_ws_generations: int = knob(64, "most concurrent generations per WebSocket")
    max_ws_per_client: int = knob(16, "most WebSockets one client holds open at once (a client: its API key, or "
                                      "its address without keys); beyond it the upgrade gets 429")
    ws_idle_timeout: float = knob(300.0, "seconds a WebSocket with no generation running and no frame from the "
                                         "client stays open; then it is closed with code 4408")
    write_timeout: float = knob(30.0, "seconds a client may leave a streamed answer unread (an SSE event or a "
                                      "WebSocket frame waiting for room); then its generation is aborted and "
                                      "the connection closed")
    max_prefixes: int = knob(1024, "most registered prefixes (per model); beyond it registrations get 507")
    keepalive_timeout: float = knob(30.0, "seconds an idle connection, or one whose request headers never "
                                          "complete, is kept open")
    body_timeout: float = knob(30.0, "seconds a request body may take to arrive (then 408)")
    api_key: tuple[str, ...] = knob((), "API keys, comma-separated: every endpoint but /health (and the demo "
                                        "page's files) then needs `Authorization: Bearer <key>`")
    admin_key: tuple[str, ...] = knob((), "admin keys, comma-separated: then required for registry writes and "
                                          "to read a prefix's source; an admin key is also an API key")
    tenant_keys: tuple[str, ...] = knob((), "named tenants, comma-separated NAME:KEY pairs: keys that share a "
                                            "NAME are one tenant (one cache, one set of named prefixes); every "
                                            "other key is a tenant of its own. Each KEY is also an API key")
    cache_isolation: str = knob("tenant", "with keys, whether each tenant's prompts are a miss for the others in "
                                          "the prefix cache (tenant) or all share one cache (shared)",
                                CACHE_ISOLATION)
    max_prefixes_per_tenant: int = knob(64, "most prefixes one tenant may keep registered (prompt_cache_key "
                                            "leases included); beyond it 507")
    max_lease_seconds: float = knob(7 * 86400.0, "longest ttl_seconds a prefix lease may ask for")
    prompt_cache_ttl: float = knob(600.0, "seconds a prompt_cache_key lease lasts after its last hit, for "
                                          "prompt_cache_retention in_memory (the default); 24h leases last 86400")
    response_store_max: int = knob(1024, "most stored Responses (store: true) one replica keeps, shared between "
                                          "tenants (service/openai/responses/api.py)")
    response_store_bytes: int = knob(64 * 2**20, "most bytes of stored Responses (and their conversations) one "
                                                 "replica keeps, shared between tenants")
    metrics_require_key: bool = knob(True, "/metrics needs a key like the API (with --api-key set)")
    allowed_origins: tuple[str, ...] = knob((), "web origins allowed cross-origin (CORS) and on the WebSocket, "
                                                "comma-separated, e.g. https://app.example.com; * for any")
    allowed_hosts: tuple[str, ...] = knob((), "host names this server answers to (the Host header), comma-separated, "
                                              "beyond localhost, IP addresses and --host; a * stands for one "
                                              "label (prefixserve-engine-*, *.example.com); * alone for any. "
                                              "Other names get 421 (DNS rebinding)")
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
            (self.max_prompt_chars >= 1, "max_prompt_chars must be >= 1"),
            (self.large_body_bytes >= 1, "large_body_bytes must be >= 1"),
            (self.max_echo_logprobs >= 1, "max_echo_logprobs must be >= 1"),
            (self.max_prefixes >= 1, "max_prefixes must be >= 1"),
            (self.max_ws_generations >= 1, "max_ws_generations must be >= 1"),
            (self.max_prefixes_per_tenant >= 1, "max_prefixes_per_tenant must be >= 1"),
            (self.max_lease_seconds >= 1, "max_lease_seconds must be >= 1"),
            (1 <= self.prompt_cache_ttl <= self.max_lease_seconds,
             "prompt_cache_ttl must be within [1, max_lease_seconds]"),
            (self.response_store_max >= 1, "response_store_max must be >= 1"),
            (self.response_store_bytes >= 1024, "response_store_bytes must be >= 1024"),
            (self.cache_isolation in CACHE_ISOLATION,
             f"cache_isolation must be one of {CACHE_ISOLATION}, got {self.cache_isolation!r}"),
            (self.max_ws_per_client >= 1, "max_ws_per_client must be >= 1"),
            (self.ws_idle_timeout > 0, "ws_idle_timeout must be > 0"),
            (self.write_timeout > 0, "write_timeout must be > 0"),
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
        for pair in self.tenant_keys:
            name, _, key = pair.partition(":")
            checks.append((_TENANT_RE.fullmatch(name) is not None and _KEY_RE.fullmatch(key) is not None,
                           "tenant_keys: each entry is NAME:KEY, NAME of letters, digits, _ or - (at most 64), "
                           "KEY as for api_key"))
        self.allowed_origins = tuple(o.lower().rstrip("/") for o in self.allowed_origins)
        checks += [(o == "*" or _ORIGIN_RE.fullmatch(o) is not None, f"allowed_origins: {o!r} is not an "
                    "origin (scheme://host[:port], or *)") for o in self.allowed_origins]
        self.allowed_hosts = tuple(h.lower().rstrip(".") for h in self.allowed_hosts)
        checks += [(_HOST_PATTERN_RE.fullmatch(h) is not None or is_address(h.strip("[]")),
                    f"allowed_hosts: {h!r} is not a host name, an address, a pattern with * for a label, or *")
                   for h in self.allowed_hosts]
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
