"""How fan-out turns a batch of changes into notifications."""

from __future__ import annotations

from broker.changes import Change, ChangeKind
from broker.fanout import plan


def test_a_record_change_notifies_the_record_and_its_collection() -> None:
    change = Change("t", "mcpb://t/P/1")
    updates, listed = plan([("0:1-0", change)])
    assert updates["t"] == {"mcpb://t/P/1": ("0:1-0", change), "mcpb://t/P": ("0:1-0", change)}
    assert listed == {}


def test_repeated_changes_of_one_uri_coalesce_into_the_newest() -> None:
    first = Change("t", "x:a", meta={"v": 1})
    other = Change("t", "x:b")
    last = Change("t", "x:a", meta={"v": 2})
    updates, _ = plan([("0:1-0", first), ("0:2-0", other), ("0:3-0", last)])
    assert updates["t"] == {"x:b": ("0:2-0", other), "x:a": ("0:3-0", last)}
    assert list(updates["t"]) == ["x:b", "x:a"]  # ordered by the newest change behind each URI


def test_changes_stay_within_their_tenant() -> None:
    updates, _ = plan([("0:1-0", Change("t1", "x:a")), ("0:2-0", Change("t2", "x:a"))])
    assert set(updates) == {"t1", "t2"}
    assert updates["t1"]["x:a"][1].tenant == "t1"


def test_creating_or_deleting_changes_the_list_but_updating_does_not() -> None:
    _, listed = plan([("0:1-0", Change("t1", "x:a", ChangeKind.CREATED)),
                      ("0:2-0", Change("t2", "x:b", ChangeKind.DELETED)),
                      ("0:3-0", Change("t3", "x:c", ChangeKind.UPDATED)),
                      ("0:4-0", Change("t1", "x:d", ChangeKind.DELETED))])
    assert listed == {"t1": "0:4-0", "t2": "0:2-0"}  # each with the newest change that changed it


def test_an_empty_batch_plans_nothing() -> None:
    assert plan([]) == ({}, {})
