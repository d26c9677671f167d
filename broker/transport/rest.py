"""The REST API: record collections and health (``POST /changes`` is in ``publish.py``).

Every write lands in the change log before it is acknowledged, so a ``2xx`` means the
notification will be delivered to every subscriber (within the inbox retention). Origin and
authentication were checked at the edge; the routes read the principal it found. A domain
refusal (an outage, the change log's bounds, the tenant's publish rate or record quota) passes
through to the app's one handler (``broker.transport.edge.refused``), as on ``POST /changes``.

No ``from __future__ import annotations`` here: FastAPI resolves string annotations against
the module's globals, so the ``Caller`` alias built inside ``build_router`` (it closes over
the settings) would not resolve and every route would ask for a ``caller`` query parameter.
"""

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response

from broker.auth import Principal, scopes
from broker.config import Settings
from broker.errors import NotFound, WriteConflict
from broker.ops.health import Health
from broker.resources.records import InvalidRecord, Records, RecordTooLarge
from broker.transport.edge import PRINCIPAL, BadBody, principal_of, read_json
from broker.uris import NAME_PATTERN, collection_uri, record_uri, valid_name

__all__ = ["build_router"]

Name = Annotated[str, Path(pattern=NAME_PATTERN)]


class ORJSONResponse(Response):
    """JSON encoded with orjson (FastAPI's own class of that name is deprecated)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def build_router(settings: Settings, records: Records, health: Health,  # noqa: C901 - a route table
                 challenge: Callable[[str], str] = scopes.challenge) -> APIRouter:
    """The REST routes; ``challenge`` words the ``WWW-Authenticate`` of a 403 for a missing scope."""
    router = APIRouter()

    def holding(scope: str) -> Callable[[Request], Awaitable[Principal]]:
        """The dependency giving the caller, refused with 403 unless its credential grants ``scope``."""
        async def principal(request: Request) -> Principal:  # async: a sync dependency would run in a thread
            if PRINCIPAL not in request.scope:  # a route the edge did not take for the API's: never served anonymously
                raise HTTPException(401, "credentials are required", headers={"WWW-Authenticate": "Bearer"})
            caller = principal_of(request.scope)
            if scope not in caller.scopes:
                raise HTTPException(403, f"this request needs the scope {scope}",
                                    headers={"WWW-Authenticate": challenge(scope)})
            return caller
        return principal

    #: The caller of a route that reads, and of one that writes records.
    Caller = Annotated[Principal, Depends(holding(scopes.READ))]
    Writer = Annotated[Principal, Depends(holding(scopes.WRITE))]

    async def json_body(request: Request, limit: int) -> Any:
        try:
            return await read_json(request, limit)
        except BadBody as exc:
            raise HTTPException(exc.status, exc.message) from exc

    def dot_only(*names: str) -> None:
        if not all(valid_name(name) for name in names):  # the pattern passed: what is left is dot-only
            raise HTTPException(422, "names may not consist of dots only")

    @router.get("/healthz")
    async def healthz() -> ORJSONResponse:
        # Unauthenticated: this worker's open streams and listens, never a count that follows
        # what tenants publish (the fan-out's was one).
        ok, report = await health.check()
        return ORJSONResponse(report, status_code=200 if ok else 503)

    @router.get("/collections")
    async def collections(caller: Caller) -> ORJSONResponse:
        names = await records.collections(caller.tenant)
        return ORJSONResponse({"collections": [{"name": n, "uri": collection_uri(caller.tenant, n)} for n in names]})

    @router.get("/collections/{name}")
    async def list_collection(caller: Caller, name: Name, after: str = "",
                              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> ORJSONResponse:
        ids = await records.ids(caller.tenant, name, after, limit + 1)
        page = ids[:limit]
        body: dict[str, Any] = {
            "collection": name,
            "uri": collection_uri(caller.tenant, name),
            "records": [{"id": rid, "uri": record_uri(caller.tenant, name, rid)} for rid in page],
        }
        if len(ids) > limit:
            body["next"] = page[-1]
        return ORJSONResponse(body)

    def refused_write(exc: Exception) -> HTTPException:
        """A record the store refused to take, as the REST status that names why."""
        if isinstance(exc, InvalidRecord):
            return HTTPException(422, str(exc))
        return HTTPException(413, f"record larger than {settings.max_record_bytes} bytes")

    @router.put("/collections/{name}/{record_id}")
    async def put_record(request: Request, caller: Writer, name: Name, record_id: Name) -> ORJSONResponse:
        dot_only(name, record_id)
        value = await json_body(request, settings.max_record_bytes)
        try:
            created = await records.put(caller.tenant, name, record_id, value)
        except (InvalidRecord, RecordTooLarge) as exc:
            raise refused_write(exc) from exc
        return ORJSONResponse({"uri": record_uri(caller.tenant, name, record_id), "created": created},
                              status_code=201 if created else 200)

    @router.patch("/collections/{name}/{record_id}")
    async def patch_record(request: Request, caller: Writer, name: Name, record_id: Name) -> ORJSONResponse:
        dot_only(name, record_id)
        patch = await json_body(request, settings.max_record_bytes)
        try:
            value = await records.patch(caller.tenant, name, record_id, patch)
        except NotFound as exc:
            raise HTTPException(404, "record not found") from exc
        except (InvalidRecord, RecordTooLarge) as exc:
            raise refused_write(exc) from exc
        except WriteConflict as exc:
            raise HTTPException(409, "the record kept changing; retry the patch") from exc
        return ORJSONResponse(value)

    @router.get("/collections/{name}/{record_id}")
    async def get_record(caller: Caller, name: Name, record_id: Name) -> Response:
        dot_only(name, record_id)
        try:
            data = await records.get(caller.tenant, name, record_id)
        except NotFound as exc:
            raise HTTPException(404, "record not found") from exc
        return Response(data, media_type="application/json")

    @router.delete("/collections/{name}/{record_id}", status_code=204)
    async def delete_record(caller: Writer, name: Name, record_id: Name) -> Response:
        dot_only(name, record_id)
        try:
            await records.delete(caller.tenant, name, record_id)
        except NotFound as exc:
            raise HTTPException(404, "record not found") from exc
        return Response(status_code=204)

    return router

