"""Reading a feed: read after a position, and tell frames from a gap and from a feed that is gone.

Every reader of a feed (a 2025 session's stream, a resumable listen, a poll page, a webhook's
deliveries) asks the inbox for what follows its position and meets one of three answers, said
here once as a ``Batch``:

* frames (possibly none): what follows the position, in order;
* ``resync``: the position cannot be honoured (the inbox was trimmed past it, or it is of
  another data epoch). The reader moves to ``head`` and applies the gap rule, each in its own
  words (an update of every URI, ``truncated: true``, a ``gap`` envelope);
* ``gone``: the feed no longer exists. ``ENDED`` when it was ended or expired (same data
  generation), ``LOST`` when the store lost its data. What a reader does then is its kind's:
  a session or a listen is put back once after a loss and ends after an ending (its client comes
  back to it); a poll or a webhook subscription gets a new feed and owes the gap rule.

A batch is made per read, never per frame: the frames are handed on as they were read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from broker.backends.base import Inboxes
from broker.backends.types import Frame, InboxRead, SessionRecord, generation

__all__ = ["Batch", "FeedReader", "Gone", "batch_of"]


class Gone(Enum):
    ENDED = "ended"  # deleted or expired: nothing to restore
    LOST = "lost"  # lost with the store's data (a restart, a failover)


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


class FeedReader:
    """Reads feeds' inboxes (one per process, shared: it keeps no position of its own)."""

    __slots__ = ("inboxes",)

    def __init__(self, inboxes: Inboxes) -> None:
        self.inboxes = inboxes

    async def next(self, feed: str, epoch: str, after: int, limit: int) -> Batch:
        """At most ``limit`` frames of ``feed`` after ``(epoch, after)``, or the gap rule, or gone (``batch_of``).

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        return batch_of(epoch, await self.inboxes.read(feed, epoch, after, limit))

    async def head(self, feed: SessionRecord) -> int:
        """The newest offset in ``feed``'s inbox (0 for an empty one or a feed that is gone)."""
        return (await self.inboxes.read(feed.id, feed.epoch, 0, 1)).head
