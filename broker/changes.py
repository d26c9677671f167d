"""Changes: what producers publish and fan-out consumes.

A change names a tenant, a URI and what happened. It carries no content: MCP notifications
are level triggers ("re-read this"). ``meta`` is a small producer-supplied mapping that is
copied into the notification's ``params._meta`` (a version, an etag, a timestamp), never data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["Change", "ChangeKind"]


class ChangeKind(StrEnum):
    UPDATED = "updated"
    CREATED = "created"
    DELETED = "deleted"


@dataclass(frozen=True, slots=True)
class Change:
    tenant: str
    uri: str
    kind: ChangeKind = ChangeKind.UPDATED
    meta: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        """A plain mapping for msgpack or JSON; ``from_wire`` reverses it."""
        wire: dict[str, Any] = {"t": self.tenant, "u": self.uri, "k": self.kind.value}
        if self.meta:
            wire["m"] = self.meta
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Change:
        return cls(wire["t"], wire["u"], ChangeKind(wire["k"]), wire.get("m"))
