"""The Responses API's store: what `previous_response_id` and GET /v1/responses/{id} read.

In memory, per replica, lost on restart; bounded in count and in bytes (`--response-store-max`,
`--response-store-bytes`), and shared between tenants. A stored response is readable only with the key that
created it (another key gets the 404 of a missing one); it counts against its tenant's share.

Shares (max-min fair): each tenant's responses are kept in least-recently-used order; when one more puts the
store over a bound, the least recently used response of the tenant that holds the most of that bound goes
(the newcomer's tenant on a tie). So a tenant that holds no more than another never loses a response to that
other's requests: one key's flood evicts its own, and the others' GET and previous_response_id keep working.

NOTE: shares are per tenant, not per key: keys of one tenant (`--tenant-keys`) share its share, and callers
without a key where none is needed are one tenant, since they can present as many different keys as they
like (per key, one of them could hold every share).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass
class Stored:
    owner: str                          # the creating key's digest ("" without keys): who may read it
    tenant: str                         # whose share it counts against ("" without keys)
    response: dict[str, Any]            # as returned
    conversation: list[dict[str, Any]]  # chat messages: its input (after previous ones), then its output
    size: int


class ResponseStore:
    """Owned by the event loop. Why this structure: an OrderedDict per tenant gives O(1) use (move to the end)
    and O(1) eviction of a tenant's least recently used; finding the tenant that holds the most is a scan
    over tenants, which are few (configured keys) and scanned only when the store is full."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._where: dict[str, str] = {}      # response id -> its tenant
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._where)

    def held(self, tenant: str) -> tuple[int, int]:
        """The responses and bytes `tenant` holds."""
        return len(self._tenants.get(tenant, ())), self._tenant_bytes.get(tenant, 0)

    def get(self, rid: str, owner: str) -> Stored | None:
        tenant = self._where.get(rid)
        if tenant is None or self._tenants[tenant][rid].owner != owner:
            return None
        self._tenants[tenant].move_to_end(rid)
        return self._tenants[tenant][rid]

    def put(self, rid: str, item: Stored) -> None:
        if item.size > self.max_bytes:
            return                      # larger than the whole store: not kept (GET says 404)
        if rid in self._where:
            self._forget(rid)
        self._tenants.setdefault(item.tenant, OrderedDict())[rid] = item
        self._where[rid] = item.tenant
        self._tenant_bytes[item.tenant] = self._tenant_bytes.get(item.tenant, 0) + item.size
        self.bytes += item.size
        while len(self._where) > self.max_items:
            self._evict(max(self._tenants, key=lambda t: (len(self._tenants[t]), t == item.tenant)))
        while self.bytes > self.max_bytes:
            self._evict(max(self._tenants, key=lambda t: (self._tenant_bytes[t], t == item.tenant)))

    def delete(self, rid: str, owner: str) -> bool:
        if self.get(rid, owner) is None:
            return False
        self._forget(rid)
        return True

    def _evict(self, tenant: str) -> None:
        self._forget(next(iter(self._tenants[tenant])))

    def _forget(self, rid: str) -> None:
        tenant = self._where.pop(rid)
        item = self._tenants[tenant].pop(rid)
        self._tenant_bytes[tenant] -= item.size
        self.bytes -= item.size
        if not self._tenants[tenant]:
            del self._tenants[tenant], self._tenant_bytes[tenant]


STORE = web.AppKey("response_store", ResponseStore)
