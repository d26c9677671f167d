"""The REST API and ``POST /changes`` under hostile input: no 5xx, JSON errors, no traceback in the log."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ, Answer, Request, Target
from tests.fuzz.strategies import ANY, NUMBERS, TEXT, URI, bent, encode, header_value, json_values

VALID_NAME = st.one_of(st.sampled_from(["c", "fuzz", "c.d", "a_b-c~", "1", "x" * 128]),
                       st.from_regex(r"[A-Za-z0-9_.~-]{1,20}", fullmatch=True))
NAME = st.one_of(VALID_NAME, VALID_NAME, VALID_NAME,
                 st.sampled_from(["..", ".", "%2e", "x" * 129, "\x00", "\u202e", "😀", "a b", "%", "?x=1", "#f",
                                  "x" * 20_000]),
                 st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=200))
SHORT_TEXT = st.one_of(st.text(max_size=40),
                       st.sampled_from(["", "\x00", "\uffff", "😀", "x" * 5000, "-1", "0", "1e9"]))
META = st.one_of(st.none(), json_values(12))
CHANGE = st.fixed_dictionaries({}, optional={
    "uri": bent(URI),
    "kind": bent(st.sampled_from(["updated", "created", "deleted", "UPDATED", ""])),
    "meta": bent(st.dictionaries(TEXT, ANY, max_size=4)),
}).flatmap(lambda change: st.builds(lambda extra: {**extra, **change}, st.dictionaries(TEXT, ANY, max_size=2)))
#: Mostly a valid key, so most examples get past authentication.
AUTH = st.one_of(st.sampled_from(["Bearer key-a"] * 8 + ["Bearer key-b", "Bearer nope", "Basic a2V5LWE6", None]),
                 header_value([]))


def check_rest(answer: Answer | None) -> None:
    if answer is None or answer.body is None or answer.status in (204,) or not answer.body:
        return
    assert answer.content_type.startswith("application/json"), (answer.status, answer.body[:200])
    body = answer.json()
    if answer.status >= 400:
        assert isinstance(body, dict) and "detail" in body, body


def _path(*segments: str) -> str:
    return "/" + "/".join(quote(segment, safe="") for segment in segments)


@FUZZ
@given(method=st.sampled_from(["PUT", "PUT", "PATCH", "PATCH", "GET", "DELETE", "POST"]), name=NAME, record_id=NAME,
       value=st.one_of(json_values(12), st.dictionaries(TEXT, ANY, max_size=5)), auth=AUTH,
       content_type=header_value(["application/json", "text/plain"]), raw=st.one_of(st.none(), st.binary(max_size=50)))
def test_records(target: Target, method: str, name: str, record_id: str, value: Any, auth: str | None,
                 content_type: str | None, raw: bytes | None) -> None:
    body = (raw if raw is not None else encode(value)) if method in ("PUT", "PATCH", "POST") else None
    headers = {"Authorization": auth, "Content-Type": content_type}
    check_rest(target.send(Request(method, _path("collections", name, record_id), headers,
                                   value if raw is None else None, body)))


@FUZZ
@given(name=st.one_of(st.none(), NAME), after=st.one_of(st.none(), SHORT_TEXT),
       limit=st.one_of(st.none(), NUMBERS.map(str), SHORT_TEXT), auth=AUTH)
def test_listings(target: Target, name: str | None, after: str | None, limit: str | None, auth: str | None) -> None:
    path = "/collections" if name is None else _path("collections", name)
    query = "&".join(f"{key}={quote(value, safe='')}" for key, value in (("after", after), ("limit", limit))
                     if value is not None)
    check_rest(target.send(Request("GET", path + ("?" + query if query else ""), {"Authorization": auth})))


@FUZZ
@given(changes=st.one_of(CHANGE, st.lists(CHANGE, max_size=6), ANY), auth=AUTH,
       method=st.sampled_from(["POST", "POST", "POST", "PUT", "GET"]), ascii_only=st.booleans())
def test_changes(target: Target, changes: Any, auth: str | None, method: str, ascii_only: bool) -> None:
    check_rest(target.send(Request(method, "/changes", {"Authorization": auth, "Content-Type": "application/json"},
                                   changes, encode(changes, ascii_only))))
