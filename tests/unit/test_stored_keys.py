"""``broker.auth.keys`` in process: the verifier's cache bound, the rules of a key request, and the ends of
streams whose credential expires (a timer) or is revoked (the Hub's one check for every stream)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker.auth import SCOPES, Principal, Unauthorized, authenticator_for
from broker.auth.keys import MAX_LINEAGE, KeyAdmin, KeyRefused, StoredKeys, parse_duration
from broker.backends.memory.credentials import MemoryCredentials
from broker.config import Settings
from broker.delivery.stream import EndReason
from broker.protocol.jsonrpc import parse_message
from broker.runtime import Broker
from tests.integration.modern import request

TIMEOUT = 5.0


class Counting(MemoryCredentials):
    """The memory store, counting the lookups a verifier makes."""

    def __init__(self) -> None:
        super().__init__()
        self.finds = 0

    async def find(self, digest: str) -> Any:
        self.finds += 1
        return await super().find(digest)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_verifier_answers_from_a_lookup_at_most_cache_seconds_old() -> None:
    store, clock = Counting(), Clock()
    issued = await KeyAdmin(store).create("acme", "alice")
    keys = StoredKeys(store, 2.0, monotonic=clock)
    principal = await keys.verify(issued.key)
    assert principal == Principal("acme", "alice")
    assert principal is not None and principal.credential == issued.record.id and principal.scopes == frozenset(SCOPES)
    clock.now += 1.9
    await keys.verify(issued.key)
    assert store.finds == 1
    await store.revoke(issued.record.id, time.time())
    clock.now += 0.2  # past the cache period: the revocation is seen
    with pytest.raises(Unauthorized, match="revoked"):
        await keys.verify(issued.key)
    assert store.finds == 2


async def test_without_a_cache_every_request_is_a_lookup_and_misses_are_never_cached() -> None:
    store = Counting()
    issued = await KeyAdmin(store).create("acme", "alice")
    keys = StoredKeys(store, 0)
    for _ in range(3):
        await keys.verify(issued.key)
    assert store.finds == 3
    cached = StoredKeys(store, 60)
    with pytest.raises(Unauthorized, match="unknown"):
        await cached.verify("mcpb_" + "x" * 43)
    later = await KeyAdmin(store).create("acme", "bob")  # made after a miss: works at once
    assert await cached.verify(later.key) is not None


async def test_only_tokens_with_the_prefix_are_the_verifiers() -> None:
    keys = StoredKeys(MemoryCredentials(), 2)
    assert await keys.verify("a-static-key") is None
    with pytest.raises(Unauthorized):
        await keys.verify("mcpb_" + "x" * 500)


async def test_an_expired_key_is_refused_and_carries_its_expiry() -> None:
    store, clock = MemoryCredentials(), Clock()
    issued = await KeyAdmin(store, clock=clock).create("acme", "alice", expires_in=10)
    keys = StoredKeys(store, 2, clock=clock)
    principal = await keys.verify(issued.key)
    assert principal is not None and principal.expires_at == clock.now + 10
    clock.now += 10
    with pytest.raises(Unauthorized, match="expired"):
        await keys.verify(issued.key)


@pytest.mark.parametrize(("args", "status"), [
    (("no/such", "alice"), 422),
    (("acme", ""), 422),
    (("acme", "a b"), 422),
    (("acme", "alice", ["nope"]), 422),
    (("acme", "alice", []), 422),
    (("acme", "alice", None, -1), 422),
    (("acme", "alice", None, "forever"), 422),
])
async def test_a_bad_key_request_is_refused_with_its_status(args: tuple[Any, ...], status: int) -> None:
    with pytest.raises(KeyRefused) as refused:
        await KeyAdmin(MemoryCredentials()).create(*args)
    assert refused.value.status == status


async def test_a_tenant_admin_stays_in_its_tenant_and_within_its_scopes() -> None:
    admin = KeyAdmin(MemoryCredentials())
    boss = Principal("acme", "root", frozenset({"keys:admin", "resources:read"}))
    with pytest.raises(KeyRefused) as other:
        await admin.create("globex", "x", by=boss)
    assert other.value.status == 403
    with pytest.raises(KeyRefused) as wider:
        await admin.create("acme", "x", ["records:write"], by=boss)
    assert wider.value.status == 403
    assert (await admin.create("acme", "x", by=boss)).record.scopes == ("resources:read",)
    mine = await admin.create("acme", "y")
    theirs = await admin.create("globex", "z")
    with pytest.raises(KeyRefused) as hidden:
        await admin.revoke(theirs.record.id, "acme")
    assert hidden.value.status == 404
    await admin.revoke(mine.record.id, "acme")
    with pytest.raises(KeyRefused) as twice:
        await admin.revoke(mine.record.id, None)
    assert twice.value.status == 409


async def test_a_key_whose_maker_was_revoked_stops_working_even_where_no_cascade_reached_it() -> None:
    """The cascade that revokes a maker's keys may not have run (it was cut short, or a key was made
    by an older version after it ran): each use asks about the makers too, so the key still stops,
    on requests within the cache period and on the Hub's check of its streams."""
    store, clock = MemoryCredentials(), Clock()
    admin = KeyAdmin(store)
    root = await admin.create("acme", "root", ["resources:read", "keys:admin"])
    root_principal = Principal("acme", "root", frozenset({"resources:read", "keys:admin"}), credential=root.record.id)
    child = await admin.create("acme", "child", ["resources:read", "keys:admin"], by=root_principal)
    grandchild = await admin.create("acme", "grandchild", ["resources:read"], by=Principal(
        "acme", "child", frozenset({"resources:read", "keys:admin"}), credential=child.record.id))
    keys = StoredKeys(store, 2.0, monotonic=clock)
    assert await keys.verify(grandchild.key) is not None
    assert await keys.invalid([grandchild.record.id]) == set()
    await store.revoke(root.record.id, time.time())  # the store alone: no cascade
    clock.now += 2.1
    for key in (child.key, grandchild.key):
        with pytest.raises(Unauthorized, match="made this API key was revoked"):
            await keys.verify(key)
    assert await keys.invalid([child.record.id, grandchild.record.id]) == {child.record.id, grandchild.record.id}
    with pytest.raises(KeyRefused, match="revoked") as refused:  # and it makes nothing more, cache or not
        await admin.create("acme", "x", ["resources:read"], by=Principal(
            "acme", "child", frozenset({"resources:read", "keys:admin"}), credential=child.record.id))
    assert refused.value.status == 403


