"""URIs of the built-in record collections: ``mcpb://<tenant>/<collection>[/<id>]``."""

from __future__ import annotations

import re
from typing import Final, NamedTuple

__all__ = ["SCHEME", "RecordRef", "collection_uri", "notify_targets", "parse_record_uri", "record_uri", "valid_name"]

SCHEME: Final = "mcpb"
_NAME = re.compile(r"[A-Za-z0-9_.~-]{1,128}")
_PREFIX: Final = SCHEME + "://"


class RecordRef(NamedTuple):
    tenant: str
    collection: str
    record_id: str | None


def valid_name(name: str) -> bool:
    """Tenant, collection and record names: URI-safe unreserved characters, 1-128 long, not dot-only."""
    return bool(_NAME.fullmatch(name)) and name.strip(".") != ""


def collection_uri(tenant: str, collection: str) -> str:
    return f"{_PREFIX}{tenant}/{collection}"


def record_uri(tenant: str, collection: str, record_id: str) -> str:
    return f"{_PREFIX}{tenant}/{collection}/{record_id}"


def parse_record_uri(uri: str) -> RecordRef | None:
    """Split a collection or record URI; None when it is not one."""
    if not uri.startswith(_PREFIX):
        return None
    parts = uri[len(_PREFIX) :].split("/")
    if len(parts) not in (2, 3) or not all(valid_name(p) for p in parts):
        return None
    return RecordRef(parts[0], parts[1], parts[2] if len(parts) == 3 else None)


def notify_targets(uri: str) -> tuple[str, ...]:
    """The URIs whose subscribers a change of ``uri`` notifies: itself, and its collection for a record."""
    ref = parse_record_uri(uri)
    if ref is not None and ref.record_id is not None:
        return (uri, collection_uri(ref.tenant, ref.collection))
    return (uri,)
