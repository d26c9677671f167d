"""``resources/list`` pages across providers with opaque cursors; a cursor the broker never issued is refused."""

from __future__ import annotations

import base64

import orjson
import pytest

from broker.auth import Principal
from broker.backends.memory import MemoryBackend
from broker.changes import Change
from broker.config import Settings
from broker.resources.base import BadCursor, Resources
from broker.resources.records import RecordsProvider

ALICE = Principal("t1", "alice")


class Numbers:
    """A provider of ``num:<i>`` resources, paged by the last index listed."""

    def __init__(self, count: int) -> None:
        self.count = count

    def owns(self, uri: str) -> bool:
        return uri.startswith("num:")

    def can_watch(self, principal: Principal, uri: str) -> bool:
        return True

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[dict], str | None]:
        start = int(state) if state else 0
        end = min(start + limit, self.count)
        items = [{"uri": f"num:{i}", "name": str(i)} for i in range(start, end)]
        return items, (str(end) if end < self.count else None)

    async def read(self, principal: Principal, uri: str) -> list[dict]:
        return [{"uri": uri, "text": uri[4:]}]

    def templates(self, principal: Principal) -> list[dict]:
        return []


async def list_all(resources: Resources, page_size: int) -> list[str]:
    uris: list[str] = []
    cursor: str | None = None
    for _ in range(100):
        page, cursor = await resources.list_page(ALICE, cursor, page_size)
        assert len(page) <= page_size
        uris.extend(item["uri"] for item in page)
        if cursor is None:
            return uris
    raise AssertionError("the listing never ended")


@pytest.mark.parametrize("page_size", [1, 2, 3, 7, 100])
async def test_paging_through_every_provider_lists_each_resource_once(page_size: int) -> None:
    resources = Resources([Numbers(5), Numbers(0), Numbers(2)])
    uris = await list_all(resources, page_size)
    assert uris == [f"num:{i}" for i in range(5)] + ["num:0", "num:1"]


async def test_record_collections_list_each_collection_before_its_records() -> None:
    backend = MemoryBackend(Settings(_env_file=None))  # type: ignore[call-arg]
    for collection, rid in [("b", "2"), ("a", "1"), ("b", "1"), ("a", "3")]:
        await backend.records.write("t1", collection, rid, b"{}", Change("t1", f"mcpb://t1/{collection}/{rid}"))
    await backend.records.write("t2", "a", "9", b"{}", Change("t2", "mcpb://t2/a/9"))
    for page_size in (1, 2, 4, 100):
        assert await list_all(Resources([RecordsProvider(backend.records)]), page_size) == [
            "mcpb://t1/a", "mcpb://t1/a/1", "mcpb://t1/a/3", "mcpb://t1/b", "mcpb://t1/b/1", "mcpb://t1/b/2"]


def forged(value: object) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(value)).decode()


@pytest.mark.parametrize(
    "cursor",
    ["", "not a cursor", "%%%", base64.urlsafe_b64encode(b"\xff\xfe").decode(), forged({"a": 1}), forged([0]),
     forged(["0", None]), forged([0, 5]), forged([7, None]), forged([-1, None])],
    ids=repr,
)
async def test_a_cursor_the_broker_never_issued_is_a_bad_cursor(cursor: str) -> None:
    with pytest.raises(BadCursor):
        await Resources([Numbers(3)]).list_page(ALICE, cursor, 2)
