"""What a replica holds of the prefix registry: the engine's face it pins through (`Pinner`), its local view's
entries (`LocalPrefix`) and what a request copies out of them (`PrefixSnapshot`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from prefix_store.base import PrefixRecord, Salt


class Pinned(Protocol):
    @property
    def num_pinned_blocks(self) -> int: ...

    @property
    def block_hashes(self) -> list[str]: ...


class Load(Protocol):
    @property
    def requests_running(self) -> int: ...

    @property
    def requests_waiting(self) -> int: ...


class Pinner(Protocol):
    """What the registry needs of the engine (the AsyncEngine is one): pins, and what it serves."""

    fingerprint: str
    tokenizer_version: str
    block_size: int
    max_model_len: int
    model_name: str

    async def pin_prefix(self, token_ids: list[int], salt: tuple[tuple[int, str], ...] = (),
                         tenant: str = "") -> Pinned: ...

    async def unpin_prefix(self, token_ids: list[int], salt: tuple[tuple[int, str], ...] = (),
                           tenant: str = "", forget: bool = False) -> int: ...

    def stats(self) -> Load: ...


@dataclass(frozen=True)
class PrefixSnapshot:
    """What a request needs of a registered prefix, copied out of the local view (on the event loop) for
    the tokenizer thread: immutable, so the registry may change meanwhile."""

    name: str
    token_ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...] | None      # its source, when it was registered with messages
    key: str = ""                                    # PrefixRecord.key: what its use is counted under
    salt: Salt = ()                                  # its blocks' cache salt (PrefixRecord.salt)
    hidden: int = 0         # its leading tokens the caller may not read (prefix_store/access.py)
    foreign: int = 0        # ... its caller's tenant may not read: what a lease of the request may not record


def salt_of(record: PrefixRecord) -> Salt:
    """The engine's cache salt (block_pool.CacheSalt) a record's blocks are hashed with."""
    return record.salt


def tenant_of(record: PrefixRecord) -> str:
    """Whose pin a record's is, for the engine (its share of the pin cap): its owner, "" for a published one."""
    return record.owner or ""


@dataclass
class LocalPrefix:
    record: PrefixRecord
    pinned_blocks: int = 0
    hit_requests: int = 0
    tokens_saved: int = 0
