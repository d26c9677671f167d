"""File roots (broker/sources/files.py and filewatch.py) against real brokers and a real directory the tests change."""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from mcp import types
from mcp.client.client import Client

from broker.sources.files import file_uri
from tests.integration import modern
from tests.integration.mcp_http import McpSession
from tests.sdk_inbox import Inbox
from tests.support import BrokerProcess, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")

KEYS = json.dumps({"ka": "acme/alice", "kb": "beta/bob"})
MAX_BYTES = 4096
READY = "files: watching"


class Tree:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.acme = base / "acme"
        self.beta = base / "beta"
        self.outside = base / "outside"
        for directory in (self.acme / "docs", self.beta, self.outside):
            directory.mkdir(parents=True)
        (self.acme / "docs" / "a.txt").write_text("hello acme\n")
        (self.acme / "docs" / "b.md").write_text("# title\n")
        (self.acme / "docs" / "c.json").write_text("{}")
        (self.acme / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")
        (self.acme / "big.txt").write_bytes(b"x" * (MAX_BYTES + 1))
        (self.beta / "beta.txt").write_text("beta only")
        (self.outside / "secret.txt").write_text("TOP SECRET")
        (self.acme / "escape.txt").symlink_to(self.outside / "secret.txt")
        (self.acme / "linkdir").symlink_to(self.outside)
        (self.acme / "inside-link.txt").symlink_to(self.acme / "docs" / "a.txt")
        os.mkfifo(self.acme / "fifo")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(self.acme / "sock"))


def started(log: Path, proc: BrokerProcess) -> BrokerProcess:
    """The broker once its watcher runs and has compared the disk (its log says so)."""
    wait_until(lambda: READY in log.read_text(), what="the file watcher")
    return proc


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    made = Tree(tmp_path_factory.mktemp("roots"))
    yield made
    made.sock.close()


@pytest.fixture(scope="module")
def broker(tree: Tree, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    log = tmp_path_factory.mktemp("log") / "broker.log"
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_PAGE_SIZE": "2", "MCP_BROKER_MAX_FILE_BYTES": str(MAX_BYTES),
           "MCP_BROKER_FILE_ROOTS": json.dumps({"acme": str(tree.acme), "beta": str(tree.beta)})}
    with BrokerProcess(env=env, log=log, log_level="info") as proc:
        yield started(log, proc)


def uri(path: Path) -> str:
    return file_uri(str(path))


async def read(http: httpx.AsyncClient, target: str, auth: str = "ka") -> dict[str, Any]:
    response = await modern.call(http, "resources/read", {"uri": target}, name=target, auth=auth)
    reply: dict[str, Any] = response.json()
    return reply


async def listing(http: httpx.AsyncClient, auth: str) -> list[dict[str, Any]]:
    session = await McpSession(http, auth=auth).initialize()
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {}
    pages = 0
    while True:
        result = await session.result("resources/list", params)
        assert len(result["resources"]) <= 2
        items.extend(result["resources"])
        pages += 1
        if "nextCursor" not in result:
            break
        params = {"cursor": result["nextCursor"]}
    assert pages > 1
    return items


async def test_the_tenants_files_are_listed_in_pages_with_type_and_size(tree: Tree, http: httpx.AsyncClient) -> None:
    items = {item["uri"]: item for item in await listing(http, "ka")}
    a = items[uri(tree.acme / "docs" / "a.txt")]
    assert a == {"uri": uri(tree.acme / "docs" / "a.txt"), "name": "a.txt", "mimeType": "text/plain", "size": 11}
    assert items[uri(tree.acme / "logo.png")]["mimeType"] == "image/png"
    assert items[uri(tree.acme / "docs" / "c.json")]["mimeType"] == "application/json"
    assert not any("secret" in u or "beta" in u or "fifo" in u or u.endswith("/sock") for u in items)
    assert uri(tree.beta / "beta.txt") in {item["uri"] for item in await listing_all(http, "kb")}


async def listing_all(http: httpx.AsyncClient, auth: str) -> list[dict[str, Any]]:
    session = await McpSession(http, auth=auth).initialize()
    result = await session.result("resources/list")
    return list(result["resources"])


async def test_text_is_read_as_text_and_binary_as_a_blob(tree: Tree, http: httpx.AsyncClient) -> None:
    text = await read(http, uri(tree.acme / "docs" / "a.txt"))
    assert text["result"]["contents"] == [{"uri": uri(tree.acme / "docs" / "a.txt"), "mimeType": "text/plain",
                                           "text": "hello acme\n"}]
    blob = (await read(http, uri(tree.acme / "logo.png")))["result"]["contents"][0]
    assert blob["mimeType"] == "image/png" and base64.b64decode(blob["blob"]) == b"\x89PNG\r\n\x1a\n\xff\x00"
    inside = await read(http, uri(tree.acme / "inside-link.txt"))  # a symlink that stays inside the root
    assert inside["result"]["contents"][0]["text"] == "hello acme\n"


