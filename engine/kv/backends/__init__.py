"""KV backends by name: the registry the engine resolves `EngineConfig.kv_backend` through.

    paged       PagedAttention: blocks of block_size tokens, block tables           (paged/)
    vattention  vAttention: each sequence virtually contiguous, pages mapped on demand (vattention/)

Adding a backend is a new folder plus one line in BACKENDS below:
  1. `engine/kv/backends/<name>/cache.py`: the cache, implementing `KVStore` (base.py): its tensors per
     layer, `addressing` (where a step's tokens live: block tables or slots), `copy_blocks`, `placement`,
     `ahead_tokens`, `stats`, `close`;
  2. `engine/kv/backends/<name>/__init__.py`: `BACKEND = KVBackend(name, create, attention, block_size)`,
     the factory, the kernels that read this cache (kernels/) and the block-size rule;
  3. its name in BACKENDS (a test may instead `register()` one for the length of the test).
The core, the scheduler, the service and the metrics never name a backend: metrics export whatever
`stats` returns as `prefixserve_<backend>_<name>`.

NOTE: this module imports nothing heavy; a backend's package is imported when the backend is asked for.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.backends.base import KVBackend

BACKENDS: dict[str, str] = {
    "paged": "engine.kv.backends.paged",
    "vattention": "engine.kv.backends.vattention",
}
_extra: dict[str, KVBackend] = {}          # registered at run time (tests)


def names() -> tuple[str, ...]:
    return (*BACKENDS, *_extra)


def get(name: str) -> KVBackend:
    if name in _extra:
        return _extra[name]
    if name not in BACKENDS:
        raise ValueError(f"unknown KV backend {name!r}; choose one of {names()}")
    backend: KVBackend = importlib.import_module(BACKENDS[name]).BACKEND
    return backend


def register(backend: KVBackend) -> None:
    """Adds a backend under its name (the built-in ones cannot be replaced)."""
    if backend.name in BACKENDS:
        raise ValueError(f"KV backend {backend.name!r} is built in")
    _extra[backend.name] = backend


def unregister(name: str) -> None:
    _extra.pop(name, None)


__all__ = ["BACKENDS", "get", "names", "register", "unregister"]
