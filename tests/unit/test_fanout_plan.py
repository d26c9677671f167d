"""How fan-out turns a batch of changes into notifications."""

from __future__ import annotations

from broker.changes import Change, ChangeKind
from broker.fanout import plan


def test_a_record_change_notifies_the_record_and_its_collection() -> None:
    updates, listed = plan([Change("t", "mcpb://t/P/1")])
    assert list(updates["t"]) == ["mcpb://t/P/1", "mcpb://t/P"]
    assert listed == set()


def test_repeated_changes_of_one_uri_coalesce_into_the_newest() -> None:
    first = Change("t", "x:a", meta={"v": 1})
    other = Change("t", "x:b")
    last = Change("t", "x:a", meta={"v": 2})
    updates, _ = plan([first, other, last])
    assert updates["t"] == {"x:b": other, "x:a": last}
    assert list(updates["t"]) == ["x:b", "x:a"]  # ordered by the newest change behind each URI


def test_changes_stay_within_their_tenant() -> None:
    updates, _ = plan([Change("t1", "x:a"), Change("t2", "x:a")])
    assert set(updates) == {"t1", "t2"}
    assert updates["t1"]["x:a"].tenant == "t1"


def test_creating_or_deleting_changes_the_list_but_updating_does_not() -> None:
    _, listed = plan([Change("t1", "x:a", ChangeKind.CREATED), Change("t2", "x:b", ChangeKind.DELETED),
                      Change("t3", "x:c", ChangeKind.UPDATED)])
    assert listed == {"t1", "t2"}


def test_an_empty_batch_plans_nothing() -> None:
    assert plan([]) == ({}, set())
