"""Fan-out's inbox appends reach a server that forgot the script (it restarted): the batch loads it
and sends the call again with the same keys and arguments."""

from __future__ import annotations

import secrets
import time

from broker.backends.base import Frame, SessionRecord
from broker.backends.redis import RedisBackend
from broker.config import Settings
from tests.support import RedisProcess


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
            assert (read.head, [frame.data for _, frame in read.frames]) == (2, [b"a", b"b"])
        finally:
            await backend.close()
