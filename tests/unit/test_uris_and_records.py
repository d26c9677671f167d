"""Record URIs, JSON merge patch, and which URIs a change notifies."""

from __future__ import annotations

import pytest

from broker.resources.records import merge_patch
from broker.uris import RecordRef, collection_uri, notify_targets, parse_record_uri, record_uri, valid_name


@pytest.mark.parametrize("name", ["a", "Product", "v1.2", "x_y-z~", "9" * 128])
def test_unreserved_names_are_valid(name: str) -> None:
    assert valid_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a b", "caf\u00e9", "a%20", "9" * 129])
def test_names_that_would_break_a_uri_or_a_path_are_invalid(name: str) -> None:
    assert not valid_name(name)


def test_record_and_collection_uris_round_trip() -> None:
    assert parse_record_uri(record_uri("t1", "Product", "42")) == RecordRef("t1", "Product", "42")
    assert parse_record_uri(collection_uri("t1", "Product")) == RecordRef("t1", "Product", None)


@pytest.mark.parametrize("uri", ["mcpb://t1", "mcpb://t1/a/b/c", "mcpb://t1//x", "mcpb://t1/../x", "file:///t1/a",
                                 "mcpb:/t1/a"])
def test_other_uris_are_not_record_uris(uri: str) -> None:
    assert parse_record_uri(uri) is None


def test_a_record_change_also_notifies_its_collection() -> None:
    assert notify_targets("mcpb://t/Product/42") == ("mcpb://t/Product/42", "mcpb://t/Product")
    assert notify_targets("mcpb://t/Product") == ("mcpb://t/Product",)
    assert notify_targets("https://example.com/x") == ("https://example.com/x",)


@pytest.mark.parametrize(
    ("target", "patch", "result"),
    [  # the examples of RFC 7386, appendix A
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
        ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
        ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
        (["a", "b"], ["c", "d"], ["c", "d"]),
        ({"a": "b"}, ["c"], ["c"]),
        ({"a": "foo"}, None, None),
        ({"a": "foo"}, "bar", "bar"),
        ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
        ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_merge_patch_follows_rfc_7386(target: object, patch: object, result: object) -> None:
    assert merge_patch(target, patch) == result


def test_merge_patch_leaves_the_original_untouched() -> None:
    original = {"a": {"b": 1}}
    merge_patch(original, {"a": {"b": 2}})
    assert original == {"a": {"b": 1}}