async def test_a_line_of_makers_is_bounded() -> None:
    store = MemoryCredentials()
    admin = KeyAdmin(store)
    scopes = frozenset({"resources:read", "keys:admin"})
    maker = None
    for depth in range(MAX_LINEAGE + 1):
        by = None if maker is None else Principal("acme", "a", scopes, credential=maker.record.id)
        maker = await admin.create("acme", "a", sorted(scopes), by=by)
        assert await StoredKeys(store, 0).verify(maker.key) is not None, depth
    with pytest.raises(KeyRefused, match="more than 16 keys"):
        await admin.create("acme", "a", ["resources:read"], by=Principal("acme", "a", scopes,
                                                                         credential=maker.record.id))


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "15m", "12h", "30d", 2.5)] == [90, 90, 900, 43200, 2592000, 2.5]
    for bad in ("", "1y", "-1s", "0", "11000d"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_stored_keys_join_the_verifiers_only_when_keys_are_on() -> None:
    keys = StoredKeys(MemoryCredentials(), 2)
    on = authenticator_for(Settings(_env_file=None, auth="keys"), keys)  # type: ignore[call-arg]
    assert keys in getattr(on, "verifiers", [])
    off = authenticator_for(Settings(_env_file=None), keys)  # type: ignore[call-arg]
    assert not hasattr(off, "verifiers")  # anonymous: nobody's key is asked for


# -- streams ------------------------------------------------------------------------------------


class Writer:
    """Where a listen's messages go, in memory."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.retries = 0

    async def send(self, message: bytes, event_id: str | None = None) -> None:
        self.sent.append(message)

    async def send_many(self, items: list[tuple[bytes, str | None]]) -> None:
        self.sent.extend(data for data, _ in items)

    async def comment(self) -> None:
        return None

    async def retry(self) -> None:
        self.retries += 1

    async def prime(self, event_id: str) -> None:
        return None


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    settings = Settings(_env_file=None, auth="keys", credential_check_seconds=0.1)  # type: ignore[call-arg]
    broker = Broker(settings)
    await broker.start()
    yield broker
    await broker.stop()


async def open_listen(broker: Broker, principal: Principal) -> tuple[asyncio.Task[EndReason], Writer]:
    msg = parse_message(request("subscriptions/listen", {"notifications": {"resourceSubscriptions": ["x:y"]}}))
    listen = await broker.dispatcher.modern(principal, msg)
    assert not isinstance(listen, bytes)
    writer = Writer()

    async def run() -> EndReason:
        try:
            return await listen.run(writer)
        finally:
            broker.dispatcher.close_listen(listen)

    return asyncio.create_task(run()), writer


async def test_a_listen_ends_with_its_complete_result_when_its_credential_expires(broker: Broker) -> None:
    principal = Principal("acme", "alice", expires_at=time.time() + 0.3)
    task, writer = await open_listen(broker, principal)
    assert await asyncio.wait_for(task, TIMEOUT) is EndReason.EXPIRED
    assert b'"resultType":"complete"' in writer.sent[-1]
    assert not broker.streams.listens


async def test_the_hub_ends_the_listens_of_a_revoked_key_and_no_others(broker: Broker) -> None:
    assert broker.keys is not None
    doomed = await broker.keys.create("acme", "alice")
    kept = await broker.keys.create("acme", "bob")
    verify = broker.authenticator.authenticate
    first = await verify({"authorization": f"Bearer {doomed.key}"})
    second = await verify({"authorization": f"Bearer {kept.key}"})
    (ending, writer), (staying, _) = await open_listen(broker, first), await open_listen(broker, second)
    await broker.keys.revoke(doomed.record.id, None)
    assert await asyncio.wait_for(ending, TIMEOUT) is EndReason.REVOKED
    assert b'"resultType":"complete"' in writer.sent[-1]
    # The worker that ended the stream refuses the key at once, not after its cache period.
    with pytest.raises(Unauthorized, match="revoked"):
        await verify({"authorization": f"Bearer {doomed.key}"})
    await asyncio.sleep(0.3)  # three more checks: the other listen is left alone
    assert not staying.done()
    await broker.end_streams()
    assert await asyncio.wait_for(staying, TIMEOUT) is EndReason.SHUTDOWN
