"""``mcp-broker publish``: one change, into a running server (``--url``) or straight into its Redis.

The change is checked here as ``POST /changes`` would check it, before anything is sent
anywhere; through a server the tenant is the key's, which the server knows and this command does
not, so a record URI is checked in its own tenant's namespace and the server has the last word.
Exit codes: 0 published (its id printed); 2 bad input, nobody could receive it (the memory
backend lives inside ``serve``), a redirect (never followed: the key goes nowhere else) or an
answer that is not a broker's; 75 (EX_TEMPFAIL) refused for now or not reachable: not
published, try again later.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from broker.config import Settings

__all__ = ["publish_main"]


def publish_main(args: argparse.Namespace) -> int:
    import orjson

    from broker.changes import ChangeKind, ChangeRules, InvalidChange
    from broker.config import Settings
    from broker.errors import BackendUnavailable, PublishRefused
    from broker.tenants import tenant_problem
    from broker.uris import parse_record_uri

    problem = tenant_problem(args.tenant) if args.tenant is not None else None
    if problem:
        print(f"mcp-broker publish: {problem}", file=sys.stderr)
        return 2
    try:
        meta = orjson.loads(args.meta) if args.meta is not None else None
    except orjson.JSONDecodeError as exc:
        print(f"mcp-broker publish: --meta is not valid JSON: {exc}", file=sys.stderr)
        return 2
    settings = Settings()
    tenant = settings.default_tenant if args.tenant is None else args.tenant
    if args.url:
        # The server publishes for the tenant of the key: a record URI is checked here in form only,
        # in its own namespace, and the server refuses it if the key's tenant is another.
        ref = parse_record_uri(args.uri)
        tenant = ref.tenant if ref is not None else tenant
    try:  # refused here, as POST /changes would refuse it, before anything is sent anywhere
        change = ChangeRules.from_settings(settings).change(tenant, args.uri, args.kind, meta)
    except InvalidChange as exc:
        print(f"mcp-broker publish: {exc}", file=sys.stderr)
        return 2
    from broker.cli.remote import BadAnswer

    try:
        if args.url:
            print(_publish_over_http(args.url, args.key, change.to_wire(), tenant_given=args.tenant is not None))
            return 0
        if not settings.redis_url:
            print("mcp-broker publish: nobody could receive this change: the memory backend lives inside "
                  "`mcp-broker serve`; give --url http://127.0.0.1:8080 (a running server) or set "
                  "MCP_BROKER_REDIS_URL to the Redis its workers use", file=sys.stderr)
            return 2
        print(asyncio.run(_publish_to_redis(settings, args.uri, ChangeKind(args.kind), tenant, meta)))
    except BadAnswer as exc:  # before OSError: an answer came, from something that is not a broker
        print(f"mcp-broker publish: {args.url} did not answer as a broker does ({exc}); "
              "the change may or may not be published", file=sys.stderr)
        return 2
    except PublishRefused as exc:
        # Not acknowledged: nothing was appended. EX_TEMPFAIL: try again later.
        print(f"mcp-broker publish: refused, not published: {exc}", file=sys.stderr)
        return 75
    except (BackendUnavailable, OSError) as exc:
        print(f"mcp-broker publish: not published, the broker could not be reached: {exc}", file=sys.stderr)
        return 75
    except _Refused as exc:
        print(f"mcp-broker publish: refused, not published: {exc}", file=sys.stderr)
        return exc.code
    return 0


class _Refused(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _publish_over_http(url: str, key: str | None, change: dict[str, Any], *, tenant_given: bool) -> str:
    """``POST /changes`` on a running server; the change's id. Raises ``_Refused`` with the server's reason,
    ``BadAnswer`` when what answered is not a broker."""
    import json
    import urllib.error
    import urllib.request

    from broker.cli.remote import BadAnswer, error_detail, request_json

    if tenant_given:
        raise _Refused("--tenant is the API key's over --url: the server publishes for the tenant of the key", 2)
    body = {"uri": change["u"], "kind": change["k"], **({"meta": change["m"]} if "m" in change else {})}
    request = urllib.request.Request(url.rstrip("/") + "/changes", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json",
                                              **({"authorization": f"Bearer {key}"} if key else {})})
    try:
        ids = request_json(request).get("ids")
    except urllib.error.HTTPError as exc:
        raise _Refused(f"{exc.code} {error_detail(exc)}".strip(), 75 if exc.code in (429, 503) else 2) from exc
    if not isinstance(ids, list) or not ids or not isinstance(ids[0], str):
        raise BadAnswer("the answer names no change id")
    return ids[0]


async def _publish_to_redis(settings: Settings, uri: str, kind: Any, tenant: str, meta: dict[str, Any] | None) -> str:
    # Only the change log and the one publisher: no sessions, streams or fan-out to start.
    from broker.backends import create_backend
    from broker.changes import ChangeRules
    from broker.publisher import Publisher

    backend = create_backend(settings)
    from broker.quotas import Quotas, TenantQuotas

    publisher = Publisher(backend.changelog, ChangeRules.from_settings(settings),
                          default_tenant=settings.default_tenant, max_waiting=settings.changelog_tenant_max,
                          quotas=Quotas(backend.quotas, TenantQuotas.from_settings(settings)))
    await backend.start()
    try:
        return await publisher.publish(uri, kind, tenant=tenant, meta=meta, source="cli")
    finally:
        await backend.close()
