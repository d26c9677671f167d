"""Record writes through three workers at once: no update is lost, no creation is reported twice."""

from __future__ import annotations

import asyncio
import secrets

import httpx


async def test_concurrent_patches_through_every_worker_all_land(http: httpx.AsyncClient) -> None:
    name = "c" + secrets.token_hex(4)
    await http.put(f"/collections/{name}/1", json={})
    patches = [http.patch(f"/collections/{name}/1", json={f"k{i}": i}) for i in range(30)]
    assert {r.status_code for r in await asyncio.gather(*patches)} == {200}
    assert (await http.get(f"/collections/{name}/1")).json() == {f"k{i}": i for i in range(30)}


async def test_racing_puts_of_a_new_record_report_one_creation(http: httpx.AsyncClient) -> None:
    name = "c" + secrets.token_hex(4)
    puts = await asyncio.gather(*(http.put(f"/collections/{name}/1", json={"n": i}) for i in range(10)))
    assert sorted(r.status_code for r in puts) == [200] * 9 + [201]
