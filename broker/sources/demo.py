"""``serve --demo``: a collection whose record changes every few seconds, so notifications flow at once.

The first change source: ``DemoSource`` writes the demo tenant's clock record on one worker of
the deployment (it is exclusive), and ``demo_provider`` serves the example documents.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from broker.errors import BackendUnavailable, PublishRefused, raise_if_cancelled
from broker.publisher import Publisher
from broker.resources.records import Records
from broker.resources.static import StaticProvider, StaticResource, Template
from broker.uris import record_uri

logger = logging.getLogger(__name__)

COLLECTION = "demo"
RECORD = "clock"
#: 1x1 transparent PNG.
_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
)


def demo_provider() -> StaticProvider:
    """Example documents under ``test://``: a text, a binary, a watched resource and a template.

    They are also the fixtures the MCP conformance suite reads (``make interop``).
    """
    return StaticProvider(
        ("test://",),
        [
            StaticResource("test://static-text", "static-text", "text/plain",
                           text="This is the content of a static text resource."),
            StaticResource("test://static-binary", "static-binary", "image/png", blob=_PNG),
            StaticResource("test://watched-resource", "watched-resource", "text/plain",
                           text="Publish a change for this URI (POST /changes) to notify its subscribers."),
        ],
        [Template("test://template/{id}/data", "template-data", "application/json",
                  lambda args: orjson.dumps({"id": args["id"], "templateTest": True}).decode())],
    )


class DemoSource:
    """Writes ``mcpb://<tenant>/demo/clock`` every ``interval`` seconds (and a readme record once)."""

    name = "demo"
    exclusive = True

    def __init__(self, records: Records, tenant: str, interval: float) -> None:
        self.records = records
        self.tenant = tenant
        self.interval = interval

    async def run(self, publisher: Publisher) -> None:
        # The record store publishes each write's change through ``publisher`` itself.
        tenant = self.tenant
        logger.info("demo: %s changes every %.1fs", record_uri(tenant, COLLECTION, RECORD), self.interval)
        tick = 0
        while True:
            tick += 1
            try:
                if tick == 1:
                    await self.records.put(tenant, COLLECTION, "readme",
                                           {"text": "Subscribe to the clock record and watch it tick."})
                await self.records.put(tenant, COLLECTION, RECORD, {"tick": tick, "time": time.time()})
            except BackendUnavailable:
                raise_if_cancelled()
                logger.warning("demo: backend unavailable")
            except PublishRefused as exc:  # the change log is full: the next tick tries again
                logger.warning("demo: %s", exc)
            await asyncio.sleep(self.interval)
