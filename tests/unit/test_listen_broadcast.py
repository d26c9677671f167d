"""The listen broadcast is subscribed while a worker has listens, and a listen waits for it.

A broadcast whose subscription waits for the test to let it through shows the order: ``ready``
returns only once the subscription is confirmed (a listen is acknowledged after it), callers at
the same time share one attempt and its failure, a caller cancelled meanwhile leaves a
subscription that is given up like any other, and none is given up while a listen is open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from broker.delivery.broadcast import ListenBroadcast
from broker.delivery.listen import ListenIndex
from broker.delivery.stream import StreamMetrics, Streams
from broker.errors import BackendUnavailable
from broker.metrics import NO_METRICS

IDLE_TICKS = 3


class GatedBroadcast:
    """A broadcast whose subscription is confirmed when the test opens ``gate`` (or refused with ``fail``)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        #: A removal waits for it (open unless a test holds one in flight).
        self.removal = asyncio.Event()
        self.removal.set()
        #: Set once a removal has begun.
        self.removing = asyncio.Event()
        self.fail: Exception | None = None
        self.subscribes = 0
        self.removes = 0

    async def publish(self, changes: Any) -> None:
        raise NotImplementedError

    async def subscribe(self, handler: Any, on_lost: Any = None, on_batch: Any = None) -> Callable[[], Awaitable[None]]:
        self.subscribes += 1
        self.entered.set()
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail

        async def remove() -> None:
            self.removes += 1
            self.removing.set()
            await self.removal.wait()

        return remove


def make() -> tuple[ListenBroadcast, GatedBroadcast, ListenIndex, Streams]:
    streams = Streams()
    listens = ListenIndex(streams, 10, {}, StreamMetrics(NO_METRICS, "modern"))
    broadcast = GatedBroadcast()
    return ListenBroadcast(broadcast, listens, streams, IDLE_TICKS), broadcast, listens, streams


def tick_past_idle(feed: ListenBroadcast) -> asyncio.Task[None] | None:
    """Tick past the idle bound; the give-up the ticks started, if any."""
    started = [task for _ in range(IDLE_TICKS + 1) if (task := feed.tick()) is not None]
    assert len(started) <= 1
    return started[0] if started else None


async def given_up(feed: ListenBroadcast, broadcast: GatedBroadcast) -> bool:
    """Tick past the idle bound and wait for the give-up, if one started; whether it unsubscribed."""
    before = broadcast.removes
    if (giving_up := tick_past_idle(feed)) is not None:
        await giving_up
    return broadcast.removes > before and not feed.subscribed


async def test_ready_returns_only_once_the_subscription_is_confirmed_and_at_once_after() -> None:
    feed, broadcast, _, _ = make()
    waiting = asyncio.create_task(feed.ready())
    await broadcast.entered.wait()
    for _ in range(10):
        await asyncio.sleep(0)
    assert not waiting.done()  # the listen's ack would wait here
    broadcast.gate.set()
    await waiting
    assert feed.subscribed
    await feed.ready()
    assert broadcast.subscribes == 1


async def test_callers_at_the_same_time_share_one_attempt_and_its_failure() -> None:
    feed, broadcast, _, _ = make()
    broadcast.fail = BackendUnavailable("redis unavailable")
    callers = [asyncio.create_task(feed.ready()) for _ in range(5)]
    await broadcast.entered.wait()
    broadcast.gate.set()
    outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(outcome, BackendUnavailable) for outcome in outcomes)
    assert broadcast.subscribes == 1 and not feed.subscribed  # refused together, not one timeout each
    broadcast.fail = None
    await feed.ready()  # the next listen tries again
    assert broadcast.subscribes == 2 and feed.subscribed


async def test_a_caller_cancelled_while_subscribing_leaves_a_subscription_that_is_given_up() -> None:
    feed, broadcast, _, _ = make()
    caller = asyncio.create_task(feed.ready())
    await broadcast.entered.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    broadcast.gate.set()
    async with asyncio.timeout(5):
        while not feed.subscribed:
            await asyncio.sleep(0)
    assert await given_up(feed, broadcast)


async def test_the_subscription_stays_while_a_listen_is_open_and_goes_after_the_last() -> None:
    feed, broadcast, listens, _ = make()
    broadcast.gate.set()
    await feed.ready()
    listen = listens.open("l1", "default", ["mcpb://default/a/1"], False, {})
    assert not await given_up(feed, broadcast)
    assert all(feed.tick() is None for _ in range(3 * IDLE_TICKS))
    assert feed.subscribed and broadcast.removes == 0
    listens.close(listen)
    assert await given_up(feed, broadcast)
    await feed.ready()  # and subscribed again for the next listen
    assert broadcast.subscribes == 2 and feed.subscribed


async def test_a_stopping_worker_subscribes_nothing_more() -> None:
    feed, broadcast, _, streams = make()
    broadcast.gate.set()
    await feed.ready()
    streams.closing = True
    await feed.close()
    assert broadcast.removes == 1 and not feed.subscribed
    await feed.ready()  # a listen opened now ends at once with its complete result
    assert broadcast.subscribes == 1 and not feed.subscribed


async def test_a_listen_during_a_give_up_waits_for_a_subscription_of_its_own() -> None:
    feed, broadcast, _, _ = make()
    broadcast.gate.set()
    await feed.ready()
    broadcast.removal.clear()  # the unsubscribe is slow: still in flight when the next listen comes
    giving_up = tick_past_idle(feed)
    assert giving_up is not None
    await asyncio.wait_for(broadcast.removing.wait(), 5)
    await feed.ready()  # not the subscription being given up
    assert broadcast.subscribes == 2 and feed.subscribed
    broadcast.removal.set()
    await giving_up
    assert feed.subscribed  # the old one's end leaves the new one alone


async def test_an_attempt_still_under_way_when_the_worker_stops_gives_its_subscription_up() -> None:
    feed, broadcast, _, streams = make()
    caller = asyncio.create_task(feed.ready())
    await broadcast.entered.wait()
    streams.closing = True
    await feed.close(timeout=0.01)  # gives up waiting for the attempt
    broadcast.gate.set()
    await caller  # returns once the attempt, and the give-up it made, are over
    assert broadcast.subscribes == 1 and broadcast.removes == 1 and not feed.subscribed
