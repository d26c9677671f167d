"""Changes: what producers publish and fan-out consumes, and the rule a change must pass to be accepted.

A change names a tenant, a URI and what happened. It carries no content: MCP notifications
are level triggers ("re-read this"). ``meta`` is a small producer-supplied mapping that is
copied into the notification's ``params._meta`` (a version, an etag, a timestamp), never data.

A change is acknowledged only once it is sure to be deliverable: ``ChangeRules.change`` is the
one check every publisher goes through (``POST /changes``, ``Broker.publish``, ``mcp-broker
publish``; record writes check their ``meta`` with ``ChangeRules.meta``). A change that fan-out
cannot encode would fail in another process, after the 2xx, and hold up every tenant's changes
behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from broker.protocol.jsonbounds import JsonRefused, encode_bounded
from broker.uris import SCHEME, BadUri, check_uri, parse_record_uri

if TYPE_CHECKING:
    from broker.config import Settings

__all__ = ["Change", "ChangeKind", "ChangeRules", "ForeignNamespace", "InvalidChange", "reserved_meta_key"]


class ChangeKind(StrEnum):
    UPDATED = "updated"
    CREATED = "created"
    DELETED = "deleted"


_KINDS: Final = {kind.value: kind for kind in ChangeKind}
#: Second labels of a ``_meta`` key prefix that the MCP specification reserves (docs/PROTOCOL.md).
_RESERVED_LABELS: Final = frozenset({"modelcontextprotocol", "mcp"})
#: Reserved keys without a prefix. ``traceparent``, ``tracestate`` and ``baggage`` are reserved
#: too, but for the W3C trace context, which is what a producer passing them along means.
_RESERVED_KEYS: Final = frozenset({"progressToken"})


@dataclass(frozen=True, slots=True)
class Change:
    tenant: str
    uri: str
    kind: ChangeKind = ChangeKind.UPDATED
    meta: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        """A plain mapping for msgpack or JSON; ``from_wire`` reverses it.

        ``_value_`` rather than ``value``: the latter is a Python-level property of ``Enum``, and
        on Redis a change is put on the wire twice (its append, its broadcast)."""
        wire: dict[str, Any] = {"t": self.tenant, "u": self.uri, "k": self.kind._value_}
        if self.meta:
            wire["m"] = self.meta
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Change:
        """The change ``to_wire`` gave. An unknown kind raises ``ValueError`` (as ``ChangeKind`` does);
        a known one is found in a dict, not through ``Enum``'s Python-level call."""
        kind = wire["k"]
        return cls(wire["t"], wire["u"], _KINDS.get(kind) or ChangeKind(kind), wire.get("m"))


class InvalidChange(ValueError):
    """A change the broker refuses: it could not be delivered as given. The message says why."""


class ForeignNamespace(InvalidChange):
    """A record URI in another tenant's namespace: nobody the publisher may reach watches it."""


def reserved_meta_key(key: str) -> bool:
    """Is ``key`` one the specification reserves in ``_meta`` (a prefix like ``io.modelcontextprotocol/``)?"""
    if key in _RESERVED_KEYS:
        return True
    prefix, slash, _ = key.partition("/")
    labels = prefix.lower().split(".") if slash else []
    # 2025-11-25 and later reserve a second label of ``modelcontextprotocol`` or ``mcp``
    # (``io.modelcontextprotocol/``); 2025-06-18 reserved one in any label but the last
    # (``mcp.dev/``). Sessions of both revisions read these notifications: both are refused.
    return (len(labels) >= 2 and labels[1] in _RESERVED_LABELS) or any(
        label in _RESERVED_LABELS for label in labels[:-1])


@dataclass(frozen=True, slots=True)
class ChangeRules:
    """What a publisher may publish, with this deployment's bounds."""

    max_uri_bytes: int
    max_meta_bytes: int
    max_meta_depth: int

    @classmethod
    def from_settings(cls, settings: Settings) -> ChangeRules:
        return cls(settings.max_uri_length, settings.max_meta_bytes, settings.max_input_depth)

    def meta(self, meta: Any) -> dict[str, Any] | None:
        """``meta`` as a change carries it (None for none or empty).

        A JSON object of plain JSON values (no NaN, integers within 64 bits), at most
        ``max_meta_depth`` deep and ``max_meta_bytes`` encoded, with no reserved key: the broker
        stamps ``io.modelcontextprotocol/subscriptionId`` itself, and a producer's key of a reserved
        prefix would claim to speak for the protocol.

        Raises:
            InvalidChange: naming the rule broken.
        """
        if meta is None:
            return None
        if not isinstance(meta, dict):
            raise InvalidChange("meta must be an object")
        for key in meta:
            if isinstance(key, str) and reserved_meta_key(key):
                raise InvalidChange(f"meta key {key!r} is reserved by the MCP specification "
                                    "(prefixes whose second label is modelcontextprotocol or mcp, and progressToken)")
        try:
            encode_bounded(meta, self.max_meta_depth, self.max_meta_bytes, "meta")
        except JsonRefused as exc:
            raise InvalidChange(str(exc)) from exc
        return meta or None

    def change(self, tenant: str, uri: Any, kind: Any = ChangeKind.UPDATED, meta: Any = None) -> Change:
        """A change of ``tenant`` that fan-out can deliver, from what a publisher gave.

        The URI passes the rule of every URI a client sends; a record URI (``mcpb://``) must be a
        record or collection of the publisher's own tenant, the only namespace it can reach.

        Raises:
            ForeignNamespace: a record URI of another tenant.
            InvalidChange: anything else that is not a deliverable change.
        """
        if not isinstance(uri, str):
            raise InvalidChange("uri must be a string")
        try:
            check_uri(uri, self.max_uri_bytes)
        except BadUri as exc:
            raise InvalidChange(f"invalid uri: {exc.message}") from exc
        if uri.startswith(SCHEME + "://"):
            ref = parse_record_uri(uri)
            if ref is None:
                raise InvalidChange(f"invalid uri: not a record or collection URI, "
                                    f"{SCHEME}://<tenant>/<collection>[/<id>]: {uri}")
            if ref.tenant != tenant:
                raise ForeignNamespace(f"{uri} is in the namespace of tenant {ref.tenant!r}; "
                                       f"this principal publishes for tenant {tenant!r}")
        if not isinstance(kind, str) or kind not in _KINDS:
            raise InvalidChange(f"kind must be one of {sorted(_KINDS)}")
        return Change(tenant, uri, _KINDS[kind], self.meta(meta))
