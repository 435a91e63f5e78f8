"""ServiceConfig: every service knob in one validated dataclass, passed explicitly."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig


@dataclass
class ServiceConfig:
    model: str | None = None                 # checkpoint directory; None = built-in demo model
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_model_len: int | None = None
    attention_backend: str | None = None
    max_num_waiting: int = 1024
    redis_url: str | None = None             # None: embedded prefix store (wired by the prefix registry)
    served_model_name: str | None = None     # None: the engine's model name
    shutdown_timeout: float = 30.0           # SIGTERM: how long running streams may finish before abort
    keepalive_interval: float = 5.0          # SSE comment after this many idle seconds
    max_body_bytes: int = 4 * 2**20          # larger request bodies get 413
    max_choices: int = 128                   # prompts x n per request
    max_ws_generations: int = 64             # concurrent generations per WebSocket

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (0 <= self.port <= 65535, f"port must be within [0, 65535], got {self.port}"),
            (bool(self.host), "host must not be empty"),
            (self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"),
            (self.keepalive_interval > 0, "keepalive_interval must be > 0"),
            (self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024"),
            (self.max_choices >= 1, "max_choices must be >= 1"),
            (self.max_ws_generations >= 1, "max_ws_generations must be >= 1"),
            (self.served_model_name is None or bool(self.served_model_name.strip()),
             "served_model_name must not be blank"),
            (self.redis_url is None or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
             f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.engine_config()  # engine knobs are validated by the engine's own dataclass

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, device=self.device,
            dtype=self.dtype, attention_backend=self.attention_backend, max_num_waiting=self.max_num_waiting)
