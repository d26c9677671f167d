"""Session inboxes in memory: ``base.Inboxes``.

Every method runs on the event loop and none awaits between reading and writing shared state,
so each is one atomic step: an append and the wake-ups it causes cannot be split by a watcher's
read (the replay -> live handoff), and ``start_stream`` loads, claims and reads in one step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from broker.backends.memory.state import Inbox, SessionState
from broker.backends.types import (
    CLOSE_ALL,
    Frame,
    InboxRead,
    StreamClaim,
    StreamStart,
    Wake,
    WakeHandler,
    change_position,
    inbox_gap,
)
from broker.metrics import NO_METRICS, Metrics

__all__ = ["MemoryInboxes"]


class MemoryInboxes:
    """Each session's bounded inbox of frames, its watchers and its one live stream."""

    def __init__(self, state: SessionState, metrics: Metrics = NO_METRICS) -> None:
        self._state = state
        self._trimmed = metrics.counter("mcp_broker_inbox_trimmed_total")

    async def append(self, batch: Sequence[tuple[str, Frame]]) -> list[str]:
        state = self._state
        inboxes, watchers = state.inboxes, state.watchers
        gone: list[str] = []
        now = time.monotonic()
        maxlen = state.settings.inbox_maxlen
        positions: dict[str, tuple[str, str] | None] = {}
        #: What this call appends is weighed against what came before it, not against itself:
        #: one change's frames for several URIs of a session all land.
        advanced: dict[tuple[Inbox, str], str] = {}
        trimmed = 0
        for sid, frame in batch:
            inbox = inboxes.get(sid)
            if inbox is None:
                gone.append(sid)
                continue
            if frame.change:
                if frame.change in positions:
                    position = positions[frame.change]
                else:
                    position = positions[frame.change] = change_position(frame.change)
                if position is not None:
                    partition, at = position
                    if inbox.newest is not None and at <= inbox.newest.get(partition, ""):
                        continue  # a change this session was given already: a redone batch
                    if at > advanced.get((inbox, partition), ""):
                        advanced[(inbox, partition)] = at
            inbox.head += 1
            entries = inbox.entries
            if not isinstance(entries, deque):
                entries = inbox.entries = deque()
            entries.append((inbox.head, frame, now))
            while len(entries) > maxlen:
                entries.popleft()
                trimmed += 1
            if sid in watchers:  # no wake-up to build for a session nobody watches
                watchers.call(sid, Wake("frames", inbox.head, frame=frame))
        for (inbox, partition), at in advanced.items():
            if inbox.newest is None:
                inbox.newest = {}
            inbox.newest[partition] = at
        if trimmed:
            self._trimmed.inc(trimmed)
        return gone

    async def read(self, session_id: str, epoch: str, after: int, limit: int) -> InboxRead:
        return self._read(session_id, epoch, after, limit)

    async def watch(self, session_id: str, handler: WakeHandler) -> Callable[[], Awaitable[None]]:
        watchers = self._state.watchers
        watchers.add(session_id, handler)

        async def unwatch() -> None:
            watchers.remove(session_id, handler)

        return unwatch

    async def claim_stream(self, session_id: str) -> StreamClaim:
        return self._claim(session_id)

    async def start_stream(self, session_id: str, epoch: str, after: int, limit: int) -> StreamStart:
        subscriptions = set(self._state.subs.get(session_id, ()))
        claim = self._claim(session_id)
        return StreamStart(subscriptions, claim, self._read(session_id, epoch, after, limit))

    def _read(self, session_id: str, epoch: str, after: int, limit: int) -> InboxRead:
        state = self._state
        inbox = state.inboxes.get(session_id)
        if inbox is None:
            return InboxRead(state.epoch, [], True, 0, gone=True)
        cutoff = time.monotonic() - state.settings.inbox_retention
        entries = inbox.entries
        aged = 0
        while isinstance(entries, deque) and entries and entries[0][2] < cutoff:
            entries.popleft()
            aged += 1
        if aged:
            self._trimmed.inc(aged)
        earliest = entries[0][0] if entries else inbox.head + 1
        if inbox_gap(epoch, state.epoch, after, inbox.head, earliest):
            return InboxRead(state.epoch, [], True, inbox.head)
        # Offsets are contiguous, so the first frame after the cursor sits at a known position.
        start = after + 1 - earliest
        frames = [(off, frame) for off, frame, _ in itertools.islice(entries, start, start + limit)]
        return InboxRead(state.epoch, frames, False, inbox.head)

    def _claim(self, session_id: str) -> StreamClaim:
        state = self._state
        had = session_id in state.generations
        if session_id in state.records:
            state.generation += 1
            generation = state.generations[session_id] = state.generation
        else:
            generation = CLOSE_ALL
        state.wake(session_id, Wake("takeover", generation=generation))
        return StreamClaim(had, generation)
