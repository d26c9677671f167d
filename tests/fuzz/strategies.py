"""Hypothesis strategies for hostile but structurally plausible input, and a JSON encoder for it.

Values are built from what each method expects, then bent: wrong types, deep nesting within
the body limit, odd unicode and control characters, unknown and missing fields, negative and
huge numbers, huge cursors. ``Deep`` stands for a deeply nested value that ``dumps`` writes out
without recursion (the stdlib encoder would hit Python's recursion limit first).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

MODERN = "2026-07-28"
LEGACY_VERSIONS = ["2025-03-26", "2025-06-18", "2025-11-25"]
VERSION_KEY = "io.modelcontextprotocol/protocolVersion"
CAPS_KEY = "io.modelcontextprotocol/clientCapabilities"
INFO_KEY = "io.modelcontextprotocol/clientInfo"
KEYS = {"key-a": "a/alice", "key-b": "b/bob"}
TENANT = "a"


@dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` levels (lists or objects) around ``leaf``."""

    depth: int
    objects: bool
    leaf: Any = 0


def dumps(value: Any, ascii_only: bool = False) -> str:
    """JSON text for ``value``; ints of any size, ``Deep`` values written out flat."""
    if isinstance(value, Deep):
        opening, closing = ('{"k":', "}") if value.objects else ("[", "]")
        return opening * value.depth + dumps(value.leaf, ascii_only) + closing * value.depth
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=ascii_only) + ":" + dumps(v, ascii_only)
                              for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(dumps(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def encode(value: Any, ascii_only: bool = False) -> bytes:
    return dumps(value, ascii_only).encode("utf-8", "surrogatepass")


# -- leaves --------------------------------------------------------------------------------------
ODD_TEXT = st.sampled_from([
    "", " ", "\x00", "\x00abc", "\r\n", "\u202e\u2066", "\ufeff", "\u0085", "\u2028", "😀" * 3, "a\u0301",
    "..", "../..", "%2e%2e/", "%00", "null", "[]", "{}", "-1", "1e400", "\\", '"', "'", "<script>",
    "mcpb://", "mcpb://b/c/1", "MCPB://a/c/1", "http://",
])
TEXT = st.one_of(
    st.text(max_size=20),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    ODD_TEXT,
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\x01", "😀", "/"]), st.sampled_from([300, 3000, 70_000])),
)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64),
    st.sampled_from([0, -1, 2**53 + 1, 2**63, -(2**63) - 1, 10**30, -(10**30)]),
    st.floats(allow_nan=False, allow_infinity=False),
)
LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
DEEP = st.builds(Deep, st.sampled_from([2, 50, 254, 255, 256, 300, 1000, 1100]), st.booleans(), LEAF)


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(TEXT, inner, max_size=4)),
                     max_leaves=max_leaves),
        DEEP,
    )


ANY = json_values()

# -- plausible values, bent ------------------------------------------------------------------------
URI = st.one_of(
    st.sampled_from([
        "mcpb://a/c/1", "mcpb://a/c", "mcpb://a/fuzz/1", "mcpb://b/c/1", "mcpb://b/c", "MCPB://a/c/1",
        "mcpb://a/c/1/extra", "mcpb://a//1", "mcpb://a/c/", "mcpb://a/%2e%2e/1", "mcpb://a/c/..", "mcpb:",
        "mcpb://", "mcpb:///c/1", "https://example.com/x", "file:///etc/passwd", "data:,x", "a:b",
        "mcpb://a/c/1?x=1#y", "mcpb://a/c/\u00e9", "mcpb://a/c/\x00", "mcpb://default/c/1",
    ]),
    st.builds(lambda t: "mcpb://a/c/" + t, TEXT),
    st.builds(lambda t: "https://example.com/" + t, TEXT),
    TEXT,
)


def _cursor(value: Any) -> str:
    return base64.urlsafe_b64encode(encode(value)).decode()


CURSOR = st.one_of(
    TEXT,
    st.builds(_cursor, st.tuples(NUMBERS, st.one_of(st.none(), TEXT))),
    st.builds(_cursor, ANY),
    st.sampled_from(["", "=", "====", "AAAA", "W10=", "WzAsIiJd", "x" * 100_000]),
)


