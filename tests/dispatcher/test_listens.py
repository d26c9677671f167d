"""2026-07-28 listens, message by message: the ack, the frames of the filter, resuming, cancelling, refusals."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from broker.runtime import Broker
from tests.dispatcher.conftest import ACK, EVENT_ID, UPDATED, Client, is_ack, is_answer, is_update, sub_id

Connect = Callable[..., Client]
MakeBroker = Callable[..., Awaitable[Broker]]


async def test_a_listen_is_acknowledged_then_gets_the_changes_of_its_filter_only(broker: Broker,
                                                                                  connect: Connect) -> None:
    client = connect(broker)
    await client.listen(1, "x:watched")
    ack = await client.next()
    assert ack["method"] == ACK and sub_id(ack) == 1
    await broker.publish("x:other")
    await broker.publish("x:watched")
    update = await client.next()
    assert update["method"] == UPDATED and update["params"]["uri"] == "x:watched" and sub_id(update) == 1


async def test_two_listens_on_one_channel_each_get_their_own_frames(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.listen("a", "x:a")
    await client.until(is_ack("a"))
    await client.listen("b", "x:b")
    await client.until(is_ack("b"))
    await broker.publish("x:b")
    await broker.publish("x:a")
    assert [(sub_id(m), m["params"]["uri"]) for m in (await client.next(), await client.next())] == [
        ("b", "x:b"), ("a", "x:a")]


async def test_a_cancelled_listen_gets_nothing_more_and_no_result(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.listen(1, "x:a")
    await client.until(is_ack(1))
    await client.cancel(1)
    await client.listen(2, "x:a", "x:b")
    await client.until(is_ack(2))
    await broker.publish("x:a")
    await broker.publish("x:b")
    # Both changes reach listen 2; anything for listen 1 (a frame, a result) would be read on the way.
    seen = [await client.until(lambda m: m.get("id") == 1 or sub_id(m) in (1, 2)) for _ in range(2)]
    assert [sub_id(m) for m in seen] == [2, 2]


async def test_a_cancelled_listen_gives_its_place_back(make_broker: MakeBroker, connect: Connect) -> None:
    broker = await make_broker(max_listens=1, tenant_share=1.0)
    client = connect(broker)
    await client.listen(1, "x:a")
    await client.until(is_ack(1))
    await client.cancel(1)
    await client.listen(2, "x:a")
    await client.until(is_ack(2))


async def test_a_listen_past_max_listens_is_refused_and_the_open_one_goes_on(make_broker: MakeBroker,
                                                                           connect: Connect) -> None:
    broker = await make_broker(max_listens=1, tenant_share=1.0)
    first, second = connect(broker), connect(broker)
    await first.listen(1, "x:a")
    await first.until(is_ack(1))
    await second.listen(1, "x:a")
    refused = await second.until(is_answer(1))
    assert refused["error"]["code"] == -32603 and "listens" in refused["error"]["message"], refused
    await broker.publish("x:a")
    await first.until(is_update(1, "x:a"))


async def test_a_listen_with_a_bad_filter_is_refused_with_invalid_params(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.listen(1, "not a uri")
    assert (await client.until(is_answer(1)))["error"]["code"] == -32602


def event_id(message: dict[str, Any]) -> str:
    found: str = message["params"]["_meta"][EVENT_ID]
    return found


async def test_a_resumable_listen_resumed_from_its_last_event_id_gets_what_it_missed_then_live(
        broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    uris = ("x:a", "x:b", "x:c")
    await client.listen(1, *uris, resumable=True)
    await client.until(is_ack(1))
    await broker.publish("x:a")
    last = event_id(await client.until(is_update(1, "x:a")))
    await client.cancel(1)
    await broker.publish("x:b")  # while no listen is open
    await client.listen(2, *uris, resumable=True, last_event_id=last)
    await client.until(is_ack(2))
    await broker.publish("x:c")
    # Exactly the missed change, then the live one: not the gap rule's update of every URI.
    assert [(await client.until(is_update(2)))["params"]["uri"] for _ in range(2)] == ["x:b", "x:c"]


async def test_a_resumable_listen_given_another_principals_event_id_gets_the_gap_rule_not_their_frames(
        broker: Broker, connect: Connect) -> None:
    alice, mallory = connect(broker, principal="alice"), connect(broker, principal="mallory")
    await alice.listen(1, "x:a", "x:b", resumable=True)
    await alice.until(is_ack(1))
    await broker.publish("x:a")
    stolen = event_id(await alice.until(is_update(1, "x:a")))
    await broker.publish("x:b")
    await mallory.listen(1, "x:a", "x:b", resumable=True, last_event_id=stolen)
    await mallory.until(is_ack(1))
    # The gap rule: an ``updated`` for every URI of the filter (so a re-read), never a replay of alice's.
    resync = [await mallory.until(is_update(1)) for _ in range(2)]
    assert sorted(m["params"]["uri"] for m in resync) == ["x:a", "x:b"]


async def test_a_stopping_worker_ends_an_open_listen_with_its_result(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.listen(1, "x:a")
    await client.until(is_ack(1))
    await broker.end_streams()
    assert "result" in await client.until(is_answer(1))


async def test_a_tenant_over_its_listens_quota_is_refused_and_another_tenant_has_its_own(
        make_broker: MakeBroker, connect: Connect) -> None:
    broker = await make_broker(quotas={"default": {"listens": 1}})
    acme, other = connect(broker, "acme"), connect(broker, "other")
    await acme.listen(1, "x:a")
    await acme.until(is_ack(1))
    await acme.listen(2, "x:a")
    refused = await acme.until(is_answer(2))
    assert refused["error"]["code"] == -31002 and refused["error"]["data"]["limit"] == "listens", refused
    await other.listen(1, "x:a")
    await other.until(is_ack(1))
