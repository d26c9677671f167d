"""What the session, subscription and inbox stores share: the table of live sessions.

A session's record, its idle clock, its subscriptions and index entries, its inbox, its stream
claims and its watchers belong together: deleting a session drops them all, a subscription
change wakes the session's watcher, restoring a session re-adds its subscriptions. They live in
one ``SessionState``, which each of those stores is given when it is made, with the few steps
more than one of them takes (``subscribe``, ``unindex``, ``wake``, ``expired``); everything
else is the business of one store.

Like every memory store, nothing here awaits: each method is one atomic step on the event loop.
"""

from __future__ import annotations

import secrets
import time
from collections import deque

from broker.backends.types import Frame, Handlers, SessionRecord, Wake
from broker.config import Settings
from broker.errors import LimitExceeded, Reason

__all__ = ["Inbox", "SessionState"]


class Inbox:
    __slots__ = ("entries", "head", "newest")

    def __init__(self) -> None:
        #: (offset, frame, monotonic time of append). Empty until the first frame: a deque
        #: preallocates a block (760 bytes), too much for every session that is only idle.
        self.entries: deque[tuple[int, Frame, float]] | tuple[()] = ()
        self.head = 0
        #: partition -> position of the newest change appended (see ``Inboxes.append``); None until one is.
        self.newest: dict[str, str] | None = None


class SessionState:
    """The sessions of one process, by id, and what hangs off each of them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: This process's data generation: memory is lost with the process, never on its own.
        self.epoch = secrets.token_hex(4)
        self.records: dict[str, SessionRecord] = {}
        #: How many of them are of kind session (``count_sessions``, sampled while streams run).
        self.sessions = 0
        #: Monotonic time of each session's last touch (its idle clock).
        self.seen: dict[str, float] = {}
        self.subs: dict[str, set[str]] = {}
        #: (tenant, uri) -> the sessions subscribed to it.
        self.index: dict[tuple[str, str], set[str]] = {}
        self.by_tenant: dict[str, set[str]] = {}
        self.inboxes: dict[str, Inbox] = {}
        self.watchers: Handlers[str, Wake] = Handlers("stream wake")
        #: Each session's latest stream claim. The counter outlives the sessions, so generations
        #: only grow, even for a session that was deleted and restored.
        self.generations: dict[str, int] = {}
        self.generation = 0

    def expired(self, session_id: str) -> bool:
        return time.monotonic() - self.seen.get(session_id, 0.0) > self.settings.session_ttl

    def wake(self, session_id: str, wake: Wake) -> None:
        self.watchers.call(session_id, wake)

    def subscribe(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        """``SubscriptionIndex.add`` in one step (restoring a session takes it too); 0 for a session that is gone."""
        subs = self.subs.get(session_id)
        if subs is None:
            return 0
        if limit and uri not in subs and len(subs) >= limit:
            raise LimitExceeded(f"at most {limit} subscriptions per session", reason=Reason.SUBSCRIPTIONS,
                                data={"limit": limit})
        subs.add(uri)
        self.index.setdefault((tenant, uri), set()).add(session_id)
        self.wake(session_id, Wake("subscribe", uri=uri))
        return len(subs)

    def unindex(self, tenant: str, uri: str, session_id: str) -> None:
        members = self.index.get((tenant, uri))
        if members is not None:
            members.discard(session_id)
            if not members:
                del self.index[(tenant, uri)]
