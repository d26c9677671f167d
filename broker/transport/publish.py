"""``POST /changes``: the publish path, served without FastAPI's request machinery.

A publisher may call this thousands of times a second, so it is a plain ASGI endpoint: measured
on this machine, FastAPI's routing, dependency solving and middleware cost more than the publish
itself (a sync dependency even hopped to a thread for every request). Origin, method (405 for
anything but POST) and authentication were checked at the edge. Errors keep the REST API's
shape: ``{"detail": "..."}`` with 400, 401, 403 (a foreign ``Origin``, a caller without the
``changes:publish`` scope, or a record URI of another tenant), 405, 413, 422, 429 (the tenant
has ``changelog_tenant_max`` changes not yet delivered, or publishes faster than its
``publish_per_second`` quota) or 503 (the backend is unreachable, or
the change log is full). A 202 means every change of the request passed ``ChangeRules`` and is
in the change log; one refused change refuses the request, and none of it is published (a 429
or 503 from the change log's bounds too).

A W3C ``traceparent`` header (with its ``tracestate``) is the trace context of every change of
the request that has none in its ``meta``: it goes into that ``meta``, so the change log, fan-out
and every notification of the change carry it (``broker.ops.tracing``). An invalid one is ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from broker.auth import scopes
from broker.changes import ForeignNamespace, InvalidChange
from broker.errors import Refusal
from broker.ops.tracing import TRACEPARENT, header_context
from broker.publisher import Publisher, TooManyChanges
from broker.transport.edge import BadBody, detail, json_response, principal_of, read_json, refused

__all__ = ["ChangesEndpoint"]


class ChangesEndpoint:
    """Publish one change (a JSON object) or several (a JSON list); 202 with their ids."""

    def __init__(self, publisher: Publisher, max_body_bytes: int,
                 challenge: Callable[[str], str] = scopes.challenge) -> None:
        self.publisher = publisher
        self.max_body_bytes = max_body_bytes
        self.challenge = challenge

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        request = Request(scope, receive)
        caller = principal_of(request.scope)
        if scopes.PUBLISH not in caller.scopes:  # before the body: a refused publisher's bytes are never read
            return detail(403, f"this request needs the scope {scopes.PUBLISH}",
                          {"WWW-Authenticate": self.challenge(scopes.PUBLISH)})
        tenant = caller.tenant
        try:
            items = await read_json(request, self.max_body_bytes)
            traceparent = request.headers.get("traceparent")
            if traceparent is not None and (context := header_context(traceparent, request.headers.get("tracestate"))):
                bound = self.publisher.rules.max_meta_bytes
                items = ([_traced(i, context, bound) for i in items] if isinstance(items, list)
                         else _traced(items, context, bound))
            ids = await self.publisher.publish_items(tenant, items, source="http")
        except BadBody as exc:
            return detail(exc.status, exc.message)
        except TooManyChanges as exc:
            return detail(413, str(exc))
        except ForeignNamespace as exc:
            return detail(403, str(exc))
        except InvalidChange as exc:
            return detail(422, str(exc))
        except Refusal as exc:  # an outage, the change log's bounds, the tenant's publish rate: edge.REST_STATUS
            return refused(exc)
        return json_response({"ids": ids}, 202)


def _traced(item: Any, context: dict[str, str], max_meta_bytes: int) -> Any:
    """A change as given, with the request's trace ``context`` in its ``meta`` unless it has its own,
    or the ``meta`` would then encode to more than ``max_meta_bytes``: the header never refuses a change."""
    if not isinstance(item, dict):
        return item  # refused as it is by the publisher
    meta = item.get("meta")
    if meta is None:
        traced: dict[str, Any] = dict(context)
    elif isinstance(meta, dict) and TRACEPARENT not in meta:
        traced = {**context, **meta}
    else:
        return item
    try:
        if len(orjson.dumps(traced)) > max_meta_bytes:
            return item
    except TypeError:  # not JSON: refused as it is by the publisher
        return item
    return {**item, "meta": traced}
