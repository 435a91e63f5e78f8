"""The prefix registry's value objects and the `PrefixStore` protocol every store implements.

A registered prefix is keyed by (model fingerprint, key): replicas serving different models or
tokenizers share one Redis without seeing each other's token ids. Its key is its name when it is
published (every tenant may name it), `<owner>/<name>` when a tenant owns it (names cannot hold "/"),
so two tenants' names never collide.
"""
from __future__ import annotations

import builtins
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

EventKind = Literal["registered", "deleted", "resync"]
SOURCE_KEYS = ("prompt", "messages", "token_ids")
PrefixKind = Literal["named", "cache_key", "cache_control"]   # by name; a prompt_cache_key's lease; a breakpoint's
Salt = tuple[tuple[int, str], ...]
"""The cache salt a prefix's blocks are hashed with: (block index, key) pairs in ascending block order, the
engine's CacheSalt (engine/kv/block_pool.py). A named prefix has one key at block 0 (or none); a lease has
the salt its request ran with: a published prefix's at block 0, then its tenant's where the prefix ends."""


@dataclass
class PrefixRecord:
    """A named prefix: what was registered (`source`) and what it tokenized to (`token_ids`).

    `block_hashes` are the hex hashes of the prefix's full KV blocks, chained from the model
    fingerprint, so another replica can check it hashes the same tokens the same way.

    `owner`: the tenant it belongs to (None: published to all). `salt`: the cache salt its blocks are
    hashed with (`Salt`; empty: unsalted), decided at registration so every replica pins the same hashes.
    `hidden_tokens`: how many leading tokens its owner may not read (a lease on a published prefix: that
    prefix's tokens; `source` then holds only the tokens after them). A lease (`ttl_seconds`) ends at
    `expires_at` (wall clock) unless a hit or an update moves it; without one the prefix lasts until deleted.
    """

    name: str
    fingerprint: str                  # model fingerprint (weights config + tokenizer), hex
    token_ids: list[int]
    source: dict[str, Any]            # {"prompt": str} | {"messages": [...]} | {"token_ids": [...]}
    block_hashes: list[str] = field(default_factory=list)
    tokenizer_version: str = ""
    description: str | None = None
    created_at: float = field(default_factory=time.time)
    owner: str | None = None
    salt: Salt = ()
    kind: PrefixKind = "named"
    ttl_seconds: float | None = None
    expires_at: float | None = None
    hidden_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("prefix name must not be empty")
        if not self.fingerprint:
            raise ValueError("prefix fingerprint must not be empty")
        if not any(key in self.source for key in SOURCE_KEYS):
            raise ValueError(f"prefix source must hold one of {SOURCE_KEYS}, got {sorted(self.source)}")

    @property
    def key(self) -> str:
        """Its key in the store (the module docstring)."""
        return self.name if self.owner is None else f"{self.owner}/{self.name}"

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def same_content(self, other: PrefixRecord) -> bool:
        """True when both records pin the same tokens for the same model (name and metadata aside)."""
        return (self.fingerprint == other.fingerprint and self.token_ids == other.token_ids
                and self.salt == other.salt)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "token_ids": builtins.list(self.token_ids),
            "source": self.source,
            "block_hashes": builtins.list(self.block_hashes),
            "tokenizer_version": self.tokenizer_version,
            "description": self.description,
            "created_at": self.created_at,
            "owner": self.owner,
            "salt": _salt_out(self.salt),
            "kind": self.kind,
            "ttl_seconds": self.ttl_seconds,
            "expires_at": self.expires_at,
            "hidden_tokens": self.hidden_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixRecord:
        """Inverse of `to_dict`; unknown keys are ignored so older replicas read newer records."""
        return cls(
            name=str(data["name"]),
            fingerprint=str(data["fingerprint"]),
            token_ids=[int(t) for t in data["token_ids"]],
            source=dict(data["source"]),
            block_hashes=[str(h) for h in data.get("block_hashes", ())],
            tokenizer_version=str(data.get("tokenizer_version", "")),
            description=data.get("description"),
            created_at=float(data.get("created_at", 0.0)),
            owner=None if data.get("owner") is None else str(data["owner"]),
            salt=_salt_in(data.get("salt")),
            kind=_kind_in(data.get("kind")),
            ttl_seconds=None if data.get("ttl_seconds") is None else float(data["ttl_seconds"]),
            expires_at=None if data.get("expires_at") is None else float(data["expires_at"]),
            hidden_tokens=int(data.get("hidden_tokens") or 0),
        )


def _salt_out(salt: Salt) -> str | list[list[Any]] | None:
    """A salt as stored: one key at block 0 as that string (what replicas before multi-part salts read), none as
    None, else the list of [block, key] pairs."""
    if not salt:
        return None
    if len(salt) == 1 and salt[0][0] == 0:
        return salt[0][1]
    return [[i, key] for i, key in salt]


