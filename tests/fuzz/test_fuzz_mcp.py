"""``/mcp`` under hostile input, both eras: no 5xx, well-formed JSON-RPC errors, no traceback in the log."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ, Answer, Request, Target
from tests.fuzz.strategies import (
    ANY,
    LEGACY_METHODS,
    LEGACY_VERSIONS,
    MODERN,
    MODERN_METHODS,
    encode,
    envelope,
    header_value,
    message,
)

ACCEPT = "application/json, text/event-stream"


def check_message(msg: Any) -> None:
    """One JSON-RPC response with the right shape."""
    assert isinstance(msg, dict) and msg.get("jsonrpc") == "2.0", msg
    assert ("result" in msg) != ("error" in msg), msg
    if "id" in msg:
        assert isinstance(msg["id"], str | int) and not isinstance(msg["id"], bool), msg
    if "error" in msg:
        error = msg["error"]
        assert isinstance(error, dict) and set(error) <= {"code", "message", "data"}, msg
        assert isinstance(error["code"], int) and isinstance(error["message"], str) and error["message"], msg
    else:
        assert "id" in msg and isinstance(msg["result"], dict), msg


def check_mcp(answer: Answer | None) -> None:
    if answer is None or answer.body is None:
        return  # a known failure, not sent; or an SSE stream (a GET or a listen that was accepted)
    if answer.status in (202, 204):  # accepted; a CORS preflight answered
        assert answer.body == b""
        return
    assert answer.content_type.startswith("application/json"), (answer.status, answer.body[:200])
    reply = answer.json()
    if answer.status == 431:
        # A head over MCP_BROKER_MAX_HEADER_BYTES (a long method copied into Mcp-Method) is refused by
        # the wire before any request exists, in HTTP's words (docs/LIMITS.md): no JSON-RPC to answer.
        assert reply == {"detail": "Request header fields too large"}
        return
    if isinstance(reply, list):
        assert answer.status == 200 and reply
        for item in reply:
            check_message(item)
    else:
        check_message(reply)
        if answer.status != 200:
            assert "error" in reply


def _headers(session: str | None, version: str | None) -> dict[str, str | None]:
    return {"Accept": ACCEPT, "Content-Type": "application/json", "Authorization": "Bearer key-a",
            "Mcp-Session-Id": session, "MCP-Protocol-Version": version}


@pytest.fixture(scope="module")
def sessions(target: Target) -> Iterator[dict[str, str]]:
    """One legacy session per version for tenant ``a``, and one of tenant ``b``."""
    ids: dict[str, str] = {}
    for name, version, key in [(v, v, "key-a") for v in LEGACY_VERSIONS] + [("b", "2025-11-25", "key-b")]:
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "f", "version": "1"}}}
        headers = {**_headers(None, None), "Authorization": f"Bearer {key}"}
        ids[name] = _session_of(target, init, headers)
    # The records the URIs name, so reads and subscriptions find something.
    for path in ("/collections/c/1", "/collections/fuzz/1"):
        assert target.send(Request("PUT", path, {"Authorization": "Bearer key-a"}, {"v": 1}, b'{"v": 1}'))
    yield ids


def _session_of(target: Target, init: dict[str, Any], headers: dict[str, str | None]) -> str:
    response = target.client.post("/mcp", content=encode(init),
                                  headers={k: v for k, v in headers.items() if v is not None})
    assert response.status_code == 200, response.text
    return response.headers["mcp-session-id"]


SESSION_CHOICES = st.sampled_from(["2025-03-26", "2025-06-18", "2025-11-25", "b", "none", "junk"])


def _session_header(sessions: dict[str, str], choice: str, junk: str | None) -> str | None:
    if choice == "none":
        return None
    if choice == "junk":
        return junk
    return sessions[choice]


@FUZZ
@given(choice=SESSION_CHOICES, junk=header_value(["00000000", "x" * 200]), msg=message(LEGACY_METHODS, False),
       version=header_value([*LEGACY_VERSIONS, MODERN]), ascii_only=st.booleans())
def test_legacy_requests(target: Target, sessions: dict[str, str], choice: str, junk: str | None, msg: Any,
                         version: str | None, ascii_only: bool) -> None:
    session = _session_header(sessions, choice, junk)
    if version is None and choice in sessions:
        version = choice if choice != "b" else "2025-11-25"
    check_mcp(target.send(Request("POST", "/mcp", _headers(session, version), msg, encode(msg, ascii_only))))


@FUZZ
@given(batch=st.one_of(st.lists(message(LEGACY_METHODS, False), max_size=12), st.lists(ANY, max_size=5)),
       choice=st.sampled_from(["2025-03-26", "2025-03-26", "2025-11-25", "none"]))
def test_legacy_batches(target: Target, sessions: dict[str, str], batch: list[Any], choice: str) -> None:
    session = _session_header(sessions, choice, None)
    check_mcp(target.send(Request("POST", "/mcp", _headers(session, "2025-03-26" if session else None), batch,
                                  encode(batch))))


@st.composite
def modern_request(draw: st.DrawFn) -> tuple[Any, dict[str, str | None]]:
    msg = draw(message(MODERN_METHODS, True))
    method = msg.get("method") if isinstance(msg.get("method"), str) else None
    params = msg.get("params")
    uri = params.get("uri") if isinstance(params, dict) else None
    name_choices = [uri] if isinstance(uri, str) and uri.isascii() and uri.isprintable() and uri.strip() == uri else []
    headers = {
        **_headers(None, draw(header_value([MODERN, MODERN, MODERN, "2025-11-25", "2099-01-01"], 9))),
        "Mcp-Method": draw(header_value([method] if method and method.isascii() and method.isprintable()
                                        and method.strip() == method else ["resources/read"], 9)),
        "Mcp-Name": draw(header_value(name_choices or ["mcpb://a/c/1"], 9)),
    }
    return msg, headers


@FUZZ
@given(request=modern_request(), ascii_only=st.booleans())
def test_modern_requests(target: Target, sessions: dict[str, str], request: tuple[Any, dict[str, str | None]],
                         ascii_only: bool) -> None:
    msg, headers = request
    check_mcp(target.send(Request("POST", "/mcp", headers, msg, encode(msg, ascii_only))))


@FUZZ
@given(method=st.sampled_from(["GET", "DELETE", "POST", "PUT", "OPTIONS"]), choice=SESSION_CHOICES,
       junk=header_value(["00000000", "x" * 200]),
       version=header_value([*LEGACY_VERSIONS, MODERN]), accept=header_value([ACCEPT, "text/event-stream", "*/*"]),
       content_type=header_value(["application/json", "text/plain", "application/json; charset=utf-8"]),
       last_event_id=header_value(["0-0", "1-5", "abc"]), auth=header_value(["Bearer key-a", "Bearer key-b", "Bearer"]),
       origin=header_value(["http://localhost", "http://localhost:1", "http://evil.example"], 3),
       body=st.one_of(st.none(), ANY),
       meta=envelope())
def test_headers(target: Target, sessions: dict[str, str], method: str, choice: str, junk: str | None,
                 version: str | None, accept: str | None, content_type: str | None, last_event_id: str | None,
                 auth: str | None, origin: str | None, body: Any, meta: Any) -> None:
    if method == "DELETE" and choice in sessions:
        choice = "junk"  # keep the sessions the other examples use
    headers = {"Mcp-Session-Id": _session_header(sessions, choice, junk), "MCP-Protocol-Version": version,
               "Accept": accept, "Content-Type": content_type, "Last-Event-ID": last_event_id,
               "Authorization": auth, "Origin": origin}
    if method == "POST" and body is None:
        body = {"jsonrpc": "2.0", "id": 1, "method": "resources/list", "params": {"_meta": meta}}
    content = None if body is None else encode(body)
    check_mcp(target.send(Request(method, "/mcp", headers, body, content)))


#: Bodies no encoder would write: invalid UTF-8, lone surrogates, nesting past the parser's limit.
RAW = [b"", b"{", b"[", b"[]", b"[[]]", b"null", b"\xff\xfe", b'"\\ud800"', b'["\xed\xa0\x80"]',
       b'{"jsonrpc":"2.0","id":1,"method":"ping"}' * 2, b"[" * 2000, b'{"a":' * 600]


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.sampled_from(RAW)),
       choice=st.sampled_from(["2025-03-26", "2025-11-25", "none"]))
def test_raw_bodies(target: Target, sessions: dict[str, str], raw: bytes, choice: str) -> None:
    session = _session_header(sessions, choice, None)
    check_mcp(target.send(Request("POST", "/mcp", _headers(session, choice if session else MODERN), None, raw)))
