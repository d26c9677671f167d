"""Resources declared by decorated functions (``ResourceSet``): listed, read with their URI's variables and
the caller's tenant, refused as the protocol says, and published with the broker's guarantees."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from broker.auth import Principal
from broker.changes import InvalidChange
from broker.config import Settings
from broker.errors import NotFound
from broker.resources import ResourceSet
from broker.runtime import Broker
from broker.sources.extensions import build
from tests.dispatcher.conftest import MODERN, UPDATED, Client, is_ack, is_update

Connect = Callable[..., Client]
MakeBroker = Callable[..., Awaitable[Broker]]

NOTES = {"acme": {"1": "acme's first note"}, "globex": {"1": "globex's first note"}}


def notes() -> ResourceSet:
    resources = ResourceSet()

    @resources.resource("notes://{id}", mime_type="text/markdown")
    async def note(id: str, tenant: str) -> str | None:
        """One note of the caller's tenant."""
        return NOTES.get(tenant, {}).get(id)

    @resources.resource("notes://index", name="index")
    def listing(principal: Principal) -> dict[str, Any]:
        mine = sorted(NOTES.get(principal.tenant, {}))
        return {"tenant": principal.tenant, "subject": principal.subject, "notes": mine}

    @resources.resource("files://{folder}/{name}")
    def raw(folder: str, name: str) -> bytes:
        return f"{folder}|{name}".encode()

    @resources.resource("notes://broken")
    def broken() -> str:
        raise RuntimeError("secret connection string")

    @resources.resource("notes://gone")
    def gone() -> str:
        raise NotFound("notes://gone")

    return resources


@pytest.fixture
async def broker(make_broker: MakeBroker) -> Broker:
    broker = await make_broker()
    broker.register(notes())
    return broker


async def test_a_fixed_uri_is_listed_and_a_template_is_listed_as_a_template(broker: Broker, connect: Connect) -> None:
    client = connect(broker, "acme")
    await client.initialize()
    listed = (await client.request("resources/list"))["result"]["resources"]
    assert {"uri": "notes://index", "name": "index"} in listed
    assert not any("{" in item["uri"] for item in listed)
    templates = (await client.request("resources/templates/list"))["result"]["resourceTemplates"]
    assert {"uriTemplate": "notes://{id}", "name": "note", "description": "One note of the caller's tenant.",
            "mimeType": "text/markdown"} in templates
    assert {"uriTemplate": "files://{folder}/{name}", "name": "raw"} in templates


async def test_a_template_is_read_with_its_variables_for_the_callers_own_tenant(broker: Broker,
                                                                                connect: Connect) -> None:
    for tenant in ("acme", "globex"):
        client = connect(broker, tenant)
        await client.initialize()
        read = await client.request("resources/read", {"uri": "notes://1"})
        assert read["result"]["contents"] == [{"uri": "notes://1", "mimeType": "text/markdown",
                                               "text": f"{tenant}'s first note"}]


async def test_a_function_sees_the_principal_and_a_dict_is_answered_as_json(broker: Broker, connect: Connect) -> None:
    client = connect(broker, "acme", "alice")
    await client.initialize()
    [content] = (await client.request("resources/read", {"uri": "notes://index"}))["result"]["contents"]
    assert content["mimeType"] == "application/json"
    assert json.loads(content["text"]) == {"tenant": "acme", "subject": "alice", "notes": ["1"]}


async def test_bytes_are_answered_as_a_blob_and_each_variable_is_one_segment(broker: Broker, connect: Connect) -> None:
    client = connect(broker)
    await client.initialize()
    [content] = (await client.request("resources/read", {"uri": "files://a/b.txt"}))["result"]["contents"]
    assert content["mimeType"] == "application/octet-stream" and base64.b64decode(content["blob"]) == b"a|b.txt"
    missing = await client.request("resources/read", {"uri": "files://a/b/c"})  # no template matches
    assert missing["error"]["code"] == -32002