def _kind_in(raw: Any) -> PrefixKind:
    """A record's kind as written; an unknown one (a newer replica's) reads as a named prefix."""
    return raw if raw in ("cache_key", "cache_control") else "named"


def _salt_in(raw: Any) -> Salt:
    if raw is None or raw == "":
        return ()
    if isinstance(raw, str):
        return ((0, raw),)
    return tuple((int(i), str(key)) for i, key in raw)


@dataclass
class ReplicaInfo:
    """One replica's heartbeat: where it listens, what it has pinned, how busy it is."""

    replica_id: str
    address: str
    pinned: list[str] = field(default_factory=list)        # names of the prefixes it has pinned
    load: dict[str, float] = field(default_factory=dict)   # e.g. {"running": 3, "waiting": 0}
    fingerprint: str = ""
    updated_at: float = field(default_factory=time.time)   # wall clock of the last heartbeat

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "address": self.address,
            "pinned": builtins.list(self.pinned),
            "load": dict(self.load),
            "fingerprint": self.fingerprint,
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaInfo:
        return cls(
            replica_id=str(data["replica_id"]),
            address=str(data["address"]),
            pinned=[str(n) for n in data.get("pinned", ())],
            load=dict(data.get("load", {})),
            fingerprint=str(data.get("fingerprint", "")),
            updated_at=float(data.get("updated_at", 0.0)),
        )


@dataclass(frozen=True)
class PrefixEvent:
    """An announcement on the registry's channel.

    `registered` / `deleted`: `origin` made the change to (`fingerprint`, `name`); a replica's own
    changes come back to it too, so consumers filter on `origin`. `name` is the record's key
    (PrefixRecord.key).

    `resync` (fingerprint, name and origin empty) is never sent by anyone: `events()` yields it
    each time its subscription is (re)established, the first time included. Announcements made
    before it may have been missed, so the consumer reconciles its pinned set with `list()`.
    NOTE: check `kind` before filtering on `fingerprint`, or resyncs are dropped.
    """

    kind: EventKind
    fingerprint: str = ""
    name: str = ""
    origin: str = ""

    @classmethod
    def resync(cls) -> PrefixEvent:
        return cls(kind="resync")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "fingerprint": self.fingerprint, "name": self.name, "origin": self.origin}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixEvent:
        """Decode a wire announcement; only `registered` and `deleted` travel on the wire."""
        kind = data["kind"]
        if kind not in ("registered", "deleted"):
            raise ValueError(f"unknown prefix event kind {kind!r}")
        return cls(
            kind=kind, fingerprint=str(data["fingerprint"]), name=str(data["name"]), origin=str(data["origin"])
        )


class PrefixStore(Protocol):
    """Async registry of named prefixes, replica heartbeats and change announcements.

    Every method except `events()` and `ping()` raises `StoreUnavailable` when the backend is down.
    Records are values: mutating one that was passed in or returned never changes the store.
    """

    async def put(self, record: PrefixRecord, origin: str) -> tuple[PrefixRecord, bool]:
        """Register `record` atomically, announcing it on success.

        Returns (record, True) when it was stored, or (the stored record, False) when one with the same
        content was already there (its metadata wins). Raises `PrefixConflict` when the name holds
        different content. Of concurrent puts of one name, exactly one ever gets created=True.
        """
        ...

    async def update(self, record: PrefixRecord, origin: str) -> bool:
        """Overwrite the record stored at `record.key` (its content may change: a lease that narrowed,
        a new expiry or description), announcing it as `registered`; False when there is none."""
        ...

    async def get(self, fingerprint: str, name: str) -> PrefixRecord | None:
        """The record at key `name` (PrefixRecord.key), None if there is none or its lease has expired."""
        ...

    async def list(self, fingerprint: str | None = None) -> builtins.list[PrefixRecord]:
        """Records of one fingerprint (None: of every fingerprint), sorted by (fingerprint, name)."""
        ...

    async def delete(self, fingerprint: str, name: str, origin: str) -> bool:
        """Remove a record atomically, announcing it; False when there was none."""
        ...

    async def heartbeat(self, info: ReplicaInfo, ttl_s: float) -> None:
        """Record that `info.replica_id` is alive for the next `ttl_s` seconds (stamps `updated_at`)."""
        ...

    async def replicas(self, fingerprint: str | None = None) -> builtins.list[ReplicaInfo]:
        """Replicas whose heartbeat has not expired, sorted by id; None: of every fingerprint."""
        ...

    def events(self) -> AsyncGenerator[PrefixEvent, None]:
        """A new subscription to announcements, own ones included; first item is a `resync`.

        Never raises backend errors: it waits for the backend to come back, then yields `resync`.
        Ends when the store is closed. It is an async generator: consume it from one task with
        `async for`; cancelling a pending `anext()` (e.g. by `asyncio.wait_for`) ends it.
        """
        ...

    async def ping(self) -> bool:
        """True when the backend answers; never raises."""
        ...

    async def aclose(self) -> None:
        """End every `events()` iterator and release the backend (the injected client included)."""
        ...
