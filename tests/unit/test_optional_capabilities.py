"""Optional capabilities of a seam are named protocols: what a user's object has is used, what it lacks is not asked."""

from __future__ import annotations

from collections.abc import Mapping

from broker.auth import Lifecycle, Principal, ProtectedResource
from broker.config import Settings
from broker.runtime import Broker
from broker.transport.edge import scope_challenger


class Plain:
    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return Principal("default", "anonymous")


class Held(Plain):
    """An authenticator that holds a connection, and publishes resource metadata."""

    resource_metadata = "https://rs.example/.well-known/oauth-protected-resource"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")

    async def close(self) -> None:
        self.calls.append("close")


async def test_an_authenticator_with_a_lifecycle_is_started_and_closed_with_the_broker() -> None:
    held = Held()
    assert isinstance(held, Lifecycle) and not isinstance(Plain(), Lifecycle)
    broker = Broker(Settings(_env_file=None), authenticator=held)  # type: ignore[call-arg]
    await broker.start()
    assert held.calls == ["start"]
    await broker.stop()
    assert held.calls == ["start", "close"]


async def test_an_authenticator_without_one_is_neither_started_nor_closed() -> None:
    broker = Broker(Settings(_env_file=None), authenticator=Plain())  # type: ignore[call-arg]
    await broker.start()
    await broker.stop()  # nothing asked of it but authenticate


def test_a_scope_challenge_names_the_resource_metadata_only_of_an_authenticator_that_has_it() -> None:
    assert isinstance(Held(), ProtectedResource) and not isinstance(Plain(), ProtectedResource)
    assert scope_challenger(Held())("records:write") == (
        'Bearer error="insufficient_scope", scope="records:write", '
        'resource_metadata="https://rs.example/.well-known/oauth-protected-resource"')
    assert "resource_metadata" not in scope_challenger(Plain())("records:write")
