"""The REST API: records of a collection, and publishing changes for data that lives elsewhere."""

from __future__ import annotations

import secrets

import httpx
import orjson
import pytest

from tests.integration.mcp_http import McpSession


def collection() -> str:
    return "c" + secrets.token_hex(4)


async def test_put_creates_then_replaces_a_record(http: httpx.AsyncClient) -> None:
    name = collection()
    created = await http.put(f"/collections/{name}/1", json={"a": 1, "b": 2})
    assert created.status_code == 201
    assert created.json() == {"uri": f"mcpb://default/{name}/1", "created": True}
    replaced = await http.put(f"/collections/{name}/1", json={"a": 3})
    assert replaced.status_code == 200 and replaced.json()["created"] is False
    assert (await http.get(f"/collections/{name}/1")).json() == {"a": 3}


async def test_any_json_value_is_a_record(http: httpx.AsyncClient) -> None:
    name = collection()
    for rid, value in [("list", [1, 2]), ("text", "hello"), ("number", 4.5), ("null", None)]:
        assert (await http.put(f"/collections/{name}/{rid}", content=orjson.dumps(value))).status_code == 201
        response = await http.get(f"/collections/{name}/{rid}")
        assert response.headers["content-type"].startswith("application/json")
        assert response.json() == value


async def test_patch_merges_into_the_record(http: httpx.AsyncClient) -> None:
    name = collection()
    await http.put(f"/collections/{name}/1", json={"a": 1, "nested": {"x": 1, "y": 2}, "gone": True})
    patched = await http.patch(f"/collections/{name}/1", json={"a": 2, "nested": {"y": None}, "gone": None})
    assert patched.status_code == 200
    assert patched.json() == {"a": 2, "nested": {"x": 1}}
    assert (await http.get(f"/collections/{name}/1")).json() == {"a": 2, "nested": {"x": 1}}


async def test_patching_a_missing_record_is_404(http: httpx.AsyncClient) -> None:
    assert (await http.patch(f"/collections/{collection()}/1", json={"a": 1})).status_code == 404


async def test_delete_removes_a_record_once(http: httpx.AsyncClient) -> None:
    name = collection()
    await http.put(f"/collections/{name}/1", json={})
    first = await http.delete(f"/collections/{name}/1")
    assert first.status_code == 204 and first.content == b""
    assert (await http.delete(f"/collections/{name}/1")).status_code == 404
    assert (await http.get(f"/collections/{name}/1")).status_code == 404


async def test_collections_list_their_records_in_pages(http: httpx.AsyncClient) -> None:
    name = collection()
    for rid in ["c", "a", "b"]:
        await http.put(f"/collections/{name}/{rid}", json={})
    first = (await http.get(f"/collections/{name}", params={"limit": 2})).json()
    assert [r["id"] for r in first["records"]] == ["a", "b"]
    assert first["uri"] == f"mcpb://default/{name}" and first["next"] == "b"
    rest = (await http.get(f"/collections/{name}", params={"after": first["next"], "limit": 2})).json()
    assert [r["uri"] for r in rest["records"]] == [f"mcpb://default/{name}/c"] and "next" not in rest
    assert name in {c["name"] for c in (await http.get("/collections")).json()["collections"]}


@pytest.mark.parametrize("body", [b"{", b"", b"{'a': 1}", b"\xff"])
async def test_a_body_that_is_not_json_is_400(http: httpx.AsyncClient, body: bytes) -> None:
    name = collection()
    assert (await http.put(f"/collections/{name}/1", content=body)).status_code == 400
    await http.put(f"/collections/{name}/1", json={})
    assert (await http.patch(f"/collections/{name}/1", content=body)).status_code == 400
    assert (await http.post("/changes", content=body)).status_code == 400


async def test_an_oversized_record_is_413(http: httpx.AsyncClient) -> None:
    name = collection()
    too_big = {"pad": "x" * 300_000}  # the default limit is 256 KiB
    assert (await http.put(f"/collections/{name}/1", json=too_big)).status_code == 413
    assert (await http.get(f"/collections/{name}/1")).status_code == 404
    await http.put(f"/collections/{name}/1", json={"pad": "x" * 200_000})
    assert (await http.patch(f"/collections/{name}/1", json={"more": "y" * 100_000})).status_code == 413