@pytest.mark.parametrize("uri", ["notes://2", "notes://gone"])
async def test_none_or_not_found_is_the_eras_resource_not_found(broker: Broker, connect: Connect, uri: str) -> None:
    legacy = connect(broker, "acme")
    await legacy.initialize()
    answer = await legacy.request("resources/read", {"uri": uri})
    assert answer["error"] == {"code": -32002, "message": f"Resource not found: {uri}", "data": {"uri": uri}}
    modern = connect(broker, "acme")
    await modern.send({"jsonrpc": "2.0", "id": 9, "method": "resources/read",
                       "params": {"uri": uri, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}})
    assert (await modern.until(lambda m: m.get("id") == 9))["error"]["code"] == -32602


async def test_a_function_that_fails_is_an_internal_error_that_tells_nothing_and_is_logged(
        broker: Broker, connect: Connect, caplog: pytest.LogCaptureFixture) -> None:
    client = connect(broker)
    await client.initialize()
    with caplog.at_level(logging.ERROR):
        answer = await client.request("resources/read", {"uri": "notes://broken"})
    assert answer["error"] == {"code": -32603, "message": "Internal error"}
    assert "secret connection string" in caplog.text  # in the server's log, not in the answer


async def test_publish_notifies_the_subscribers_of_that_tenant_only(broker: Broker, connect: Connect) -> None:
    resources = notes()
    broker.register(resources)
    acme, globex = connect(broker, "acme"), connect(broker, "globex")
    for client in (acme, globex):
        await client.initialize()
        assert (await client.request("resources/subscribe", {"uri": "notes://1"}))["result"] == {}
        await client.initialized()
    await resources.publish("notes://1", tenant="globex", meta={"v": 2})
    assert await globex.next() == {"jsonrpc": "2.0", "method": UPDATED,
                                   "params": {"uri": "notes://1", "_meta": {"v": 2}}}
    await resources.publish("notes://1", tenant="acme")
    assert (await acme.next())["params"]["uri"] == "notes://1"  # not globex's change first


async def test_publish_reaches_a_listen(broker: Broker, connect: Connect) -> None:
    resources = notes()
    broker.register(resources)
    client = connect(broker)
    await client.listen(1, "notes://7")
    await client.until(is_ack(1))
    await resources.publish("notes://7")  # the default tenant
    assert (await client.until(is_update(1)))["params"]["uri"] == "notes://7"


async def test_a_change_published_while_the_client_was_away_is_replayed(broker: Broker, connect: Connect) -> None:
    resources = notes()
    broker.register(resources)
    client = connect(broker)
    await client.initialize()
    await client.post("resources/subscribe", {"uri": "notes://1"})
    stream = client.stream()
    await resources.publish("notes://1", meta={"n": 1})
    assert (await stream.next())["params"]["_meta"] == {"n": 1}
    await stream.close()
    await resources.publish("notes://1", meta={"n": 2})
    again = client.stream(last_event_id=stream.last_event_id)
    assert (await again.next())["params"] == {"uri": "notes://1", "_meta": {"n": 2}}
    await again.close()


async def test_publish_refuses_a_uri_the_set_does_not_declare_and_a_set_no_broker_holds(broker: Broker) -> None:
    resources = notes()
    with pytest.raises(RuntimeError, match="not registered with a broker"):
        await resources.publish("notes://1")
    broker.register(resources)
    with pytest.raises(InvalidChange, match="none of this set's resources"):
        await resources.publish("tickets://1")


@pytest.mark.parametrize(("uri", "function", "message"), [
    ("notes://{id}", lambda: "", "has no parameter 'id'"),
    ("notes://fixed", lambda id: "", "needs 'id', which is not a variable"),
    ("notes://{tenant}", lambda tenant: "", "cannot be a URI variable"),
    ("notes/{id}", lambda id: "", "not an absolute URI"),
    ("notes://{id}/{id}", lambda id: "", "appears twice"),
    ("notes://{bad-name}", lambda: "", "a variable is written {name}"),
    ("notes://{1}", lambda: "", "a variable is written {name}"),
    ("mcpb://{tenant_name}/notes", lambda tenant_name: "", "record collections'"),
    ("{scheme}://{tenant_name}/{id}", lambda scheme, tenant_name, id: "", "scheme must be written out"),
    ("x{scheme}://notes/{id}", lambda scheme, id: "", "scheme must be written out"),
    ("notes://{year}{month}", lambda year, month: "", "two variables side by side"),
])
def test_a_declaration_that_does_not_fit_its_function_is_refused_at_once(uri: str, function: Any,
                                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResourceSet().resource(uri)(function)


async def test_variables_that_share_a_separator_match_a_long_uri_at_once(make_broker: MakeBroker,
                                                                         connect: Connect) -> None:
    resources = ResourceSet()
    resources.resource("r://{y}-{m}-{d}/x")(lambda y, m, d: f"{y}|{m}|{d}")
    broker = await make_broker()
    broker.register(resources)
    client = connect(broker)
    await client.initialize()
    dashes = "r://" + "-" * (broker.settings.max_uri_length - len("r://"))  # matching it once took seconds
    assert (await client.request("resources/read", {"uri": dashes}))["error"]["code"] == -32002
    assert not resources.owns("r://" + "-" * 20_000 + "/y") and not resources.owns("r://1-" + "2-" * 10_000)
    [content] = (await client.request("resources/read", {"uri": "r://2026-12-07/x"}))["result"]["contents"]
    assert content["text"] == "2026|12|07"
    [content] = (await client.request("resources/read", {"uri": "r://2026-12-07-1/x"}))["result"]["contents"]
    assert content["text"] == "2026|12|07-1"  # a variable ends at the first character of the literal after it


@pytest.mark.parametrize("state", ["\u00b2", "1" * 5000, "ten", "-1"], ids=["superscript", "long", "word", "minus"])
async def test_a_listing_cursor_with_a_forged_position_is_an_invalid_cursor(broker: Broker, connect: Connect,
                                                                            state: str) -> None:
    client = connect(broker)
    await client.initialize()
    cursor = base64.urlsafe_b64encode(json.dumps([0, state]).encode()).decode()
    answer = await client.request("resources/list", {"cursor": cursor})
    assert answer["error"] == {"code": -32602, "message": "Invalid cursor", "data": {"cursor": cursor}}


@pytest.mark.parametrize("uri", ["files://../etc", "files://a/..", "files://./b", "files://%2e%2E/b",
                                 "files://a%2Fb/c", "files://a/b%2fc", "files://a%5Cb/c", "files://a/b%5cc",
                                 "files://a\\b/c"])
async def test_a_variable_that_could_climb_out_of_a_folder_matches_nothing(broker: Broker, connect: Connect,
                                                                           uri: str) -> None:
    client = connect(broker)
    await client.initialize()
    assert (await client.request("resources/read", {"uri": uri}))["error"]["code"] == -32002
    [content] = (await client.request("resources/read", {"uri": "files://a..b/.c"}))["result"]["contents"]
    assert base64.b64decode(content["blob"]) == b"a..b|.c"  # dots within a name are a name


def test_a_uri_is_declared_once() -> None:
    resources = ResourceSet()
    resources.resource("notes://{id}")(lambda id: "")
    with pytest.raises(ValueError, match="declared already"):
        resources.resource("notes://{id}")(lambda id: "")


def test_a_set_named_in_the_providers_setting_is_that_set_itself() -> None:
    from examples.notes import resources

    assert build(Settings(providers=["examples.notes:resources"])).providers == [resources]


def test_mount_broker_registers_the_sets_it_is_given_the_first_answering_first() -> None:
    from fastapi import FastAPI

    from broker.mount import mount_broker

    first, second = ResourceSet(), ResourceSet()
    first.resource("x://shared")(lambda: "first")
    second.resource("x://shared")(lambda: "second")
    second.resource("x://other")(lambda: "other")
    settings = Settings(_env_file=None, metrics=False)  # type: ignore[call-arg]
    broker = mount_broker(FastAPI(), resources=[first, second], settings=settings).broker
    assert broker.resources.owner("x://shared") is first and broker.resources.owner("x://other") is second
