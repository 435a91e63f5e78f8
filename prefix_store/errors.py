"""The named-prefix domain's errors: one base, raised by the stores and the registry alike.
service/errors.py maps each to its HTTP answer (the status in each docstring)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefix_store.base import PrefixRecord


class RegistryError(Exception):
    """A registry or store operation refused; `param` names the offending request field, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PrefixNotFound(RegistryError):
    """No prefix of that name is registered for this model (HTTP 404)."""


class RegistryFull(RegistryError):
    """As many prefixes are registered as the server keeps (HTTP 507)."""


class InvalidPrefix(RegistryError):
    """The prefix itself cannot be registered: empty, too long for the model (HTTP 400)."""


class PrefixConflict(RegistryError):
    """The name is taken by a prefix with different content (HTTP 409). `existing` is the stored one."""

    def __init__(self, existing: PrefixRecord) -> None:
        super().__init__(f"prefix {existing.name!r} is already registered with different content "
                         f"({len(existing.token_ids)} tokens); delete it first to replace it", param="name")
        self.existing = existing


class PrefixForbidden(RegistryError):
    """The caller may not do this to that prefix: change a published one without an admin key (HTTP 403)."""


class StoreUnavailable(RegistryError):
    """The store cannot be reached or did not answer in time (HTTP 503); the caller may retry."""
