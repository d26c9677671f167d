"""Inboxes on Redis (``base.Inboxes``): each session's frames, the wake-ups of its stream, its claim.

Offsets and gap detection
    A session's ``head`` (a field of its hash) counts every frame ever appended; frame *n* is
    stored as stream entry ``<n>-0``, so an offset is the millisecond part of its entry id and
    offsets are contiguous. Whether a cursor ``after`` is honoured is ``types.inbox_gap``; the
    oldest retained offset it needs is what a read from ``after + 1`` tells: at least
    ``head - inbox_maxlen + 1`` (only the newest ``inbox_maxlen`` count as retained), and beyond
    ``after + 1`` unless entry ``after + 1`` is still stored and younger than ``inbox_retention``.
    Since nothing but trimming removes entries, that test is exact on every server (no need for
    ``XINFO STREAM`` max-deleted-entry-id). ``MAXLEN ~`` trims whole
    stream nodes lazily; the logical bound above makes retention exact anyway; time-based
    trimming happens in the append script, a bounded number of entries per call.

Atomic append and wake-up
    ``inbox_append.lua`` increments ``head`` and XADDs every frame; in a Cluster (one session
    per call) it publishes the session's wake-up, with the offsets and the frames, in the same
    atomic step. On a single node a call carries many sessions and replies with the node that
    watches each, and the wake-ups follow the call (see ``appended``). A watcher whose
    (S)SUBSCRIBE Redis confirmed before it read the inbox therefore sees every later frame, in
    the read or in a wake-up.

Wake-ups
    SPUBLISH/SSUBSCRIBE on ``P:{s:<sid>}:wake`` when the server has sharded pub/sub (Redis 7),
    PUBLISH/SUBSCRIBE otherwise; one pub/sub connection per process
    (``wakes.WakeBus``). On a single node, frame wake-ups go to the node channel of the worker
    that watches the session instead (``watchers``), after the appends; a session watched by
    this very process gets its wake-up in memory, with the frames as they were appended (no
    message, no decoding). After a reconnect every watched stream gets a frames wake without a
    frame and re-reads its inbox.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import (
    NodeWake,
    as_text,
    decode_entry,
    encode_frame,
    encode_mark,
    entry_offset,
    split_node_wakes,
)
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.epoch import Epoch
from broker.backends.redis.keys import Keys
from broker.backends.redis.resp import ONE_FRAME, AppendPacker, bulk
from broker.backends.redis.scripts import Scripts
from broker.backends.redis.wakes import WakeBus
from broker.backends.redis.watchers import Watchers
from broker.backends.types import (
    CLOSE_ALL,
    Frame,
    InboxRead,
    StreamClaim,
    StreamStart,
    Wake,
    WakeHandler,
    generation,
    inbox_gap,
)
from broker.config import Settings
from broker.metrics import NO_METRICS, Metrics

__all__ = ["RedisInboxes"]

#: Sessions per ``inbox_append`` call on a single node: few enough that one call stays short.
APPEND_SESSIONS_PER_CALL = 64


@dataclass(slots=True)
class Appends:
    """The script calls of one ``RedisInboxes.appends``, and what their replies are read against."""

    scripts: Scripts
    keys: Keys
    #: The sessions, in the order of the calls' replies.
    sids: list[str]
    #: Per session, its frames (those the script skipped are taken out once it has replied).
    frames: dict[str, list[Frame]]
    #: Per frame (by ``id``, fan-out shares one Frame among its subscribers): its change's field
    #: and position, the frame packed, and on a single node the three as RESP script arguments,
    #: then those after a frame count of 1 (the arguments of a session with this frame alone).
    packed_frames: dict[int, tuple[str, str, bytes, bytes, bytes]]
    #: The arguments every call begins with.
    head: list[Any]
    #: Per call, its sessions.
    slices: list[list[str]]
    #: On a single node, per call, the whole EVALSHA in RESP (``resp.AppendPacker``); None on Cluster.
    commands: list[bytes] | None

    def arguments(self, call: int) -> tuple[list[str], list[Any]]:
        """The keys and arguments of one call, as ``inbox_append.lua`` takes them."""
        keys: list[str] = []
        args: list[Any] = list(self.head)
        for sid in self.slices[call]:
            keys += self.keys.inbox_keys(sid)
            frames = self.frames[sid]
            args.append(len(frames))
            for frame in frames:
                field, position, packed, _, _ = self.packed_frames[id(frame)]
                args += (field, position, packed)
        return keys, args

    def add_to(self, batch: Batch) -> None:
        if self.commands is None:
            for call in range(len(self.slices)):
                batch.call(self.scripts.inbox_append, *self.arguments(call))
            return
        for call, command in enumerate(self.commands):
            batch.call_packed(self.scripts.inbox_append, command, partial(self.arguments, call))

    def packed(self, sid: str) -> list[bytes]:
        """The session's frames (those left), packed."""
        return [self.packed_frames[id(frame)][2] for frame in self.frames[sid]]


