"""The prefix registry's domain errors. The registry raises them; service/errors.py maps them to HTTP
(with the prefix store's PrefixConflict and StoreUnavailable)."""
from __future__ import annotations


class RegistryError(Exception):
    """A registry operation refused; `param` names the offending request field."""

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