@pytest.mark.parametrize("path", ["/collections/a%20b/1", "/collections/ok/a%2Fb", "/collections/..x%3F/1",
                                  "/collections/" + "n" * 129 + "/1", "/collections/ok/%C3%A9",
                                  "/collections/.../1"])
async def test_names_that_are_not_uri_safe_are_422(http: httpx.AsyncClient, path: str) -> None:
    response = await http.put(path, json={})
    assert response.status_code in (404, 422), response.text  # 404 only where the router cannot match at all
    assert response.status_code != 201


async def test_a_dot_only_record_id_is_refused_everywhere(http: httpx.AsyncClient) -> None:
    for method in ("PUT", "PATCH", "GET", "DELETE"):
        response = await http.request(method, "/collections/ok/...", json={})
        assert response.status_code == 422, (method, response.status_code)


async def test_posting_changes_notifies_subscribers(http: httpx.AsyncClient) -> None:
    one, two, three = (f"https://example.com/{secrets.token_hex(4)}" for _ in range(3))
    mcp = await McpSession(http).initialize()
    await mcp.subscribe(one, two, three)
    async with mcp.stream() as stream:
        single = await http.post("/changes", json={"uri": one, "meta": {"etag": "7"}})
        assert single.status_code == 202 and len(single.json()["ids"]) == 1
        first = await stream.next_message()
        assert first.message["params"] == {"uri": one, "_meta": {"etag": "7"}}
        batch = await http.post("/changes", json=[{"uri": two}, {"uri": three, "kind": "deleted"}])
        assert batch.status_code == 202 and len(batch.json()["ids"]) == 2
        received = await stream.messages(3)
    assert {e.uri for e in received if e.uri} == {two, three}
    assert [e.method for e in received].count("notifications/resources/list_changed") == 1


@pytest.mark.parametrize("body", [[], [1], {"uri": 5}, {"kind": "updated"}, {"uri": "x:y", "kind": "exploded"},
                                  {"uri": "no scheme"}, {"uri": "x:y", "meta": [1]}, "x:y",
                                  {"uri": "x:" + "y" * 3000}])
async def test_malformed_changes_are_422(http: httpx.AsyncClient, body: object) -> None:
    assert (await http.post("/changes", json=body)).status_code == 422


async def test_a_record_write_notifies_the_record_and_its_collection(http: httpx.AsyncClient) -> None:
    name = collection()
    mcp = await McpSession(http).initialize()
    await mcp.subscribe(f"mcpb://default/{name}/1", f"mcpb://default/{name}")
    async with mcp.stream() as stream:
        await http.put(f"/collections/{name}/1", json={"v": 1})
        received = await stream.messages(3)
        assert {e.uri for e in received if e.uri} == {f"mcpb://default/{name}/1", f"mcpb://default/{name}"}
        assert [e.method for e in received].count("notifications/resources/list_changed") == 1
        await http.delete(f"/collections/{name}/1")
        received = await stream.messages(3)
        assert [e.method for e in received].count("notifications/resources/list_changed") == 1


@pytest.mark.parametrize(("method", "path"), [("PUT", "/collections/c/1"), ("POST", "/changes"),
                                              ("DELETE", "/collections/c/1")])
async def test_a_page_on_a_foreign_origin_cannot_write(http: httpx.AsyncClient, method: str, path: str) -> None:
    response = await http.request(method, path, json={"uri": "https://example.com/x"},
                                  headers={"Origin": "http://evil.example.com"})
    assert response.status_code == 403


async def test_a_local_page_may_publish(http: httpx.AsyncClient) -> None:
    response = await http.post("/changes", json={"uri": "https://example.com/x"},
                               headers={"Origin": "http://localhost:5173"})
    assert response.status_code == 202


async def test_a_declared_oversized_change_is_refused_before_it_is_read(http: httpx.AsyncClient) -> None:
    response = await http.post("/changes", content=b"[" + b" " * (2 << 20) + b"]",
                               headers={"content-type": "application/json"})
    assert response.status_code == 413

