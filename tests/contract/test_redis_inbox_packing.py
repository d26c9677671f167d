"""Fan-out's inbox appends on a single server are packed by hand (``RedisInboxes._command``): the
bytes must be the EVALSHA a RESP packer makes of the same keys and arguments, and a server that
forgot the script must still get the frames."""

from __future__ import annotations

import secrets
import time
from typing import Any

import hiredis
import pytest

from broker.backends.base import Frame, SessionRecord
from broker.backends.redis import RedisBackend
from broker.config import Settings
from tests.contract.conftest import fakeredis_factory
from tests.support import RedisProcess

pytestmark = pytest.mark.redis


def frames_of_a_batch() -> list[tuple[str, Frame]]:
    """As fan-out makes them: one Frame shared by its URI's subscribers, with and without a change
    behind it; more sessions than one call carries, one with more frames than the usual counts,
    and session ids that are not ASCII."""
    shared = Frame("u:x:a", b'{"uri":"x:a"}', "3:1700000000000-7")
    listed = Frame("l", b'{"list":1}')
    batch: list[tuple[str, Frame]] = []
    for n in range(70):
        sid = f"s{n}" if n % 7 else f"sé{n}ß"
        batch.append((sid, shared))
        if n % 3 == 0:
            batch.append((sid, listed))
    many = "many-frames"
    batch += [(many, Frame(f"u:x:{i}", b"%d" % i, f"0:1700000000000-{i}")) for i in range(20)]
    return batch


@pytest.mark.parametrize("prefix", ["mcpb", "t%d{%s}"])
def test_the_packed_appends_are_the_evalsha_a_resp_packer_makes(prefix: str) -> None:
    settings = Settings(_env_file=None, redis_prefix=prefix)  # type: ignore[call-arg]
    backend = RedisBackend(settings, client_factory=fakeredis_factory())
    inboxes = backend._inboxes
    appends = inboxes.appends(frames_of_a_batch())
    assert appends is not None and appends.commands is not None
    assert len(appends.commands) == 2  # 71 sessions, 64 to a call
    sha = backend._inboxes.scripts.inbox_append.sha
    for call, command in enumerate(appends.commands):
        keys, args = appends.arguments(call)
        assert command == hiredis.pack_command(("EVALSHA", sha, len(keys), *keys, *args))


async def test_appends_reach_a_server_that_forgot_the_script() -> None:
    with RedisProcess() as server:
        settings = Settings(_env_file=None, redis_url=server.url,  # type: ignore[call-arg]
                            redis_prefix=f"t{secrets.token_hex(4)}")
        backend = RedisBackend(settings)
        await backend.start()
        try:
            record = SessionRecord(id=secrets.token_urlsafe(12), tenant="t1", principal="t1/alice",
                                   protocol_version="2025-11-25", epoch=backend.sessions.epoch, created_at=time.time())
            await backend.sessions.create(record)
            await backend.redis.script_flush()  # as after a restart
            frames = [(record.id, Frame("u:x:a", b"a", "0:1700000000000-1")), (record.id, Frame("u:x:b", b"b"))]
            assert await backend.deliver(frames, [], []) == []
            read = await backend.inboxes.read(record.id, backend.sessions.epoch, 0, 10)
            data: list[Any] = [frame.data for _, frame in read.frames]
            assert (read.head, data) == (2, [b"a", b"b"])
        finally:
            await backend.close()
