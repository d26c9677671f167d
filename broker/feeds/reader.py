"""Reading a feed: the one loop every reader runs (read, gap or gone, resync, advance), and its rules.

Every reader of a feed (a 2025 session's stream, a resumable listen, a poll page, a webhook's
deliveries) is a ``View``: it holds a position in the feed's inbox and says what a batch means
to its client. ``FeedReader.drain`` is the loop they share. It asks the inbox for what follows
the position and meets one of three answers, said once as a ``Batch``:

* frames (possibly none): what follows the position, in order, handed to ``View.send`` as one
  ``Batch``, never frame by frame (a session passes the frames' bytes on as they are); the view
  advances once it has delivered them;
* ``resync``: the position cannot be honoured (the inbox was trimmed past it, or it is of
  another data epoch). The loop moves the view to the head and the view applies the gap rule,
  each in its own words (an update of every URI, ``truncated: true``, a ``gap`` envelope);
* ``gone``: the feed no longer exists. ``ENDED`` when it was ended or expired (same data
  generation), ``LOST`` when the store lost its data. What follows is the kind's (``on_gone``),
  decided here and nowhere else: a session or a listen is put back once after a loss and ends
  after an ending (its client comes back to it); a poll or a webhook subscription gets a new
  feed of the same owner, kind and filter, and owes the gap rule.

Watching is the view's: a stream sleeps until a wake-up (which may carry the frames, read then
from no inbox at all), a webhook until a wake-up or its interval, a poll not at all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from broker.backends.base import Inboxes
from broker.backends.types import Frame, InboxRead, SessionRecord, generation
from broker.feeds.model import FeedKind, Filter, Owner

__all__ = ["Batch", "FeedReader", "Gone", "OnGone", "Renew", "View", "batch_of", "on_gone"]


class Gone(Enum):
    ENDED = "ended"  # deleted or expired: nothing to restore
    LOST = "lost"  # lost with the store's data (a restart, a failover)


class OnGone(Enum):
    """What a reader does once its feed is gone."""

    END = "end"  # the reading ends: the client learns its feed is over
    RESTORE = "restore"  # the feed is put back under the store's new epoch, then the gap rule
    RENEW = "renew"  # a new feed of the same owner, kind and filter, and the gap rule owed


def on_gone(kind: FeedKind, gone: Gone) -> OnGone:
    """The rule for a feed of ``kind`` that is ``gone``: a session or a listen is its client's to come back
    to (restored after a loss, over after an ending); a poll or a webhook subscription is the broker's to
    keep serving (a new feed, whatever took the old one)."""
    if kind is FeedKind.SESSION or kind is FeedKind.LISTEN:
        return OnGone.END if gone is Gone.ENDED else OnGone.RESTORE
    return OnGone.RENEW


@dataclass(frozen=True, slots=True)
class Batch:
    """One read's answer: ``frames`` after the position, or the gap rule from ``head``, or the feed gone.

    ``epoch``: the one the reader continues in (the store's, after a gap).
    """

    frames: list[tuple[int, Frame]]
    head: int
    epoch: str
    resync: bool = False
    gone: Gone | None = None


def batch_of(epoch: str, read: InboxRead) -> Batch:
    """What ``read``, made at ``epoch``, tells its reader."""
    if read.gone:
        return Batch([], read.head, read.epoch, gone=Gone.ENDED if read.epoch == generation(epoch) else Gone.LOST)
    if read.gap:
        return Batch([], read.head, read.epoch, resync=True)
    return Batch(read.frames, read.head, epoch)


class View:
    """A reader of one feed, as ``FeedReader.drain`` drives it. Its position is ``feed``, ``epoch``, ``after``."""

    __slots__ = ()

    kind: FeedKind

    def position(self) -> tuple[str, str, int]:
        """The feed, its epoch and the offset to read after."""
        raise NotImplementedError

    def reading(self) -> bool:
        """Whether the loop goes on (a stream that ended stops it)."""
        return True

    async def send(self, batch: Batch) -> None:
        """Deliver one batch's frames, in order, and advance past what was delivered."""
        raise NotImplementedError

    async def resync(self, epoch: str, head: int) -> None:
        """Move to ``(epoch, head)`` and apply the gap rule there."""
        raise NotImplementedError

    async def restore(self) -> bool:
        """``OnGone.RESTORE``: put the feed back (its epoch the store's); False when that is impossible."""
        return False

    async def over(self, gone: Gone) -> None:
        """The feed is over for this reader (``OnGone.END``, or a restore that failed)."""

    def renewal(self) -> tuple[Owner, Filter | None]:
        """``OnGone.RENEW``: whose, and of what filter, the new feed is."""
        raise NotImplementedError

    async def renewed(self, fresh: SessionRecord) -> None:
        """Continue in ``fresh`` (empty, subscribed), owing the gap rule from its start."""
        raise NotImplementedError


#: Creates the feed ``OnGone.RENEW`` asks for (``Feeds.create``), so the reader needs no more of ``Feeds``.
Renew = Callable[[Owner, FeedKind, Filter | None], Awaitable[SessionRecord]]


class FeedReader:
    """Reads feeds' inboxes (one per process, shared: it keeps no position of its own)."""

    __slots__ = ("inboxes", "renew")

    def __init__(self, inboxes: Inboxes, renew: Renew | None = None) -> None:
        """``renew``: makes the new feed of a poll or a webhook whose feed is gone (``Feeds.create``)."""
        self.inboxes = inboxes
        self.renew = renew

    async def next(self, feed: str, epoch: str, after: int, limit: int) -> Batch:
        """At most ``limit`` frames of ``feed`` after ``(epoch, after)``, or the gap rule, or gone (``batch_of``).

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        return batch_of(epoch, await self.inboxes.read(feed, epoch, after, limit))

    async def head(self, feed: SessionRecord) -> int:
        """The newest offset in ``feed``'s inbox (0 for an empty one or a feed that is gone)."""
        return (await self.inboxes.read(feed.id, feed.epoch, 0, 1)).head

    async def drain(self, view: View, limit: int, first: InboxRead | None = None, *, once: bool = False) -> None:
        """Read, gap or gone, resync, advance, until a read comes back short (``once``: after one read)
        or the view stops reading. ``first``: a read of the view's position already made.

        Raises:
            BackendUnavailable: the store could not be reached.
            OverQuota, LimitExceeded: a poll's or webhook's new feed could not be created.
        """
        restored = False
        while view.reading():
            feed, epoch, after = view.position()
            if first is None:
                batch = batch_of(epoch, await self.inboxes.read(feed, epoch, after, limit))
            else:
                batch, first = batch_of(epoch, first), None
            if batch.gone is not None:
                rule = on_gone(view.kind, batch.gone)
                if rule is OnGone.RENEW:
                    owner, feed_filter = view.renewal()
                    if self.renew is None:
                        raise RuntimeError("a reader of polls and webhooks needs its Feeds")
                    await view.renewed(await self.renew(owner, view.kind, feed_filter))
                    return
                if rule is OnGone.END or restored or not await view.restore():
                    # Ended; or lost again at once, or cannot be put back: the client retries, no spin.
                    await view.over(batch.gone if rule is OnGone.END else Gone.LOST)
                    return
                restored = True
                # The gap rule from the restored (empty) inbox: what fan-out appends to it from now on follows.
                await view.resync(view.position()[1], 0)
            elif batch.resync:
                await view.resync(batch.epoch, batch.head)
            else:
                await view.send(batch)
                if once or len(batch.frames) < limit:
                    return
            if once:
                return
