"""A provider's bug reaches the client as an internal error, never as a crash of the request."""

from __future__ import annotations

from typing import Any

import pytest

from broker.auth import Principal
from broker.config import Settings
from broker.methods import Call
from broker.protocol import jsonrpc as rpc
from broker.runtime import Broker


class BrokenProvider:
    def owns(self, uri: str) -> bool:
        return uri.startswith("broken://")

    def can_watch(self, principal: Principal, uri: str) -> bool:
        return True

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Any], None]:
        raise RuntimeError("listing exploded")

    async def read(self, principal: Principal, uri: str) -> list[dict[str, Any]]:
        raise RuntimeError("read exploded")

    def templates(self, principal: Principal) -> list[dict[str, Any]]:
        return []


@pytest.mark.parametrize("modern", [False, True])
async def test_a_provider_that_raises_gives_an_internal_error(modern: bool) -> None:
    broker = Broker(Settings(_env_file=None))  # type: ignore[call-arg]
    broker.register(BrokenProvider())
    call = Call(Principal("default", "anonymous"), modern)
    with pytest.raises(rpc.RpcError) as raised:
        await broker.methods.call(call, "resources/read", {"uri": "broken://x"})
    assert raised.value.code == rpc.INTERNAL_ERROR
    assert "exploded" not in raised.value.message  # internals stay in the log
