"""A ``ChangeSource`` in one file: a URI that changes every few seconds, published on one worker.

``exclusive`` makes every worker of the deployment compete for the source's lease, so the
ticks are published once however many workers run. Wire it in with one line::

    broker.add_source(Ticker("https://example.com/feed", tenant="acme", every=5.0))
"""

from __future__ import annotations

import asyncio

from broker.publisher import Publisher


class Ticker:
    exclusive = True

    def __init__(self, uri: str, *, tenant: str, every: float) -> None:
        self.name = "ticker"
        self.uri = uri
        self.tenant = tenant
        self.every = every
        self.ticks = 0

    async def run(self, publisher: Publisher) -> None:
        while True:
            self.ticks += 1
            await publisher.publish(self.uri, tenant=self.tenant, meta={"tick": self.ticks}, source=self.name)
            await asyncio.sleep(self.every)
