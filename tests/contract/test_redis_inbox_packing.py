"""Fan-out's inbox appends on a single server are packed by hand (``resp.AppendPacker``): the
bytes must be the EVALSHA a RESP packer makes of the same keys and arguments (a server that
forgot the script still gets the frames: test_redis_inbox_reload.py)."""

from __future__ import annotations

import hiredis
import pytest

from broker.backends.base import Frame
from broker.backends.redis import RedisBackend
from broker.config import Settings
from tests.contract.conftest import fakeredis_factory


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