def bent(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the plausible value, sometimes anything at all."""
    return st.integers(0, 9).flatmap(lambda n: value if n < 7 else ANY)


def params_for(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Params with each field present or not, plausible or bent, plus unknown fields; sometimes not an object."""
    known = st.fixed_dictionaries({}, optional={name: bent(value) for name, value in fields.items()})
    unknown = st.dictionaries(TEXT, ANY, max_size=3)
    combined = st.builds(lambda a, b: {**b, **a}, known, unknown)
    return st.integers(0, 9).flatmap(lambda n: combined if n < 9 else ANY)


FILTER = st.fixed_dictionaries({}, optional={
    "resourceSubscriptions": bent(st.lists(URI, max_size=5)),
    "resourcesListChanged": bent(st.booleans()),
    "toolsListChanged": bent(st.booleans()),
    "promptsListChanged": bent(st.booleans()),
})
CLIENT_INFO = st.fixed_dictionaries({}, optional={"name": bent(TEXT), "version": bent(TEXT)})
PARAMS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "initialize": {"protocolVersion": st.sampled_from([*LEGACY_VERSIONS, "2024-11-05", MODERN, "1.0"]),
                   "capabilities": st.just({}), "clientInfo": CLIENT_INFO},
    "ping": {},
    "notifications/initialized": {},
    "notifications/cancelled": {"requestId": st.one_of(NUMBERS, TEXT), "reason": TEXT},
    "resources/list": {"cursor": CURSOR},
    "resources/templates/list": {"cursor": CURSOR},
    "resources/read": {"uri": URI},
    "resources/subscribe": {"uri": URI},
    "resources/unsubscribe": {"uri": URI},
    "server/discover": {},
    "subscriptions/listen": {"notifications": FILTER},
}
LEGACY_METHODS = ["initialize", "ping", "notifications/initialized", "notifications/cancelled", "resources/list",
                  "resources/read", "resources/templates/list", "resources/subscribe", "resources/unsubscribe"]
MODERN_METHODS = ["server/discover", "subscriptions/listen", "resources/list", "resources/read",
                  "resources/templates/list", "notifications/cancelled", "ping", "resources/subscribe"]
ID = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), TEXT, st.none(), ANY)


def _often(draw: st.DrawFn, tenths: int = 8) -> bool:
    """True about ``tenths`` times in ten: most of each message stays plausible, so it gets past the first check."""
    return draw(st.integers(0, 9)) < tenths


VALID_ID = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text(max_size=10))


@st.composite
def message(draw: st.DrawFn, methods: list[str], modern: bool) -> Any:
    """One JSON-RPC message for one of ``methods`` (or a stranger), hostile in its params."""
    method = draw(st.sampled_from(methods)) if _often(draw) else draw(st.one_of(TEXT, ANY))
    fields = PARAMS.get(method, {}) if isinstance(method, str) else {}
    params = draw(params_for(fields))
    if modern and isinstance(params, dict) and _often(draw):
        params["_meta"] = draw(envelope())
    msg: dict[str, Any] = {"jsonrpc": "2.0" if _often(draw, 9) else draw(st.sampled_from(["1.0", 2, None]))}
    msg["method"] = method
    if _often(draw):
        msg["id"] = draw(VALID_ID) if _often(draw, 9) else draw(ID)
    if _often(draw, 9):
        msg["params"] = params
    if not _often(draw, 9):
        msg[draw(st.sampled_from(["result", "error", "jsonrpc", "method", "extra"]))] = draw(ANY)
    if not _often(draw, 9):
        del msg["method"]
    return msg


@st.composite
def envelope(draw: st.DrawFn) -> Any:
    fields: dict[str, Any] = {}
    if _often(draw, 9):
        fields[VERSION_KEY] = draw(bent(st.sampled_from([MODERN, MODERN, MODERN, "2025-11-25", "2099-01-01"])))
    if _often(draw, 9):
        fields[CAPS_KEY] = draw(bent(st.just({})))
    if _often(draw, 5):
        fields[INFO_KEY] = draw(bent(CLIENT_INFO))
    if not _often(draw):
        fields.update(draw(st.dictionaries(TEXT, ANY, max_size=2)))
    return fields if _often(draw, 9) else draw(ANY)


# -- headers -------------------------------------------------------------------------------------------
#: What an HTTP/1.1 field value may carry on the wire (h11 refuses the rest before sending).
HEADER_TEXT = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30),
    st.binary(max_size=30).map(lambda b: bytes(c for c in b if c >= 0x80 or 0x21 <= c <= 0x7E).decode("latin-1")),
    st.builds(lambda n: "x" * n, st.sampled_from([1000, 6000])),
    st.sampled_from(["=?base64?ZmFrZQ==?=", "=?base64?!!?=", "=?base64??=", "*/*", "application/json; charset=x",
                     "text/event-stream", "0-0", "1-9999999999999999999999", "-1--1", "abc-def"]),
)


def header_value(plausible: list[str], tenths: int = 6) -> st.SearchStrategy[str | None]:
    """A plausible value about ``tenths`` times in ten, else absent or junk."""
    if not plausible:
        return HEADER_TEXT
    choices: list[st.SearchStrategy[str | None]] = [st.sampled_from(plausible), st.none(), HEADER_TEXT]
    return st.integers(0, 9).flatmap(lambda n: choices[0 if n < tenths else 1 if n < (tenths + 10) // 2 + 1 else 2])
