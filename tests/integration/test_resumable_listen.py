"""A resumable listen on one real broker: negotiated, ids on every event, resumption, and the gap rule.

The multi-worker cases (resume on another worker, ``kill -9`` during a burst, stdio children on
one Redis) are in ``tests/distributed/test_resumable_listen.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
import pytest

from broker.uris import record_uri
from tests.integration import modern
from tests.integration.mcp_http import publish
from tests.resumable import ACK, EXTENSION, LIST_CHANGED, UPDATED, Event, Events, listen_body, open_listen
from tests.support import BrokerProcess

KEYS = {"key-a": "acme/alice", "key-b": "acme/bob"}
A = "key-a"


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": json.dumps(KEYS)}) as proc:
        yield proc


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as client:
        yield client


def uri(n: int, collection: str = "items") -> str:
    return record_uri("acme", collection, f"r{n}")


async def test_discover_offers_the_extension(http: httpx.AsyncClient) -> None:
    response = await modern.call(http, "server/discover", auth=A)
    assert response.status_code == 200, response.text
    assert EXTENSION in response.json()["result"]["capabilities"]["extensions"]


async def test_without_the_extension_a_listen_is_plain(http: httpx.AsyncClient) -> None:
    async with open_listen(http, [uri(1)], auth=A, resumable=False) as events:
        assert events.last_id is None  # the ack carries no id
        await publish(http, uri(1), auth=A)
        event = await events.notification()
        assert event.method == UPDATED and event.id is None


async def test_a_dropped_listen_resumes_with_every_missed_uri_then_goes_live(http: httpx.AsyncClient) -> None:
    watched = [uri(n) for n in range(10, 14)]
    async with open_listen(http, watched, auth=A) as events:
        assert events.last_id is not None  # the ack's position: a cut right after it loses nothing
        await publish(http, watched[0], auth=A)
        first = await events.notification()
        assert first.method == UPDATED and first.uri == watched[0] and first.id is not None
        params = first.message["params"] if first.message else {}
        assert params["_meta"]["io.modelcontextprotocol/subscriptionId"] == "listen-1"
        assert "dev.mcp-broker/eventId" not in params["_meta"]  # over HTTP the id is the SSE id alone
        last = events.last_id
    # The stream is gone; these wait in the listen's inbox.
    await publish(http, watched[1], watched[2], auth=A)
    await publish(http, watched[1], auth=A)
    async with open_listen(http, watched, last_id=last, auth=A, id_="listen-2") as events:
        assert events.ack_meta["dev.mcp-broker/resumed"] is True
        missed = await events.updates(2)  # coalesced per URI: watched[1] once
        assert sorted(missed) == [watched[1], watched[2]]
        await publish(http, watched[3], auth=A)
        live = await events.notification()
        assert live.uri == watched[3]
        assert live.message and live.message["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "listen-2"


async def test_resuming_from_the_ack_replays_what_followed_it(http: httpx.AsyncClient) -> None:
    watched = [uri(20), uri(21)]
    async with open_listen(http, watched, auth=A) as events:
        from_ack = events.last_id
    await publish(http, watched[0], auth=A)
    async with open_listen(http, watched, last_id=from_ack, auth=A) as events:
        await publish(http, watched[0], auth=A)
        # The replayed change, then the live one; the gap rule would have sent watched[1] too.
        assert await events.updates(2) == [watched[0], watched[0]]


async def _gap_rule(http: httpx.AsyncClient, watched: list[str], last_id: str, auth: str,
                    list_changed: bool = False) -> list[Event]:
    got: list[Event] = []
    async with open_listen(http, watched, last_id=last_id, auth=auth, resourcesListChanged=list_changed) as events:
        wanted = len(watched) + (1 if list_changed else 0)
        while len(got) < wanted:
            got.append(await events.notification())
    return got


async def test_an_id_of_an_unknown_session_gets_the_gap_rule(http: httpx.AsyncClient) -> None:
    watched = [uri(30), uri(31)]
    async with open_listen(http, watched, auth=A) as events:
        assert events.ack_meta["dev.mcp-broker/resumed"] is False  # a new listen
    got = await _gap_rule(http, watched, "nosuchsession:e1-5", A, list_changed=True)
    assert sorted(e.uri for e in got if e.method == UPDATED) == watched
    assert [e.method for e in got].count(LIST_CHANGED) == 1


async def test_another_principals_id_gets_the_gap_rule_never_their_frames(http: httpx.AsyncClient) -> None:
    secret = uri(40, "private")
    secrets = [secret, uri(42, "private")]
    async with open_listen(http, secrets, auth=A) as events:
        alices = events.last_id
    await publish(http, secret, auth=A)  # waiting in Alice's listen
    assert alices is not None
    watched = [uri(41)]
    got = await _gap_rule(http, watched, alices, "key-b")
    assert [e.uri for e in got] == watched  # Bob's own filter, resynchronised; nothing of Alice's
    async with open_listen(http, secrets, last_id=alices, auth=A) as events:
        await publish(http, secret, auth=A)
        assert await events.updates(2) == [secret, secret]  # and Alice's is intact: replayed, then live


async def test_another_filter_keeps_the_listen_refiltered_with_the_gap_rule(http: httpx.AsyncClient) -> None:
    async with open_listen(http, [uri(50)], auth=A) as events:
        last = events.last_id
    assert last is not None
    await publish(http, uri(50), auth=A)
    async with open_listen(http, [uri(51)], last_id=last, auth=A) as events:
        assert events.ack_meta["dev.mcp-broker/resumed"] is False
        assert await events.updates(1) == [uri(51)]  # the gap rule, for the new filter only
        refiltered = events.last_id
    assert refiltered is not None and refiltered.split(":")[0] == last.split(":")[0]  # the same state, kept
    await publish(http, uri(50), uri(51), auth=A)
    async with open_listen(http, [uri(51)], last_id=refiltered, auth=A) as events:
        await publish(http, uri(51), auth=A)
        # What followed, for the new filter only: uri(50) is no longer watched.
        assert await events.updates(2) == [uri(51), uri(51)]


async def test_an_id_from_before_a_refilter_gets_the_gap_rule_never_the_old_filters_frames(
        http: httpx.AsyncClient) -> None:
    async with open_listen(http, [uri(55)], auth=A) as events:
        old = events.last_id
    assert old is not None
    await publish(http, uri(55), auth=A)  # waits in the inbox, after the old id
    async with open_listen(http, [uri(56)], last_id=old, auth=A) as events:
        assert await events.updates(1) == [uri(56)]  # refiltered, with the gap rule
    # The same old id again, now with the filter the listen has: uri(55) is not in it, and what
    # uri(56) had before the refilter was never kept, so only the gap rule is true.
    async with open_listen(http, [uri(56)], last_id=old, auth=A) as events:
        assert events.ack_meta["dev.mcp-broker/resumed"] is False
        await publish(http, uri(56), auth=A)
        assert await events.updates(2) == [uri(56), uri(56)]  # the gap rule, then live


async def test_list_changes_are_sent_only_when_the_filter_asks(http: httpx.AsyncClient) -> None:
    watched = [uri(60)]
    async with open_listen(http, watched, auth=A) as events:
        await publish(http, watched[0], kind="created", auth=A)  # changes the list, and watched[0]
        await publish(http, watched[0], auth=A)
        assert [(await events.notification()).method for _ in range(2)] == [UPDATED, UPDATED]
    async with open_listen(http, watched, auth=A, resourcesListChanged=True) as events:
        await publish(http, watched[0], kind="deleted", auth=A)
        methods = {(await events.notification()).method for _ in range(2)}
        assert methods == {UPDATED, LIST_CHANGED}


async def test_a_malformed_id_is_a_bad_request(http: httpx.AsyncClient) -> None:
    headers = modern.headers("subscriptions/listen", auth=A, **{"Last-Event-ID": "not an id"})
    response = await http.post("/mcp", content=orjson.dumps(listen_body([uri(70)])), headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == -32602


async def test_the_ack_of_a_resumable_listen_names_the_filter(http: httpx.AsyncClient) -> None:
    body = orjson.dumps(listen_body([uri(80)]))
    async with http.stream("POST", "/mcp", content=body,
                           headers=modern.headers("subscriptions/listen", auth=A)) as response:
        ack = await Events(response).notification()
        assert ack.method == ACK and ack.message is not None
        assert ack.message["params"]["notifications"]["resourceSubscriptions"] == [uri(80)]



async def test_a_resumable_listen_is_held_to_the_tenant_subscriptions_quota() -> None:
    """Its state is a session: its filter may watch no more URIs than the tenant's sessions may."""
    env = {"MCP_BROKER_API_KEYS": json.dumps(KEYS), "MCP_BROKER_QUOTAS": '{"default": {"subscriptions": 2}}'}
    with BrokerProcess(env=env) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=10) as http:
            headers = modern.headers("subscriptions/listen", auth=A)
            body = orjson.dumps(listen_body([uri(90), uri(91), uri(92)]))
            refused = await http.post("/mcp", content=body, headers=headers)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["data"]["limit"] == "subscriptions"
            async with open_listen(http, [uri(90), uri(91)], auth=A) as events:
                await publish(http, uri(91), auth=A)
                assert await events.updates(1) == [uri(91)]