async def test_a_name_that_needs_encoding_is_read_by_its_one_uri(tree: Tree, http: httpx.AsyncClient) -> None:
    (tree.acme / "with space #1.txt").write_text("spaced")
    target = "file://" + quote(str(tree.acme / "with space #1.txt"))
    assert target.endswith("with%20space%20%231.txt")
    assert (await read(http, target))["result"]["contents"][0]["text"] == "spaced"


async def test_the_roots_template_is_offered_to_its_tenant_only(tree: Tree, http: httpx.AsyncClient) -> None:
    for auth, root, other in (("ka", tree.acme, tree.beta), ("kb", tree.beta, tree.acme)):
        session = await McpSession(http, auth=auth).initialize()
        templates = (await session.result("resources/templates/list"))["resourceTemplates"]
        assert [t["uriTemplate"] for t in templates if t["uriTemplate"].startswith("file:")] == [
            f"file://{root}/{{path}}"]
        assert str(other) not in json.dumps(templates)


async def test_another_tenants_file_is_not_found_exactly_as_a_missing_one(tree: Tree, http: httpx.AsyncClient) -> None:
    foreign = await read(http, uri(tree.beta / "beta.txt"), auth="ka")
    missing = await read(http, uri(tree.acme / "nope.txt"), auth="ka")
    assert foreign["error"]["code"] == missing["error"]["code"] == -32602
    assert foreign["error"]["message"].replace("beta/beta", "X") == missing["error"]["message"].replace(
        "acme/nope", "X")
    session = await McpSession(http, auth="ka").initialize()
    refused = await session.call("resources/subscribe", {"uri": uri(tree.beta / "beta.txt")})
    assert refused["error"]["code"] == -32002
    assert (await read(http, uri(tree.beta / "beta.txt"), auth="kb"))["result"]["contents"][0]["text"] == "beta only"


def escapes(tree: Tree) -> list[tuple[str, str]]:
    acme = "file://" + quote(str(tree.acme))
    return [
        ("dotdot", f"{acme}/../outside/secret.txt"),
        ("dotdot-deep", f"{acme}/docs/../../outside/secret.txt"),
        ("encoded-dots", f"{acme}/%2e%2e/outside/secret.txt"),
        ("encoded-dots-upper", f"{acme}/%2E%2E/outside/secret.txt"),
        ("encoded-slash", f"{acme}/..%2foutside%2fsecret.txt"),
        ("encoded-slash-upper", f"{acme}/docs%2Fa.txt"),
        ("dot-segment", f"{acme}/./docs/a.txt"),
        ("double-slash", f"{acme}//docs/a.txt"),
        ("symlink-out", f"{acme}/escape.txt"),
        ("symlinked-parent", f"{acme}/linkdir/secret.txt"),
        ("absolute-outside", uri(tree.outside / "secret.txt")),
        ("nul", f"{acme}/docs/a.txt%00.png"),
        ("query", f"{acme}/docs/a.txt?x=1"),
    ]


async def test_nothing_outside_a_root_is_readable(tree: Tree, http: httpx.AsyncClient) -> None:
    for name, target in escapes(tree):
        reply = await read(http, target)
        assert "error" in reply, (name, reply)
        assert reply["error"]["code"] == -32602, (name, reply)
        assert "SECRET" not in json.dumps(reply) and "hello acme" not in json.dumps(reply), name
        session = await McpSession(http, auth="ka").initialize()
        watched = await session.call("resources/subscribe", {"uri": target})
        assert "error" in watched or not target.startswith("file://" + quote(str(tree.acme))), (name, watched)


async def test_what_is_not_a_regular_file_or_too_large_gets_a_precise_error(
        tree: Tree, http: httpx.AsyncClient) -> None:
    for name, kind in (("fifo", "FIFO"), ("sock", "socket"), ("docs", "directory")):
        error = (await read(http, uri(tree.acme / name)))["error"]
        assert error["code"] == -32602 and error["data"] == {"uri": uri(tree.acme / name), "kind": kind}, error
    error = (await read(http, uri(tree.acme / "big.txt")))["error"]
    assert error["code"] == -32602 and "too large" in error["message"]
    assert error["data"] == {"uri": uri(tree.acme / "big.txt"), "size": MAX_BYTES + 1, "maxBytes": MAX_BYTES}


