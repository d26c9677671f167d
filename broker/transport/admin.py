"""The admin REST API: a tenant's runtime API keys, made, listed and revoked (docs/API-KEYS.md).

Served only when stored keys are on (``MCP_BROKER_AUTH`` has ``keys``): with anonymous callers
there is no admin API at all (404), and the edge asks for credentials on every ``/admin`` path.
Every route needs the scope ``keys:admin`` (403 with ``insufficient_scope`` otherwise) and acts on
the caller's own tenant only: another tenant's key is "not found", and a key is never made for
another tenant nor with a scope the caller does not hold (403). The key itself is in the answer
to ``POST`` only; nothing else ever shows it.

No ``from __future__ import annotations``: FastAPI resolves the ``Admin`` alias at runtime (see rest.py).
"""

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request

from broker.auth import Principal, scopes
from broker.auth.keys import MAX_PAGE, PAGE, KeyAdmin, KeyRefused, key_view
from broker.transport.edge import PRINCIPAL, BadBody, principal_of, read_json
from broker.transport.rest import ORJSONResponse

__all__ = ["build_admin_router"]

#: Bytes of a key request's body: a tenant, a subject, a few scopes and a lifetime.
MAX_BODY = 4096
_FIELDS = frozenset({"tenant", "subject", "scopes", "expires_in"})

KeyId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]


def build_admin_router(keys: KeyAdmin, challenge: Callable[[str], str] = scopes.challenge) -> APIRouter:
    router = APIRouter(prefix="/admin")

    async def admin(request: Request) -> Principal:  # async: a sync dependency would run in a thread
        if PRINCIPAL not in request.scope:  # the edge authenticates /admin; never served anonymously
            raise HTTPException(401, "credentials are required", headers={"WWW-Authenticate": "Bearer"})
        caller = principal_of(request.scope)
        if scopes.ADMIN not in caller.scopes:
            raise HTTPException(403, f"this request needs the scope {scopes.ADMIN}",
                                headers={"WWW-Authenticate": challenge(scopes.ADMIN)})
        return caller

    Admin = Annotated[Principal, Depends(admin)]

    def refused(exc: KeyRefused) -> HTTPException:
        return HTTPException(exc.status, exc.message)

    @router.post("/keys", status_code=201)
    async def create_key(request: Request, caller: Admin) -> ORJSONResponse:
        try:
            body = await read_json(request, MAX_BODY)
        except BadBody as exc:
            raise HTTPException(exc.status, exc.message) from exc
        tenant, subject, given, expires_in = _key_request(body, caller.tenant)
        try:
            issued = await keys.create(tenant, subject, given, expires_in, by=caller)
        except KeyRefused as exc:
            raise refused(exc) from exc
        return ORJSONResponse({**key_view(issued.record), "key": issued.key}, status_code=201)

    @router.get("/keys")
    async def list_keys(caller: Admin, after: Annotated[str, Query(max_length=64)] = "",
                        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PAGE) -> ORJSONResponse:
        found = await keys.list(caller.tenant, after, limit + 1)
        page = found[:limit]
        body: dict[str, Any] = {"keys": [key_view(record) for record in page]}
        if len(found) > limit:
            body["next"] = page[-1].id
        return ORJSONResponse(body)

    @router.get("/keys/{key_id}")
    async def get_key(caller: Admin, key_id: KeyId) -> ORJSONResponse:
        try:
            return ORJSONResponse(key_view(await keys.get(key_id, caller.tenant)))
        except KeyRefused as exc:
            raise refused(exc) from exc

    @router.delete("/keys/{key_id}")
    async def revoke_key(caller: Admin, key_id: KeyId) -> ORJSONResponse:
        try:
            return ORJSONResponse(key_view(await keys.revoke(key_id, caller.tenant)))
        except KeyRefused as exc:
            raise refused(exc) from exc

    return router


def _key_request(body: Any, tenant: str) -> tuple[str, str, list[str] | None, Any]:
    """The tenant (the caller's by default), subject, scopes and lifetime of a create; 422 for a
    body of the wrong shape (``KeyAdmin.create`` checks the values)."""
    if not isinstance(body, dict):
        raise HTTPException(422, 'the body is a JSON object: {"subject": ..., "scopes": [...], "expires_in": ...}')
    if unknown := sorted(set(body) - _FIELDS):
        raise HTTPException(422, f"unknown fields: {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}")
    given = body.get("scopes")
    if given is not None and not (isinstance(given, list) and all(isinstance(s, str) for s in given)):
        raise HTTPException(422, "scopes: a list of scope names")
    expires_in = body.get("expires_in")
    if expires_in is not None and (isinstance(expires_in, bool) or not isinstance(expires_in, int | float | str)):
        raise HTTPException(422, "expires_in: seconds, or a string such as 12h or 30d")
    tenant = body.get("tenant", tenant)
    subject = body.get("subject")
    if not isinstance(tenant, str) or not isinstance(subject, str):
        raise HTTPException(422, "tenant and subject: strings (a subject is required)")
    return tenant, subject, given, expires_in
