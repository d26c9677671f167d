"""The authorization server misused or failing, against a real broker and a real test issuer.

A flood of made-up opaque tokens (each one a question to the introspection endpoint) must cost
the peer that sends it, not every client of the broker: valid tokens from another address keep
their latency while it lasts. A key set that trickles in one byte at a time must end in 503 with
``Retry-After`` (the fetch has a total deadline), not in requests that hang.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time

import httpx

from tests.integration.test_oauth import oauth_env, tenant
from tests.oauth_issuer import Authority, IssuerServer
from tests.support import BrokerProcess, free_port, wait_until

#: Clients sending made-up tokens, all from one address other than the valid client's.
FLOOD_CLIENTS = 200
FLOOD_ADDRESS = "127.0.0.2"
#: Seconds each introspection answer takes: a server some distance away.
INTROSPECTION_DELAY = 0.5
SAMPLES = 10


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def valid_latencies(http: httpx.AsyncClient, authority: Authority, name: str) -> list[float]:
    """Seconds each request with a fresh valid opaque token (never seen by the broker) took, in turn."""
    took = []
    for _ in range(SAMPLES):
        token = authority.opaque(tenant=name)
        started = time.monotonic()
        answer = await http.get("/collections", headers=bearer(token))
        took.append(time.monotonic() - started)
        assert answer.status_code == 200, answer.text
    return took


async def test_a_flood_of_made_up_tokens_leaves_valid_tokens_their_latency() -> None:
    port = free_port()
    audience = f"http://127.0.0.1:{port}/mcp"
    with IssuerServer(audience) as issuer, BrokerProcess(env=oauth_env(issuer.url, audience), port=port) as broker:
        authority = issuer.authority
        authority.introspection_delay = INTROSPECTION_DELAY
        name = tenant()
        answered: list[int] = []
        first_answered = asyncio.Event()

        async def flood(client: httpx.AsyncClient) -> None:
            while True:
                made_up = "opaque-" + secrets.token_urlsafe(24)
                answered.append((await client.get("/collections", headers=bearer(made_up))).status_code)
                if len(answered) == FLOOD_CLIENTS:
                    first_answered.set()

        transport = httpx.AsyncHTTPTransport(local_address=FLOOD_ADDRESS, limits=httpx.Limits(
            max_connections=FLOOD_CLIENTS))
        async with httpx.AsyncClient(base_url=broker.url, timeout=120) as http, \
                httpx.AsyncClient(base_url=broker.url, timeout=120, transport=transport) as attacker:
            before = await valid_latencies(http, authority, name)
            flooding = [asyncio.create_task(flood(attacker)) for _ in range(FLOOD_CLIENTS)]
            try:
                # Past the first wave (one made-up token per client, sent before any was refused).
                await first_answered.wait()
                during = await valid_latencies(http, authority, name)
                flooded = len(answered)
            finally:  # the flood's requests still waiting are dropped, not waited for
                for task in flooding:
                    task.cancel()
                await asyncio.gather(*flooding, return_exceptions=True)
        asked = sum(1 for kind, _ in authority.requests if kind == "introspect")
    print(f"valid token, median of {SAMPLES}: {statistics.median(before) * 1000:.0f} ms before the flood, "
          f"{statistics.median(during) * 1000:.0f} ms during it (max {max(during) * 1000:.0f} ms); "
          f"the flood got {flooded} answers {sorted(set(answered))}; the issuer was asked {asked} times")
    assert set(answered) <= {401, 503}
    assert statistics.median(during) < 1.0


async def test_a_trickling_key_set_gives_503_with_retry_after_not_a_hang() -> None:
    port = free_port()
    audience = f"http://127.0.0.1:{port}/mcp"
    with IssuerServer(audience) as issuer:
        issuer.authority.trickle = 2.0  # one byte every 2 s: each read arrives well within any read timeout
        with BrokerProcess(env=oauth_env(issuer.url, audience), port=port) as broker:
            token = issuer.authority.mint(tenant())
            async with httpx.AsyncClient(base_url=broker.url, timeout=30) as http:
                started = time.monotonic()
                answers = await asyncio.gather(*(http.get("/collections", headers=bearer(token)) for _ in range(20)))
                took = time.monotonic() - started
                again = time.monotonic()
                later = await http.get("/collections", headers=bearer(token))  # while the set is still missing
                took_later = time.monotonic() - again
            print(f"20 requests answered {sorted({a.status_code for a in answers})} within {took:.2f} s; "
                  f"the next one in {took_later:.2f} s")
            for answer in [*answers, later]:
                assert answer.status_code == 503, answer.text
                assert int(answer.headers["retry-after"]) >= 1
            issuer.authority.trickle = None  # the server recovers: the next fetch gets the keys
            wait_until(lambda: httpx.get(broker.url + "/collections", headers=bearer(token),
                                         timeout=30).status_code == 200, 30, "the key set to be fetched")