async def test_a_change_notifies_a_legacy_subscriber_within_a_second(tree: Tree, http: httpx.AsyncClient) -> None:
    path = tree.acme / "docs" / "watched.txt"
    path.write_text("v1")
    session = await McpSession(http, auth="ka").initialize()
    await session.subscribe(uri(path))
    async with session.stream() as stream:
        began = time.monotonic()
        path.write_text("v2")
        event = await stream.next_message()
        assert event.method == "notifications/resources/updated" and event.uri == uri(path)
        assert time.monotonic() - began < 1.0
    assert (await read(http, uri(path)))["result"]["contents"][0]["text"] == "v2"


async def next_about(stream: modern.ListenStream, *methods: str) -> dict[str, Any]:
    while True:
        message = await stream.next()
        assert message is not None
        if message.get("method") in methods:
            return message


async def test_create_and_delete_notify_a_listen_and_change_the_list(tree: Tree, http: httpx.AsyncClient) -> None:
    path = tree.acme / "docs" / "fresh.txt"
    async with modern.listen(http, [uri(path)], auth="ka", resourcesListChanged=True) as stream:
        await next_about(stream, "notifications/subscriptions/acknowledged")
        began = time.monotonic()
        path.write_text("new")
        got = {(await next_about(stream, "notifications/resources/updated",
                                 "notifications/resources/list_changed"))["method"] for _ in range(2)}
        assert got == {"notifications/resources/updated", "notifications/resources/list_changed"}
        assert time.monotonic() - began < 1.0
        assert uri(path) in {item["uri"] for item in await listing(http, "ka")}
        path.unlink()
        got = {(await next_about(stream, "notifications/resources/updated",
                                 "notifications/resources/list_changed"))["method"] for _ in range(2)}
        assert got == {"notifications/resources/updated", "notifications/resources/list_changed"}
        assert uri(path) not in {item["uri"] for item in await listing(http, "ka")}


async def test_a_burst_of_writes_to_one_file_is_one_notification(tree: Tree, http: httpx.AsyncClient) -> None:
    burst, sentinel = tree.acme / "docs" / "burst.txt", tree.acme / "docs" / "zzz-sentinel.txt"
    burst.write_text("0")
    sentinel.write_text("0")
    session = await McpSession(http, auth="ka").initialize()
    await session.subscribe(uri(burst), uri(sentinel))
    async with session.stream() as stream:
        for i in range(20):  # far quicker than watchfiles' 50 ms step: one batch
            with open(burst, "a") as handle:
                handle.write(str(i))
        sentinel.write_text("1")  # after the burst; published after it (same batch, path order, or a later one)
        seen: list[str] = []
        while not seen or seen[-1] != uri(sentinel):
            event = await stream.next_message()
            if event.method == "notifications/resources/updated":
                seen.append(str(event.uri))
    # watchfiles guarantees one batch for events less than `step` apart; a pause of the test process
    # longer than that between two writes could split the burst in two, never more here.
    assert 1 <= seen.count(uri(burst)) <= 2, seen


@pytest.fixture(scope="module")
def open_broker(tree: Tree, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """Anonymous callers (the default tenant), for the official SDK client."""
    root = tree.base / "default"
    root.mkdir()
    (root / "note.txt").write_text("first")
    log = tmp_path_factory.mktemp("log") / "open.log"
    with BrokerProcess(env={"MCP_BROKER_FILE_ROOTS": json.dumps({"default": str(root)})}, log=log,
                       log_level="info") as proc:
        yield started(log, proc)


async def test_the_sdk_client_subscribes_to_a_file_and_reads_its_new_content(
        tree: Tree, open_broker: BrokerProcess) -> None:
    inbox = Inbox()
    path = tree.base / "default" / "note.txt"
    async with Client(open_broker.mcp_url, mode="legacy", message_handler=inbox.handler) as client:
        await client.subscribe_resource(uri(path))
        path.write_text("second")
        await inbox.wait_for(types.ResourceUpdatedNotification, uri(path))
        read_back = await client.read_resource(uri(path), cache_mode="bypass")
        assert read_back.contents[0].text == "second"  # type: ignore[union-attr]


def test_a_root_that_is_not_a_directory_stops_the_start_with_one_line(tree: Tree) -> None:
    import subprocess

    from tests.support import BIN

    for roots in ({"acme": str(tree.base / "missing")}, {"acme": "relative/dir"},
                  {"acme": str(tree.acme / "docs" / "a.txt")}, {"bad tenant!": str(tree.acme)}):
        env = {**os.environ, "MCP_BROKER_FILE_ROOTS": json.dumps(roots)}
        done = subprocess.run([str(BIN), "serve", "--port", "1"], env=env, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode != 0
        assert "MCP_BROKER_FILE_ROOTS" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr

