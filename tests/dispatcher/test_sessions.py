"""A 2025 session, message by message: initialize, subscribe, the notifications of its stream, replay, refusals."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from broker.runtime import Broker
from tests.dispatcher.conftest import LEGACY, UPDATED, Client

Connect = Callable[..., Client]
MakeBroker = Callable[..., Awaitable[Broker]]


async def test_initialize_answers_the_version_asked_with_the_resources_capability(broker: Broker,
                                                                                   connect: Connect) -> None:
    answer = await connect(broker).initialize()
    assert answer["result"]["protocolVersion"] == LEGACY
    assert answer["result"]["capabilities"]["resources"]["subscribe"] is True
    assert answer["result"]["serverInfo"]["name"]


async def test_a_second_initialize_on_one_channel_is_refused(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.initialize()
    assert (await client.initialize())["error"]["code"] == -32600


async def test_a_subscribed_uri_that_changes_is_notified_and_another_is_not(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.initialize()
    assert (await client.request("resources/subscribe", {"uri": "x:watched"}))["result"] == {}
    await client.initialized()
    await broker.publish("x:other")
    await broker.publish("x:watched", meta={"v": 1})
    # Changes are delivered in the order published: had x:other been sent, it would come first.
    assert await client.next() == {"jsonrpc": "2.0", "method": UPDATED,
                                   "params": {"uri": "x:watched", "_meta": {"v": 1}}}


async def test_after_unsubscribe_a_change_is_no_longer_notified(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.initialize()
    await client.request("resources/subscribe", {"uri": "x:a"})
    await client.request("resources/subscribe", {"uri": "x:b"})
    await client.initialized()
    assert (await client.request("resources/unsubscribe", {"uri": "x:a"}))["result"] == {}
    await broker.publish("x:a")
    await broker.publish("x:b")
    assert (await client.next())["params"]["uri"] == "x:b"


async def test_a_stream_reopened_with_the_last_event_id_gets_each_uri_it_missed_once_with_its_latest_change(
        broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.initialize()
    for uri in ("x:a", "x:b"):
        await client.post("resources/subscribe", {"uri": uri})
    stream = client.stream()
    await broker.publish("x:a", meta={"n": 1})
    assert (await stream.next())["params"]["_meta"] == {"n": 1}
    await stream.close()
    for uri, n in (("x:a", 2), ("x:b", 3), ("x:a", 4)):  # published while the client is away
        await broker.publish(uri, meta={"n": n})
    assert stream.last_event_id is not None
    again = client.stream(last_event_id=stream.last_event_id)
    missed = [(await again.next())["params"] for _ in range(2)]
    assert sorted((p["uri"], p["_meta"]["n"]) for p in missed) == [("x:a", 4), ("x:b", 3)]
    await broker.publish("x:b", meta={"n": 5})
    assert (await again.next())["params"]["_meta"] == {"n": 5}  # then live: nothing replayed twice
    await again.close()


async def test_a_session_past_max_sessions_is_refused_and_the_first_is_served(
        make_broker: MakeBroker, connect: Connect) -> None:
    broker = await make_broker(max_sessions=1, tenant_share=1.0)
    assert "result" in await connect(broker).initialize()
    refused = await connect(broker).initialize()
    assert "sessions" in refused["error"]["message"].lower(), refused  # on HTTP also a 503 with Retry-After


async def test_a_tenant_over_its_sessions_quota_is_refused_and_another_tenant_has_its_own(
        make_broker: MakeBroker, connect: Connect) -> None:
    broker = await make_broker(quotas={"default": {"sessions": 1}})
    assert "result" in await connect(broker, "acme").initialize()
    refused = await connect(broker, "acme").initialize()
    assert refused["error"]["code"] == -31002, refused
    assert refused["error"]["data"] == {"limit": "sessions", "quota": 1, "tenant": "acme"}, refused
    assert "result" in await connect(broker, "other").initialize()


async def test_a_subscription_past_the_per_session_limit_is_refused_and_the_others_stay(
        make_broker: MakeBroker, connect: Connect) -> None:
    broker = await make_broker(max_subscriptions_per_session=1)
    client = connect(broker)
    await client.initialize()
    await client.request("resources/subscribe", {"uri": "x:a"})
    refused = await client.request("resources/subscribe", {"uri": "x:b"})
    assert refused["error"]["code"] == -32602 and refused["error"]["data"] == {"limit": 1}, refused
    await client.initialized()
    await broker.publish("x:b")
    await broker.publish("x:a")
    assert (await client.next())["params"]["uri"] == "x:a"


async def test_a_method_the_broker_does_not_serve_is_answered_method_not_found(broker: Broker,
                                                                            connect: Connect) -> None:
    client = connect(broker)
    await client.initialize()
    assert (await client.request("tools/call", {"name": "x"}))["error"]["code"] == -32601
