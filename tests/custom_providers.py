"""Factories for ``MCP_BROKER_PROVIDERS`` in the tests (``tests.custom_providers:<name>``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from broker.auth import Principal
from broker.config import Settings
from broker.errors import NotFound
from broker.sources.extensions import ProviderChange


class Notes:
    """``notes://<id>``: a counter per note that its own change stream bumps every 0.2 s."""

    name = "notes"
    exclusive = True

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.versions = {"1": 0}

    def owns(self, uri: str) -> bool:
        return uri.startswith("notes://")

    def can_watch(self, principal: Principal, uri: str) -> bool:
        return True

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Any], str | None]:
        return [{"uri": f"notes://{key}", "name": key} for key in self.versions], None

    async def read(self, principal: Principal, uri: str) -> list[dict[str, Any]]:
        key = uri.removeprefix("notes://")
        if key not in self.versions:
            raise NotFound(uri)
        return [{"uri": uri, "mimeType": "application/json", "text": json.dumps({"version": self.versions[key]})}]

    def templates(self, principal: Principal) -> list[dict[str, Any]]:
        return []

    async def subscribe(self) -> AsyncIterator[ProviderChange]:
        while True:
            await asyncio.sleep(0.2)
            self.versions["1"] += 1
            yield ProviderChange(self.tenant, "notes://1", "updated", {"version": self.versions["1"]})


def live(settings: Settings) -> Notes:
    """A factory that takes the settings."""
    return Notes(settings.default_tenant)


def not_a_provider() -> object:
    """A factory whose product the broker cannot use."""
    return 42
