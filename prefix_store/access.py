"""Who may see what of a named prefix: the one rule that every read path of the registry goes through.

Resolution (`keys_for`): a name means, to a caller, its own tenant's prefix of that name (key
`<owner>/<name>`), else the published one (key `<name>`); an admin names another tenant's with `tenant`.
A name is checked against NAME_RE first: it holds no "/", so it never reaches into another tenant's keys
(`acme/secret`, or `acme%2Fsecret` in a URL, is a name nobody registered).

Reading (`hidden_tokens`): an admin reads all of a prefix; a tenant reads all of its own, but a lease's
head (the tokens of a published prefix its request named: `PrefixRecord.hidden_tokens`), and none of a
published prefix's tokens; another tenant's prefix does not exist for it (None). The registry answers
PrefixNotFound for those, with the same status and message as for a name nobody registered, on every
path: GET, PATCH and DELETE, a request naming it (generation, render, echo, logprobs), leases, and the
metrics (which label a tenant's prefixes by a keyed digest, service/middleware/metrics.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from prefix_store.base import PrefixRecord

NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")    # no "/", no "." or ".." alone
NAME_PATTERN = f"^{NAME_RE.pattern}$"           # the same, for the request schemas (pydantic's `$` is the end)


@dataclass(frozen=True)
class Reader:
    """Whose view: a tenant (None: no keys, one tenant for everyone) and whether it is an admin's."""

    owner: str | None
    admin: bool

    @property
    def tenant_view(self) -> Reader:
        """The same tenant without admin rights: what its leases may record (any key of it may read them)."""
        return Reader(self.owner, admin=False)


def valid_name(name: str) -> bool:
    return NAME_RE.fullmatch(name) is not None


def keys_for(name: str, reader: Reader, tenant: str | None = None) -> list[str]:
    """The store keys `name` may mean to `reader`, in the order they are tried (none for a name that is not
    one). `tenant`: another tenant's prefix, for an admin only."""
    if not valid_name(name):
        return []
    if tenant is not None:
        return [f"{tenant}/{name}"] if reader.admin else []
    return ([f"{reader.owner}/{name}"] if reader.owner is not None else []) + [name]


def hidden_tokens(record: PrefixRecord, reader: Reader) -> int | None:
    """How many of the prefix's leading tokens `reader` may not read; None: it may not know the prefix exists."""
    if reader.admin:
        return 0
    if record.owner is None:
        return len(record.token_ids)
    if record.owner != reader.owner:
        return None
    return min(record.hidden_tokens, len(record.token_ids))
