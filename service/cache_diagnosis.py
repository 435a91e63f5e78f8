"""Prompt-cache miss diagnosis: why a request read less from the cache than an earlier one left there.

OpenAI's `prompt_cache_options.comparison_response_id` (Responses API) and Anthropic's `diagnostics.previous_message_id`
(Messages API) name an earlier answer; this module keeps a fingerprint of each answer that may be compared
against later, and compares. A fingerprint holds no text and no token ids:

    model, salt        the served model's name; a digest of the caller's cache salt (tenant + cache_salt)
    sections           one digest each of the tools, the system prompt (instructions), and every message
    blocks             chained digests of the prompt's full KV blocks (keyed by a secret of this process,
                       so they cannot be tested against a guessed prompt offline)
    holds              the leases the request made (cache_control breakpoints, a pre-warm)

The comparison names the FIRST difference in the order the prompt is laid out (model, tools, system, the
messages in turn), and counts the missed tokens exactly: of the earlier prompt's full blocks that this
one could have read (its own prompt minus the last token, in whole blocks), those past the first block
that differs. When nothing differs but the cache still gave less, the entry was gone: `expired` when a
lease the earlier request made has ended, `evicted` otherwise (the LRU needed the blocks).

    tokens:   | same blocks (read) | first differing block ...                     |
    earlier:  |====================|xxxxxxxxxxxxxxxxxxxxxxxxxxx|                      missed = would - common
                                   ^ common                    ^ would (what this one could have read)

A fingerprint is its caller's: a lookup with another key finds nothing ("not found"), exactly as for an id
that never existed, so nothing of another key's requests shows. The store is bounded (count and bytes),
least recently used out first, in this replica's memory: an id from another replica or before a restart is
"not found" too.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

from service.middleware.auth import presented_key

if TYPE_CHECKING:
    from prefix_store.registry import PrefixRegistry
    from service.openai.pipeline import Prepared

FINGERPRINTS_MAX = 4096              # answers kept for comparison, per replica
FINGERPRINTS_BYTES = 32 * 2**20      # and their digests, in all
_DIGEST = 16

Reason = Literal["not_found", "model", "salt", "tools", "system", "message", "expired", "evicted", "hit",
                 "unavailable"]


@dataclass(frozen=True)
class Fingerprint:
    owner: str                        # the key's digest that made it ("" without keys)
    model: str
    salt: bytes                       # digest of the caller's cache salt
    tools: bytes
    system: bytes
    messages: tuple[bytes, ...]
    blocks: tuple[bytes, ...]         # chained digests of the prompt's full blocks
    num_tokens: int
    block_size: int
    holds: tuple[str, ...] = ()       # lease keys the request made

    @property
    def size(self) -> int:
        return _DIGEST * (len(self.messages) + len(self.blocks) + 3) + sum(len(h) for h in self.holds) + 128


@dataclass(frozen=True)
class Diagnosis:
    reason: Reason
    missed: int = 0                   # tokens the earlier request left that this one did not read
    message_index: int | None = None  # reason "message": the first message that differs
    reusable: int = 0                 # tokens of the earlier prompt this one could have read had it matched


def digest(value: Any) -> bytes:
    """A digest of a JSON-able value (a section of a request)."""
    return hashlib.blake2b(json.dumps(value, sort_keys=True, ensure_ascii=False).encode(), digest_size=_DIGEST).digest()


class FingerprintStore:
    """Bounded, least recently used first out; owned by the event loop."""

    def __init__(self, max_items: int = FINGERPRINTS_MAX, max_bytes: int = FINGERPRINTS_BYTES) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, Fingerprint] = OrderedDict()
        self.bytes = 0
        self._secret = os.urandom(16)     # block digests are keyed: they never leave this process either

    def __len__(self) -> int:
        return len(self._items)

    def blocks(self, token_ids: list[int], block_size: int, salt: str | None) -> tuple[bytes, ...]:
        """Chained, keyed digests of the full blocks of `token_ids` (block i covers tokens [iB, (i+1)B))."""
        out: list[bytes] = []
        parent = hashlib.blake2b((salt or "").encode(), key=self._secret, digest_size=_DIGEST).digest()
        for start in range(0, len(token_ids) // block_size * block_size, block_size):
            chunk = ",".join(map(str, token_ids[start:start + block_size])).encode()
            parent = hashlib.blake2b(parent + chunk, key=self._secret, digest_size=_DIGEST).digest()
            out.append(parent)
        return tuple(out)

    def salt(self, salt: str | None) -> bytes:
        return hashlib.blake2b((salt or "").encode(), key=self._secret, digest_size=_DIGEST).digest()

    def put(self, rid: str, fp: Fingerprint) -> None:
        if rid in self._items:
            self.bytes -= self._items.pop(rid).size
        self._items[rid] = fp
        self.bytes += fp.size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, rid: str, owner: str) -> Fingerprint | None:
        """The fingerprint of `rid` if `owner` made it; None otherwise (missing and not yours look the same)."""
        fp = self._items.get(rid)
        if fp is None or fp.owner != owner:
            return None
        self._items.move_to_end(rid)
        return fp


def compare(prev: Fingerprint | None, cur: Fingerprint, cached_tokens: int, live: set[str]) -> Diagnosis:
    """Why `cur` (which read `cached_tokens` from the cache) did not read what `prev` left; `live`: the lease
    keys that still hold (for expired against evicted). See the module docstring."""
    if prev is None:
        return Diagnosis("not_found")
    b = cur.block_size
    would = min(prev.num_tokens // b * b, max(cur.num_tokens - 1, 0) // b * b)
    common = 0
    for x, y in zip(prev.blocks, cur.blocks):
        if x != y:
            break
        common += b
    if prev.model != cur.model:
        return Diagnosis("model", would, reusable=would)
    if prev.salt != cur.salt:
        return Diagnosis("salt", would, reusable=would)
    missed = max(0, would - common)
    if missed:
        if prev.tools != cur.tools:
            return Diagnosis("tools", missed, reusable=would)
        if prev.system != cur.system:
            return Diagnosis("system", missed, reusable=would)
        index = next((i for i, (x, y) in enumerate(zip(prev.messages, cur.messages)) if x != y),
                     min(len(prev.messages), len(cur.messages)))
        if index < len(prev.messages):
            return Diagnosis("message", missed, index, reusable=would)
        return Diagnosis("unavailable", missed, reusable=would)     # the same request rendered otherwise
    if cached_tokens < would:
        gone = any(key not in live for key in prev.holds)
        return Diagnosis("expired" if gone else "evicted", would - cached_tokens, reusable=would)
    return Diagnosis("hit", 0, reusable=would)


def owner_of(request: web.Request) -> str:
    """Whose fingerprints a request reads and writes: its key's (as stored responses are)."""
    key = presented_key(request)
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def live_leases(registry: PrefixRegistry | None) -> set[str]:
    now = time.time()
    return set() if registry is None else {k for k, e in registry.local.items() if not e.record.expired(now)}


def fingerprint(store: FingerprintStore, owner: str, prepared: Prepared, tools: Any, system: Any,
                messages: list[Any]) -> Fingerprint:
    """A finished request's fingerprint (its leases known: wait for them first)."""
    salt = prepared.caller.salt(prepared.req.cache_salt)
    prompt, block = prepared.prompts[0], prepared.ready.engine.block_size
    return Fingerprint(owner, prepared.ready.model_name, store.salt(salt), digest(tools), digest(system),
                       tuple(digest(m) for m in messages), store.blocks(prompt, block, salt), len(prompt), block,
                       tuple(k for k in prepared.held if k is not None))


FINGERPRINTS = web.AppKey("cache_fingerprints", FingerprintStore)


def setup(app: web.Application) -> None:
    app[FINGERPRINTS] = FingerprintStore()
