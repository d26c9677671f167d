"""``serve --demo``: a collection whose record changes every few seconds, so notifications flow at once."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from broker.errors import BackendUnavailable
from broker.uris import record_uri

if TYPE_CHECKING:
    from broker.core import Broker

logger = logging.getLogger(__name__)

COLLECTION = "demo"
RECORD = "clock"


async def run_demo(broker: Broker) -> None:
    tenant = broker.settings.default_tenant
    logger.info("demo: %s changes every %.1fs", record_uri(tenant, COLLECTION, RECORD), broker.settings.demo_interval)
    await broker.records.put(tenant, COLLECTION, "readme", {"text": "Subscribe to the clock record and watch it tick."})
    tick = 0
    while True:
        tick += 1
        try:
            await broker.records.put(tenant, COLLECTION, RECORD, {"tick": tick, "time": time.time()})
        except BackendUnavailable:
            logger.warning("demo: backend unavailable")
        await asyncio.sleep(broker.settings.demo_interval)
