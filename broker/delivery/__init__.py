"""Delivery: the streams one worker holds, and how frames reach them.

``stream`` (what every stream shares: writer, end reasons, the registry), ``legacy`` (a legacy
session's GET stream, a cursor into its inbox), ``listen`` (2026-07-28 listens and their index),
``hub`` (the timers, health check and shutdown over all of them).
"""

from __future__ import annotations

from broker.delivery.hub import Hub
from broker.delivery.legacy import LegacyServices, LegacyStream, coalesce
from broker.delivery.listen import Listen, ListenIndex
from broker.delivery.stream import EndReason, Stream, StreamMetrics, Streams, Writer

__all__ = ["EndReason", "Hub", "LegacyServices", "LegacyStream", "Listen", "ListenIndex", "Stream", "StreamMetrics",
           "Streams", "Writer", "coalesce"]
