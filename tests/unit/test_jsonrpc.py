"""JSON-RPC framing: what the broker accepts, what it refuses, and how replies look on the wire."""

from __future__ import annotations

import orjson
import pytest

from broker.protocol import jsonrpc as rpc
from broker.transport.rpc import status_of


def test_a_body_that_is_not_json_is_a_parse_error_answered_with_400() -> None:
    with pytest.raises(rpc.RpcError) as info:
        rpc.parse_body(b"{not json")
    assert info.value.code == rpc.PARSE_ERROR
    assert status_of(info.value) == 400


def test_a_request_a_notification_and_a_response_are_told_apart() -> None:
    request = rpc.parse_message({"jsonrpc": "2.0", "id": 7, "method": "ping"})
    notification = rpc.parse_message({"jsonrpc": "2.0", "method": "notifications/initialized"})
    response = rpc.parse_message({"jsonrpc": "2.0", "id": "a", "result": {}})
    assert (request.kind, request.id, request.params) == ("request", 7, {})
    assert request.is_request
    assert (notification.kind, notification.id) == ("notification", None)
    assert (response.kind, response.id) == ("response", "a")


def test_null_params_read_as_no_params() -> None:
    assert rpc.parse_message({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": None}).params == {}


@pytest.mark.parametrize(
    "obj",
    [
        [],
        "ping",
        {"id": 1, "method": "ping"},
        {"jsonrpc": "1.0", "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1},
        {"jsonrpc": "2.0", "id": 1, "method": 5},
        {"jsonrpc": "2.0", "id": 1, "method": ""},
        {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1]},
        {"jsonrpc": "2.0", "id": None, "method": "ping"},
        {"jsonrpc": "2.0", "id": True, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1.5, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1, "result": {}, "error": {"code": 1, "message": "x"}},
    ],
    ids=repr,
)
def test_anything_that_is_not_a_json_rpc_message_is_an_invalid_request(obj: object) -> None:
    with pytest.raises(rpc.RpcError) as info:
        rpc.parse_message(obj)
    assert info.value.code == rpc.INVALID_REQUEST
    assert status_of(info.value) == 400


def test_the_id_of_a_malformed_message_is_recovered_when_it_is_readable() -> None:
    assert rpc.request_id_of({"id": 3, "method": 5}) == 3
    assert rpc.request_id_of({"id": "x"}) == "x"
    assert rpc.request_id_of({"id": True}) is None
    assert rpc.request_id_of([1, 2]) is None


def test_an_error_without_a_readable_id_leaves_the_id_out() -> None:
    error = rpc.RpcError(rpc.INVALID_REQUEST, "bad")
    assert orjson.loads(rpc.encode_error(None, error)) == {
        "jsonrpc": "2.0", "error": {"code": -32600, "message": "bad"}}
    assert orjson.loads(rpc.encode_error(4, rpc.RpcError(rpc.RESOURCE_NOT_FOUND, "nf", {"uri": "x:y"}))) == {
        "jsonrpc": "2.0", "id": 4, "error": {"code": -32002, "message": "nf", "data": {"uri": "x:y"}}}


def test_results_and_notifications_encode_as_compact_json_rpc() -> None:
    assert orjson.loads(rpc.encode_result(1, {})) == {"jsonrpc": "2.0", "id": 1, "result": {}}
    assert orjson.loads(rpc.encode_notification("notifications/resources/list_changed")) == {
        "jsonrpc": "2.0", "method": "notifications/resources/list_changed"}
    encoded = rpc.encode_notification("notifications/resources/updated", {"uri": "a:b"})
    assert b"\n" not in encoded
    assert orjson.loads(encoded)["params"] == {"uri": "a:b"}