class RedisInboxes:
    """Per-session frames, the wake-ups that announce them, and the one live stream of each session."""

    def __init__(self, settings: Settings, client: Client, keys: Keys, scripts: Scripts, *, epoch: Epoch,
                 bus: WakeBus, watchers: Watchers, cluster: bool, metrics: Metrics = NO_METRICS) -> None:
        self.settings = settings
        self._trimmed = metrics.counter("mcp_broker_inbox_trimmed_total")
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self._epoch = epoch
        self._bus = bus
        self._watchers = watchers
        self.cluster = cluster
        self._packer = AppendPacker(keys, scripts.inbox_append.sha)

    async def append(self, batch: Sequence[tuple[str, Frame]], *, read_under: str = "") -> list[str]:
        """Append and announce: one round trip for the appends, then, on a single node, one for the
        wake-ups of other workers (fan-out merges the latter with its acknowledgement instead:
        ``RedisBackend.deliver``). ``read_under``: as ``appends``."""
        appends = self.appends(batch, read_under)
        if appends is None:
            return []
        with unavailable("inboxes.append"):
            calls = Batch(self.client)
            appends.add_to(calls)
            gone, wakes = self.appended(appends, await calls.execute())
            if wakes:
                announce = Batch(self.client)
                self.add_wakes(announce, wakes)
                await announce.execute()
        return gone

    def appends(self, batch: Sequence[tuple[str, Frame]], read_under: str = "") -> Appends | None:
        """The script calls that append ``batch`` (see ``inbox_append.lua``); None when it is empty.

        Per frame the script gets its change's field and position and the packed frame.
        ``read_under``: the epoch the frames' changes were read from the change log under ('' when
        unknown): a session made under another data generation does not get the frame of a change
        published before it began (``Backend.deliver``).
        """
        frames: dict[str, list[Frame]] = {}
        packed: dict[int, tuple[str, str, bytes, bytes, bytes]] = {}
        resp = not self.cluster
        #: On a single node, per session, its frame count and its frames' arguments in RESP: for
        #: one frame, as most sessions have, a part shared by all the frame's subscribers.
        resp_args: dict[str, bytes] = {}
        several: dict[str, None] = {}
        # Fan-out lists a frame's subscribers one after the other: the frame is looked up once for all.
        last: Frame | None = None
        one = b""
        for sid, frame in batch:
            if frame is not last:
                last = frame
                entry = packed.get(id(frame))
                if entry is None:
                    (field, position), data = encode_mark(frame.change), encode_frame(frame)
                    arguments = bulk(field.encode()) + bulk(position.encode()) + bulk(data) if resp else b""
                    entry = packed[id(frame)] = (field, position, data, arguments, ONE_FRAME + arguments)
                one = entry[4]
            listed = frames.get(sid)
            if listed is None:  # most sessions have one frame per batch: no setdefault's empty list
                frames[sid] = [frame]
                resp_args[sid] = one
            else:
                listed.append(frame)
                several[sid] = None
        if not frames:
            return None
        for sid in several if resp else ():
            listed = frames[sid]
            resp_args[sid] = bulk(b"%d" % len(listed)) + b"".join([packed[id(frame)][3] for frame in listed])
        now_ms = int(time.time() * 1000)
        cutoff_ms = now_ms - int(self.settings.inbox_retention * 1000)
        # One script call per session costs the client ~40 us to pack and parse; on a single
        # node a call carries up to APPEND_SESSIONS_PER_CALL sessions instead, and the wake-ups
        # go out afterwards, one message per watching worker (see add_wakes). In a Cluster
        # a script may only touch one slot, so each session is its own call, publishing itself.
        per_call = 1 if self.cluster else APPEND_SESSIONS_PER_CALL
        publish = self._bus.publish_command if self.cluster else ""
        head = [publish, self.settings.inbox_maxlen, now_ms, cutoff_ms, self._frame_max, generation(read_under)]
        sids = list(frames)
        slices = [sids[start : start + per_call] for start in range(0, len(sids), per_call)]
        commands = None
        if resp:
            head_resp = b"".join([bulk(str(value).encode()) for value in head])
            self._packer.know(frames)
            commands = [self._packer.command(head_resp, len(head), part, frames, resp_args) for part in slices]
        return Appends(self.scripts, self.keys, sids, frames, packed, head, slices, commands)

    @property
    def _frame_max(self) -> int:
        """The most frame bytes one session's wake-up carries (see ``appended``)."""
        return min(self.settings.wake_frame_max_bytes, self.settings.wake_message_max_bytes // 2)

    def appended(self, appends: Appends, results: Sequence[Any]) -> tuple[list[str], dict[str, list[NodeWake]]]:
        """The replies of ``appends``' calls: the sessions gone, and the wake-ups owed to other workers.

        The frames of sessions that a stream of this process watches are handed to it here,
        with no message through Redis: the script read the session's node atomically with its
        append, so a stream that claimed the session since then read its inbox after this
        append, and a stream of this process gets the frames now. Either way the stream's
        offsets tell it whether a wake-up follows on what it has (``feeds.session``).

        Publishing the others after the append script (rather than inside it) keeps the
        handoff: a stream registers its node before it reads the inbox, so a frame appended
        later is either in that read or announced to the node afterwards. Frames the script
        skipped (repeats) are not announced; a session all of whose frames were skipped gets a
        frameless wake-up. A session whose frames are larger than ``wake_frame_max_bytes`` gets
        a frameless wake too and reads them from its inbox: one large change watched by many
        streams on a worker must not reach Redis's pub/sub buffer limit, which drops the
        worker's connection and makes every stream of it re-read. (Frames for this process's
        own streams travel in memory, whatever their size.)

        One pass over the replies, per session in the order of the calls: this runs for every
        frame fan-out delivers, and each further pass or call per session was a measurable
        share of a frame (bench/NOTES.md).
        """
        gone: list[str] = []
        by_node: dict[str, list[NodeWake]] = {}
        trimmed = 0
        handlers = self._watchers.handlers
        mine_raw = self._watchers.node_raw
        frames_of = appends.frames
        for sids, (heads, nodes, skips, cut) in zip(appends.slices, results, strict=True):
            trimmed += cut
            if nodes == mine_raw and not skips and not self.cluster:
                # The usual call: every session's stream is on this process, no frame skipped.
                for sid, head in zip(sids, heads, strict=True):
                    frames = frames_of[sid]
                    if len(frames) == 1:  # the usual session: no list, no loop
                        handlers.call(sid, Wake("frames", head, frame=frames[0]))
                    else:
                        first = head - len(frames) + 1
                        handlers.call(sid, *[Wake("frames", first + i, frame=frame) for i, frame in enumerate(frames)])
                continue
            # On Cluster no session names a node: each call published its own wake-up.
            each = [b""] * len(sids) if self.cluster else [nodes] * len(sids) if type(nodes) is bytes else nodes
            skipped = dict(zip(skips[0::2], skips[1::2], strict=True))
            for number, (sid, head, raw_node) in enumerate(zip(sids, heads, each, strict=True), start=1):
                if head < 0:
                    gone.append(sid)
                elif raw_node:
                    self._announce(appends, sid, head, raw_node, skipped.get(number, 0), by_node)
        if trimmed:
            self._trimmed.inc(trimmed)
        return gone, by_node

    def _announce(self, appends: Appends, sid: str, head: int, raw_node: bytes, skips: list[int] | int,
                  by_node: dict[str, list[NodeWake]]) -> None:
        """The frames appended to ``sid`` (up to ``head``), handed to its stream here or owed to the
        worker ``raw_node``; ``skips`` as ``inbox_append.lua`` replies them (0: none skipped)."""
        frames = appends.frames[sid]
        handlers = self._watchers.handlers
        mine = raw_node == self._watchers.node_raw
        if skips:
            if skips != -1:
                left_out = {int(i) - 1 for i in cast("list[int]", skips)}
                frames = appends.frames[sid] = [frame for i, frame in enumerate(frames) if i not in left_out]
            if skips == -1 or not frames:
                # Every frame was a repeat: a redo. An earlier attempt may have appended them and
                # failed before announcing them (a later session of its script call, or of its
                # pipeline, failed), so the stream gets a wake-up without frames and reads its
                # inbox. So does a stream whose session took a new epoch (-1, lineage.lua): its
                # read finds the gap, where frames of the new epoch would pass for its old one's.
                if mine:
                    handlers.call(sid, Wake("frames", head))
                else:
                    by_node.setdefault(as_text(raw_node), []).append((sid, head, None))
                return
        first = head - len(frames) + 1
        if mine:
            handlers.call(sid, *[Wake("frames", first + i, frame=frame) for i, frame in enumerate(frames)])
            return
        joined = b"".join(appends.packed(sid))
        by_node.setdefault(as_text(raw_node), []).append((sid, head, None) if len(joined) > self._frame_max
                                                         else (sid, first, joined))


    def add_wakes(self, batch: Batch, by_node: dict[str, list[NodeWake]]) -> None:
        """Publish the wake-ups of ``appended`` in ``batch``: per node, messages of bounded size."""
        for node, entries in by_node.items():
            channel = self.keys.node_wake(node)
            for message in split_node_wakes(entries, self.settings.wake_message_max_bytes):
                batch.pipe.execute_command(self._bus.publish_command, channel, message)

    async def read(self, session_id: str, epoch: str, after: int, limit: int) -> InboxRead:
        keys = self.keys.session(session_id)
        with unavailable("inboxes.read"):
            found = await self.scripts.inbox_read(keys=[keys.meta, keys.inbox], args=[after + 1, max(limit, 1)])
            return await self._inbox_read(found, epoch, after, limit)

    async def _inbox_read(self, found: Any, epoch: str, after: int, limit: int) -> InboxRead:
        """An ``inbox_read.lua`` reply as an ``InboxRead``."""
        if not found:
            # A vanished session: maybe Redis lost everything, so agree on the epoch again.
            return InboxRead(await self._epoch.refresh(), [], True, 0, gone=True)
        session_epoch, head, entries = as_text(found[0]), int(found[1]), found[2]
        if inbox_gap(epoch, session_epoch, after, head, self._oldest(after, head, entries)):
            return InboxRead(session_epoch, [], True, head)
        frames = [(entry_offset(entry_id), decode_entry(fields)) for entry_id, fields in entries[:limit]]
        return InboxRead(session_epoch, frames if after < head else [], False, head)

    def _oldest(self, after: int, head: int, entries: Sequence[Any]) -> int:
        """The oldest retained offset, as far as ``types.inbox_gap`` needs it from a read after ``after``.

        At least the logical bound (the newest ``inbox_maxlen`` frames); when frames follow the
        cursor, ``after + 1`` if that entry is still stored and within the retention window, and
        beyond it otherwise (it was trimmed, or aged out).
        """
        oldest = head - self.settings.inbox_maxlen + 1
        if after < head:
            first = entries[0] if entries else None
            if first is None or entry_offset(first[0]) != after + 1:
                return max(oldest, after + 2)  # trimmed
            fields = first[1]
            if int(fields[fields.index(b"t") + 1]) < (time.time() - self.settings.inbox_retention) * 1000:
                return max(oldest, after + 2)  # older than the retention window
            return max(oldest, after + 1)
        return oldest

    async def watch(self, session_id: str, handler: WakeHandler) -> Callable[[], Awaitable[None]]:
        """Raises ``BackendUnavailable`` when the subscription cannot be confirmed."""
        return await self._watchers.watch(session_id, handler)

    async def claim_stream(self, session_id: str) -> StreamClaim:
        keys = self.keys.session(session_id)
        with unavailable("inboxes.claim_stream"):
            reply = await self.scripts.stream_claim(keys=[keys.meta, keys.wake], args=self._claim_args(session_id))
        return self._claim(reply)

    def _claim_args(self, session_id: str) -> list[str]:
        # The claimant's node: frames are announced there from the claim on (see Watchers.claimant).
        return [self._bus.publish_command, self._watchers.claimant(session_id)]

    @staticmethod
    def _claim(reply: Any) -> StreamClaim:
        """A ``stream_claim.lua`` reply as a ``StreamClaim``."""
        had, generation = reply
        return StreamClaim(bool(had), int(generation) if generation else CLOSE_ALL)

    async def start_stream(self, session_id: str, epoch: str, after: int, limit: int) -> StreamStart:
        """One round trip on a single node, in this order; on Cluster the three run concurrently
        (the stream's channel is subscribed already, so a frame the read misses still wakes it)."""
        keys = self.keys.session(session_id)
        with unavailable("inboxes.start_stream"):
            batch = Batch(self.client)
            batch.call(self.scripts.subscriptions_get, [keys.meta, keys.subs], [])
            batch.call(self.scripts.stream_claim, [keys.meta, keys.wake], self._claim_args(session_id))
            batch.call(self.scripts.inbox_read, [keys.meta, keys.inbox], [after + 1, max(limit, 1)])
            uris, claimed, found = await batch.execute()
            read = await self._inbox_read(found, epoch, after, limit)
        return StreamStart({as_text(uri) for uri in uris}, self._claim(claimed), read)
