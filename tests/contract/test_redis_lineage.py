"""Event ids survive a promotion without naming two changes: the lineage fence (``redis/lineage.lua``).

A replica is promoted by hand (``REPLICAOF NO ONE``, what Sentinel does) while the old master
keeps taking writes, as it does until Sentinel demotes it: those writes are lost, and the
promoted replica's offsets would continue from before them. The session takes a new epoch
on the promoted server, so the lost frames' ids, and every cursor from before the promotion,
are gaps there, and the stream watching the session is woken to read rather than given frames.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from broker.backends.redis import RedisBackend
from broker.backends.types import Frame, SessionRecord, Wake, generation
from broker.config import Settings
from tests.support import RedisProcess, wait_until


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    (tmp_path / "m").mkdir()
    (tmp_path / "r").mkdir()
    with RedisProcess(workdir=tmp_path / "m", extra=["--repl-diskless-sync-delay", "0"]) as master:
        with RedisProcess(workdir=tmp_path / "r", extra=["--replicaof", "127.0.0.1", str(master.port)]) as replica:
            def linked() -> bool:
                out = subprocess.run(["redis-cli", "-p", str(replica.port), "info", "replication"],
                                     capture_output=True, text=True, timeout=5).stdout
                return "master_link_status:up" in out

            wait_until(linked, what="replica in sync")
            yield master, replica


def backend_on(port: int, prefix: str) -> RedisBackend:
    return RedisBackend(Settings(_env_file=None, redis_url=f"redis://127.0.0.1:{port}/0",  # type: ignore[call-arg]
                                 redis_prefix=prefix))


async def test_a_promoted_replica_never_reuses_an_id_the_lost_master_gave(
        pair: tuple[RedisProcess, RedisProcess]) -> None:
    master, replica = pair
    prefix = f"t{secrets.token_hex(4)}"
    old, new = backend_on(master.port, prefix), backend_on(replica.port, prefix)
    await old.start()
    try:
        session = SessionRecord(id=secrets.token_urlsafe(16), tenant="t1", principal="t1/alice",
                                protocol_version="2025-11-25", epoch="", created_at=time.time())
        await old.sessions.create(session)
        epoch = session.epoch
        await old.inboxes.append([(session.id, Frame(f"u:{n}", b"%d" % n)) for n in range(3)])
        async with Redis(port=master.port) as raw:
            assert await raw.execute_command("WAIT", 1, 5000) == 1
        async with Redis(port=replica.port) as raw:
            await raw.execute_command("REPLICAOF", "NO", "ONE")
        # The old master goes on taking writes, which the promoted replica never gets.
        await old.inboxes.append([(session.id, Frame("u:lost", b"lost"))])
        lost = await old.inboxes.read(session.id, epoch, 3, 10)
        assert lost.frames == [(4, Frame("u:lost", b"lost"))] and lost.epoch == epoch

        await new.start()
        wakes: asyncio.Queue[Wake] = asyncio.Queue()
        unwatch = await new.inboxes.watch(session.id, wakes.put_nowait)
        await new.inboxes.append([(session.id, Frame("u:kept", b"kept"))])
        # Offset 4 on the promoted server is another change than the lost one: another epoch.
        read = await new.inboxes.read(session.id, epoch, 3, 10)
        assert read.gap and read.epoch != epoch and generation(read.epoch) == generation(epoch)
        fresh = await new.inboxes.read(session.id, read.epoch, 3, 10)
        assert (fresh.gap, fresh.frames) == (False, [(4, Frame("u:kept", b"kept"))])
        # Any cursor of the old epoch is a gap there, the lost id's and an older one alike.
        assert (await new.inboxes.read(session.id, epoch, 4, 10)).gap
        assert (await new.inboxes.read(session.id, epoch, 1, 10)).gap
        # The stream watching it is told to read, not handed the frame under its old epoch.
        wake = await asyncio.wait_for(wakes.get(), 5)
        assert (wake.kind, wake.frame) == ("frames", None)
        # The record itself names the new epoch, for a GET's Last-Event-ID and a poll's cursor.
        found = await new.sessions.get(session.id)
        assert found is not None and found.epoch == read.epoch
        # Later appends on the same lineage keep that epoch: one fence per promotion.
        await new.inboxes.append([(session.id, Frame("u:next", b"next"))])
        after = await new.inboxes.read(session.id, read.epoch, 4, 10)
        assert (after.gap, after.epoch, after.frames) == (False, read.epoch, [(5, Frame("u:next", b"next"))])
        await unwatch()
    finally:
        await old.close()
        await new.close()


async def test_sessions_made_on_one_server_keep_their_epoch(pair: tuple[RedisProcess, RedisProcess]) -> None:
    master, _ = pair
    backend = backend_on(master.port, f"t{secrets.token_hex(4)}")
    await backend.start()
    try:
        session = SessionRecord(id=secrets.token_urlsafe(16), tenant="t1", principal="t1/alice",
                                protocol_version="2025-11-25", epoch="", created_at=time.time())
        await backend.sessions.create(session)
        for n in range(3):
            await backend.inboxes.append([(session.id, Frame(f"u:{n}", b"x"))])
            read = await backend.inboxes.read(session.id, session.epoch, n, 10)
            assert (read.gap, read.epoch) == (False, session.epoch)
    finally:
        await backend.close()
