"""The rules input passes at the door: changes, their meta, URIs, records, client info."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from broker.backends.base import SessionRecord
from broker.backends.memory import MemoryBackend
from broker.changes import Change, ChangeRules, ForeignNamespace, InvalidChange, reserved_meta_key
from broker.config import Settings
from broker.fanout import Fanout
from broker.notifications import update_frame
from broker.protocol import jsonrpc as rpc
from broker.protocol.jsonbounds import JsonRefused, check_json
from broker.resources.records import InvalidRecord, merge_patch
from broker.runtime import Broker

RULES = ChangeRules(max_uri_bytes=2048, max_meta_bytes=8192, max_meta_depth=16)


def settings(**overrides: Any) -> Settings:
    return Settings(_env_file=None, **overrides)  # type: ignore[call-arg]


def deep(levels: int) -> Any:
    """A value nested ``levels`` containers deep, built without recursion."""
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


# -- meta --------------------------------------------------------------------------------------
@pytest.mark.parametrize("meta", [
    deep(17), deep(300), {"n": float("nan")}, {"n": float("inf")}, {"n": 2**64}, {"n": -(2**63) - 1},
    {"t": (1, 2)}, {"s": {1}}, {1: "int key"}, {"b": b"bytes"}, {"pad": "x" * 8200}, {"s": "\ud800"},
    [1], "text",
])
def test_a_meta_fan_out_could_not_carry_is_refused(meta: Any) -> None:
    with pytest.raises(InvalidChange):
        RULES.meta(meta)


@pytest.mark.parametrize("meta", [deep(16), {"n": 2**64 - 1, "m": -(2**63), "f": 1.5, "ok": [True, None, "s"]},
                                  {"traceparent": "00-ab-cd-01", "com.example/etag": "v1"}])
def test_a_meta_within_the_rules_is_kept_as_given(meta: Any) -> None:
    assert RULES.meta(meta) is meta


def test_an_empty_meta_is_none() -> None:
    assert RULES.meta({}) is None and RULES.meta(None) is None


@pytest.mark.parametrize(("key", "reserved"), [
    ("io.modelcontextprotocol/subscriptionId", True), ("io.modelcontextprotocol/anything", True),
    ("dev.mcp/x", True), ("IO.ModelContextProtocol/x", True), ("progressToken", True),
    ("com.example/etag", False), ("etag", False), ("mcp/x", False), ("traceparent", False), ("a.b.mcp/x", False),
])
def test_reserved_meta_keys_follow_the_specification(key: str, reserved: bool) -> None:
    assert reserved_meta_key(key) is reserved


# -- changes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [["updated"], {"k": 1}, 1, None, "exploded"])
def test_a_kind_that_is_not_one_of_the_three_is_refused(kind: Any) -> None:
    with pytest.raises(InvalidChange, match="kind must be one of"):
        RULES.change("t", "x:y", kind)


@pytest.mark.parametrize("uri", ["MCPB://t/c/1", "Mcpb://t/c", "mcpb:t/c", "mcpb://t", "mcpb://t/c/1/2",
                                 "x:\ud800", "x:" + "é" * 1100, "no scheme", 5])
def test_a_uri_that_reaches_nobody_is_refused(uri: Any) -> None:
    with pytest.raises(InvalidChange):
        RULES.change("t", uri)


def test_a_record_uri_of_another_tenant_is_a_foreign_namespace() -> None:
    with pytest.raises(ForeignNamespace, match="namespace of tenant 'other'"):
        RULES.change("t", "mcpb://other/c/1")
    assert RULES.change("t", "mcpb://t/c/1") == Change("t", "mcpb://t/c/1")


async def test_broker_publish_goes_through_the_same_rules() -> None:
    broker = Broker(settings())
    await broker.backend.start()
    try:
        for call in (lambda: broker.publish("x:y", meta=deep(40)), lambda: broker.publish("MCPB://default/c/1"),
                     lambda: broker.publish("mcpb://other/c/1"), lambda: broker.publish("x:y", tenant="a:b")):
            with pytest.raises(InvalidChange):
                await call()
        assert await broker.publish("x:y", meta={"etag": "1"})
        with pytest.raises(InvalidChange):
            await broker.records.put("default", "c", "1", {}, meta={"io.modelcontextprotocol/serverInfo": 1})
    finally:
        await broker.backend.close()


# -- JSON depth: no input exhausts the stack ----------------------------------------------------
def test_the_json_check_is_iterative() -> None:
    with pytest.raises(JsonRefused, match="nested deeper than 64 levels"):
        check_json(deep(100_000), 64)


def test_merge_patch_refuses_a_patch_deeper_than_its_bound_instead_of_overflowing() -> None:
    with pytest.raises(InvalidRecord):
        merge_patch({}, deep(5000))
    assert merge_patch({"a": {"b": 1}}, deep(3), max_depth=3) == {"a": {"a": {"a": 1}, "b": 1}}


async def test_a_record_deeper_than_the_bound_is_refused_by_the_store() -> None:
    broker = Broker(settings(max_record_depth=8))
    await broker.backend.start()
    try:
        with pytest.raises(InvalidRecord):
            await broker.records.put("default", "c", "1", deep(9))
        await broker.records.put("default", "c", "1", deep(8))
        with pytest.raises(InvalidRecord):
            await broker.records.patch("default", "c", "1", deep(9))
        with pytest.raises(InvalidRecord):
            await broker.records.put("default", "c", "2", {"n": float("nan")})
    finally:
        await broker.backend.close()


# -- a change that still cannot be encoded costs only itself ---------------------------------------
def test_an_update_frame_whose_meta_cannot_be_encoded_is_sent_without_it() -> None:
    frame = update_frame("x:a", deep(300))
    assert orjson.loads(frame.data)["params"] == {"uri": "x:a"}
    assert orjson.loads(update_frame("x:a", {"v": 1}).data)["params"] == {"uri": "x:a", "_meta": {"v": 1}}


async def test_fan_out_delivers_a_batch_holding_a_change_it_cannot_encode() -> None:
    backend = MemoryBackend(settings())
    await backend.start()
    try:
        for tenant in ("a", "b"):
            await backend.sessions.create(SessionRecord(id=tenant, tenant=tenant, principal=f"{tenant}/x",
                                                       protocol_version="2025-11-25", epoch=backend.sessions.epoch,
                                                       created_at=time.time()))
            await backend.subscriptions.add(tenant, tenant, "x:" + tenant)
        # Published past the rules, as a change in the log from before them would be.
        await backend.changelog.publish(Change("a", "x:a", meta=deep(300)))
        await backend.changelog.publish(Change("b", "x:b", meta={"seq": 1}))
        await Fanout(settings(), backend).process(await backend.changelog.read("f", 10, 0))
        for tenant, params in (("a", {"uri": "x:a"}), ("b", {"uri": "x:b", "_meta": {"seq": 1}})):
            read = await backend.inboxes.read(tenant, backend.sessions.epoch, 0, 10)
            assert [orjson.loads(frame.data)["params"] for _, frame in read.frames] == [params]
    finally:
        await backend.close()


# -- what a session keeps ------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    {"clientInfo": {"name": "x" * 5000, "version": "1"}, "capabilities": {}},
    {"clientInfo": {"name": "x", "version": "1"}, "capabilities": {"experimental": {"pad": "y" * 5000}}},
    {"clientInfo": {"name": "x", "version": "1"}, "capabilities": deep(17)},
    {"clientInfo": {"name": "x", "version": 2**70}, "capabilities": {}},
])
def test_initialize_bounds_what_the_session_keeps(params: dict[str, Any]) -> None:
    broker = Broker(settings())
    with pytest.raises(rpc.RpcError) as raised:
        broker.methods.initialize({"protocolVersion": "2025-11-25", **params})
    assert raised.value.code == rpc.INVALID_PARAMS
    assert raised.value.data == {"maxBytes": 4096, "maxDepth": 16}
