"""What the change log's publish and acknowledge steps cost on Redis, in microseconds per change.

    python -m bench.changelog [--changes 20000] [--repeats 3]

Starts a private redis-server on a free port and drives ``RedisBackend`` directly (no HTTP):
``publish`` awaited one change at a time (the ``broker.publish`` / single ``POST /changes``
path), ``publish_many`` in lists of 100, and the fan-out side, ``changelog.read`` then
``changelog.ack`` in batches of 256 (the log is trimmed there). Reports the best and the median
of the repeats; on a shared machine the best is the steadier figure. Compare runs made side by
side.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time

from broker.backends.redis import RedisBackend
from broker.changes import Change
from broker.config import Settings
from tests.support import RedisProcess


async def one_run(url: str, changes: int) -> dict[str, float]:
    settings = Settings(_env_file=None, redis_url=url, redis_prefix=f"b{secrets.token_hex(3)}",  # type: ignore[call-arg]
                        changelog_maxlen=10**9, changelog_tenant_max=10**9)  # nothing refused here
    backend = RedisBackend(settings)
    await backend.start()
    try:
        meta = {"etag": "v1"}
        t0 = time.perf_counter()
        for n in range(changes):
            await backend.changelog.publish(Change("bench", f"x:{n % 500}", meta=meta))
        single = (time.perf_counter() - t0) / changes * 1e6
        t0 = time.perf_counter()
        for start in range(0, changes, 100):
            await backend.changelog.publish_many([Change("bench", f"x:{n % 500}", meta=meta)
                                                  for n in range(start, start + 100)])
        many = (time.perf_counter() - t0) / changes * 1e6
        t0 = time.perf_counter()
        done = 0
        while done < 2 * changes:
            batch = await backend.changelog.read("bench", 256, 0)
            await backend.changelog.ack([cid for cid, _ in batch])
            done += len(batch)
        fanout = (time.perf_counter() - t0) / done * 1e6
        return {"publish": single, "publish_many": many, "read+ack": fanout}
    finally:
        await backend.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--changes", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with RedisProcess() as server:
        runs = [asyncio.run(one_run(server.url, args.changes)) for _ in range(args.repeats)]
    for name in runs[0]:
        values = [run[name] for run in runs]
        listed = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name:13} best {min(values):6.1f}, median {statistics.median(values):6.1f} us/change  (runs: {listed})")


if __name__ == "__main__":
    main()
