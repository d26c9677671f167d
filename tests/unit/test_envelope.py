"""The 2026-07-28 envelope: ``_meta`` fields and the routing headers, decoded and checked."""

from __future__ import annotations

import base64

import pytest

from broker.protocol import jsonrpc as rpc
from broker.protocol.envelope import (
    PROTOCOL_VERSION_KEY,
    check_headers,
    check_meta,
    decode_header_value,
    has_modern_meta,
)
from broker.transport.rpc import status_of

CAPS = "io.modelcontextprotocol/clientCapabilities"


def request(method: str, params: dict[str, object]) -> rpc.Message:
    return rpc.parse_message({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})


def meta(version: object = "2026-07-28", caps: object = None) -> dict[str, object]:
    return {"_meta": {PROTOCOL_VERSION_KEY: version, CAPS: {} if caps is None else caps}}


def test_a_complete_envelope_yields_the_version_and_capabilities() -> None:
    assert check_meta(request("resources/list", meta(caps={"roots": {}}))) == ("2026-07-28", {"roots": {}})


@pytest.mark.parametrize(
    "params",
    [{}, {"_meta": "x"}, {"_meta": {CAPS: {}}}, {"_meta": {PROTOCOL_VERSION_KEY: 20260728, CAPS: {}}},
     {"_meta": {PROTOCOL_VERSION_KEY: "2026-07-28"}}, {"_meta": {PROTOCOL_VERSION_KEY: "2026-07-28", CAPS: []}}],
    ids=repr,
)
def test_a_missing_or_mistyped_envelope_field_is_invalid_params_with_400(params: dict[str, object]) -> None:
    with pytest.raises(rpc.RpcError) as info:
        check_meta(request("resources/list", params))
    assert (info.value.code, status_of(info.value)) == (rpc.INVALID_PARAMS, 400)


def test_an_unknown_version_names_the_supported_ones() -> None:
    with pytest.raises(rpc.RpcError) as info:
        check_meta(request("resources/list", meta(version="2099-01-01")))
    assert info.value.code == rpc.UNSUPPORTED_PROTOCOL_VERSION
    assert info.value.data == {"supported": ["2026-07-28"], "requested": "2099-01-01"}


def test_header_values_decode_from_plain_ascii_and_from_base64() -> None:
    assert decode_header_value("resources/read") == "resources/read"
    encoded = "=?base64?" + base64.b64encode("mcpb://t/caf\u00e9".encode()).decode() + "?="
    assert decode_header_value(encoded) == "mcpb://t/caf\u00e9"


@pytest.mark.parametrize("value", [" padded", "caf\u00e9", "tab\there", "=?base64?!!!?="])
def test_header_values_that_are_neither_plain_ascii_nor_base64_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        decode_header_value(value)


def test_routing_headers_must_mirror_the_body() -> None:
    msg = request("resources/read", {"uri": "mcpb://t/c/1", **meta()})
    good = {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "resources/read", "Mcp-Name": "mcpb://t/c/1"}
    check_headers(msg, "2026-07-28", good.get)
    for name, wrong in [("Mcp-Name", "mcpb://t/c/2"), ("Mcp-Method", "resources/list"), ("Mcp-Name", None)]:
        headers = {**good, name: wrong}
        with pytest.raises(rpc.RpcError) as info:
            check_headers(msg, "2026-07-28", headers.get)
        assert (info.value.code, status_of(info.value)) == (rpc.HEADER_MISMATCH, 400)


def test_only_a_body_with_the_protocol_version_in_meta_counts_as_modern() -> None:
    assert has_modern_meta({"params": meta()})
    assert not has_modern_meta({"params": {"_meta": {}}})
    assert not has_modern_meta({"params": []})
    assert not has_modern_meta([{"params": meta()}])
