"""Tenants whose names look alike never share state, whatever the names (checked below the
settings, which refuse such names before they become principals)."""

from __future__ import annotations

from broker.backends.base import Backend
from broker.changes import Change
from broker.config import Settings
from broker.fanout import Fanout
from tests.contract.conftest import open_session


async def test_a_tenant_named_a_colon_b_never_sees_tenant_as_notifications(backend: Backend) -> None:
    intruder = await open_session(backend, "a:b")
    owner = await open_session(backend, "a")
    # Joined with ':' these two would name one index key: "a:b" + "c:y" and "a" + "b:c:y".
    await backend.add_subscription(intruder, "a:b", "c:y")
    await backend.add_subscription(owner, "a", "b:c:y")
    await backend.publish(Change("a", "b:c:y", meta={"secret": 1}))
    fanout = Fanout(Settings(_env_file=None), backend, "c1")  # type: ignore[call-arg]
    await fanout.process(await backend.read_changes("c1", 10, 100))
    assert (await backend.read_inbox(intruder, backend.epoch, 0, 10)).frames == []
    assert len((await backend.read_inbox(owner, backend.epoch, 0, 10)).frames) == 1
    assert await backend.subscribers("a", ["b:c:y"]) == {"b:c:y": [owner]}


async def test_records_of_look_alike_tenants_and_collections_stay_apart(backend: Backend) -> None:
    await backend.write_record("a/b", "c", "1", b'"mine"', Change("a/b", "mcpb://x/c/1"))
    assert await backend.read_record("a", "b/c", "1") is None
    assert await backend.list_collections("a") == []
    assert await backend.list_collections("a/b") == ["c"]
