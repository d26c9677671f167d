"""``Demand``: what the deployment wants an upstream to watch, the same on every backend
(docs/UPSTREAMS.md, "One watch for the deployment")."""

from __future__ import annotations

import dataclasses

from broker.backends.base import Backend
from tests.contract.conftest import new_session


async def test_a_later_deadline_wins_and_a_drop_spares_what_was_pushed_back(backend: Backend) -> None:
    demand = backend.demand
    assert await demand.want("notes", ["note://a", "note://b"], 100.0, 10) == []
    assert await demand.want("notes", ["note://a"], 50.0, 10) == []  # an earlier deadline changes nothing
    assert await demand.want("notes", ["note://b"], 200.0, 10) == []
    assert await demand.wanted("notes", 10) == {"note://a": 100.0, "note://b": 200.0}
    await demand.drop("notes", ["note://a", "note://b"], 150.0)  # b was pushed past it meanwhile: kept
    assert await demand.wanted("notes", 10) == {"note://b": 200.0}
    assert await demand.wanted("other", 10) == {}


async def test_past_its_bound_a_new_member_is_refused_and_a_known_one_pushed_back(backend: Backend) -> None:
    demand = backend.demand
    assert await demand.want("notes", ["note://1", "note://2"], 100.0, 2) == []
    assert await demand.want("notes", ["note://3", "note://1"], 300.0, 2) == ["note://3"]
    assert await demand.wanted("notes", 10) == {"note://1": 300.0, "note://2": 100.0}


async def test_a_sessions_upstream_sessions_are_kept_in_its_record(backend: Backend) -> None:
    record = dataclasses.replace(new_session(backend), upstreams={"notes": ["s-1", "2025-11-25"]})
    await backend.sessions.create(record)
    await backend.sessions.update(record.id, upstreams={"notes": ["s-2", "2025-11-25"], "old": ["o", "2025-03-26"]})
    stored = await backend.sessions.get(record.id)
    assert stored is not None
    assert stored.upstreams == {"notes": ["s-2", "2025-11-25"], "old": ["o", "2025-03-26"]}
