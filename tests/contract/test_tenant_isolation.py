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
    await backend.subscriptions.add(intruder, "a:b", "c:y")
    await backend.subscriptions.add(owner, "a", "b:c:y")
    await backend.changelog.publish(Change("a", "b:c:y", meta={"secret": 1}))
    fanout = Fanout(Settings(_env_file=None), backend, "c1")  # type: ignore[call-arg]
    await fanout.process(await backend.changelog.read("c1", 10, 100))
    assert (await backend.inboxes.read(intruder, backend.sessions.epoch, 0, 10)).frames == []
    assert len((await backend.inboxes.read(owner, backend.sessions.epoch, 0, 10)).frames) == 1
    assert await backend.subscriptions.subscribers("a", ["b:c:y"]) == {"b:c:y": [owner]}


async def test_records_of_look_alike_tenants_and_collections_stay_apart(backend: Backend) -> None:
    await backend.records.write("a/b", "c", "1", b'"mine"', Change("a/b", "mcpb://x/c/1"))
    assert await backend.records.read("a", "b/c", "1") is None
    assert await backend.records.collections("a") == []
    assert await backend.records.collections("a/b") == ["c"]
