"""Principals: who is calling. Sessions and listens are bound to the principal that opened them."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from broker.config import Settings

__all__ = ["Principal", "Unauthorized", "authenticate"]


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    subject: str

    @property
    def key(self) -> str:
        """The binding stored on a session: ``<tenant>/<subject>``."""
        return f"{self.tenant}/{self.subject}"


class Unauthorized(Exception):
    """No valid credentials were presented (HTTP 401)."""


def authenticate(settings: Settings, authorization: str | None) -> Principal:
    """The principal for an ``Authorization`` header.

    With no API keys configured every caller is the anonymous principal of the default tenant.

    Raises:
        Unauthorized: keys are configured and the header does not carry one of them.
    """
    if not settings.api_keys:
        return Principal(settings.default_tenant, "anonymous")
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthorized("a bearer API key is required")
    presented = authorization[7:].strip().encode()
    for key, binding in settings.api_keys.items():
        # Compare every key in constant time so the answer's timing says nothing about near misses.
        if hmac.compare_digest(presented, key.encode()):
            tenant, _, subject = binding.partition("/")
            return Principal(tenant, subject or "user")
    raise Unauthorized("unknown API key")
