"""Delivery: the streams one worker holds, and how frames reach them.

``stream`` (what every stream shares: writer, end reasons, the registry), ``listen`` (plain
2026-07-28 listens and their index), ``broadcast`` (the listen broadcast, received while listens
are open), ``hub`` (the timers, health check and shutdown over all of them). The streams that
read a feed (a 2025 session's, a resumable listen's) are views of it, in ``broker.feeds``.
"""

from __future__ import annotations

from broker.delivery.hub import Hub
from broker.delivery.listen import Listen, ListenIndex
from broker.delivery.stream import EndReason, Stream, StreamMetrics, Streams, Writer

__all__ = ["EndReason", "Hub", "Listen", "ListenIndex", "Stream", "StreamMetrics", "Streams", "Writer"]
