"""URIs: the rule every URI a client sends must pass, and those of the built-in record collections
(``mcpb://<tenant>/<collection>[/<id>]``).

URIs are compared as exact strings everywhere (subscriptions, the index, the change log), so a
spelling of a record URI the broker never writes (``MCPB://``, ``mcpb:x``) is refused rather
than accepted to reach nobody. RFC 3986 makes the scheme case-insensitive; normalising it would
notify a client with another string than the one it subscribed to, which it could not match.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

__all__ = [
    "NAME_PATTERN",
    "SCHEME",
    "BadUri",
    "RecordRef",
    "check_uri",
    "collection_uri",
    "notify_targets",
    "parse_record_uri",
    "record_uri",
    "valid_name",
]

SCHEME: Final = "mcpb"
#: Tenant, collection and record names: URI-safe unreserved characters, 1-128 long (and not dot-only).
NAME_PATTERN: Final = r"^[A-Za-z0-9_.~-]{1,128}$"
_NAME = re.compile(NAME_PATTERN)
_PREFIX: Final = SCHEME + "://"
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:\S")
#: Whitespace (Unicode's, as ``str.isspace``) and control characters: none may appear in a URI.
#: A regular expression, not a loop over the characters: the check runs for every published
#: change, and the loop cost ~3% of a worker ingesting 5,000 changes/s.
_FORBIDDEN = re.compile(r"[\s\x00-\x1f]")


class BadUri(ValueError):
    """A URI the broker refuses; ``data`` is the JSON-RPC error data that goes with the message."""

    def __init__(self, message: str, data: dict[str, object]) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


def check_uri(uri: str, max_bytes: int, *, canonical: bool = True) -> None:
    """The rule for every URI a client sends: at most ``max_bytes`` in UTF-8, absolute, no
    whitespace or control characters, and (``canonical``) a record URI spelled as the broker
    writes it: ``mcpb://`` in lower case.

    Raises:
        BadUri: naming the rule broken.
    """
    if len(uri) > max_bytes or (not uri.isascii() and len(uri.encode("utf-8", "surrogatepass")) > max_bytes):
        raise BadUri(f"URI longer than {max_bytes} bytes", {"maxLength": max_bytes})
    if not _ABSOLUTE.match(uri) or _FORBIDDEN.search(uri):
        raise BadUri("not an absolute URI", {"uri": uri})
    if not uri.isascii():
        try:
            uri.encode()
        except UnicodeEncodeError:
            raise BadUri("not an absolute URI: it is not valid Unicode", {}) from None
    if canonical and uri[: len(SCHEME) + 1].lower() == SCHEME + ":" and not uri.startswith(_PREFIX):
        raise BadUri(f"record URIs are written {_PREFIX}<tenant>/<collection>[/<id>], scheme in lower case",
                     {"uri": uri})


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
