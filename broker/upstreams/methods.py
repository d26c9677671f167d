"""The methods the upstreams serve (``tools/*``, ``prompts/*``, ``completion/complete``), and the
upstreams' page of a merged list: each checks its params, finds the upstream that serves the name,
prompt or URI for the caller's tenant, and forwards (``broker.upstreams.service``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from broker.auth import Principal
from broker.protocol import jsonrpc as rpc
from broker.upstreams.service import LISTS, Upstreams

if TYPE_CHECKING:
    from broker.backends.types import SessionRecord

__all__ = ["Caller", "ForwardedMethods"]


class Caller(Protocol):
    """What a forwarded method reads of its call (``broker.methods.Call``)."""

    @property
    def principal(self) -> Principal: ...
    @property
    def session(self) -> SessionRecord | None: ...
    @property
    def request_id(self) -> rpc.Id | None: ...
    @property
    def progress(self) -> Callable[[dict[str, Any]], Awaitable[None]] | None: ...


Handler = Callable[[Any, dict[str, Any]], Awaitable[dict[str, Any]]]


class ForwardedMethods:
    """The handlers ``Methods`` adds when upstreams are configured."""

    def __init__(self, upstreams: Upstreams) -> None:
        self.upstreams = upstreams

    def handlers(self) -> dict[str, Handler]:
        return {"tools/list": self._tools_list, "prompts/list": self._prompts_list, "tools/call": self._tools_call,
                "prompts/get": self._prompts_get, "completion/complete": self._complete}

    async def _tools_list(self, call: Caller, params: dict[str, Any]) -> dict[str, Any]:
        return await self.list_of(call, params, "tools/list")

    async def _prompts_list(self, call: Caller, params: dict[str, Any]) -> dict[str, Any]:
        return await self.list_of(call, params, "prompts/list")

    async def list_of(self, call: Caller, params: dict[str, Any], method: str) -> dict[str, Any]:
        """One page of ``method``'s list merged across the tenant's upstreams."""
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor must be a string")
        items, following = await self.upstreams.list_page(call.principal, method, cursor, call.session)
        result: dict[str, Any] = {LISTS[method]: items}
        if following is not None:
            result["nextCursor"] = following
        return result

    def _name_param(self, params: dict[str, Any]) -> str:
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.name must be a non-empty string")
        return name

    async def _named_call(self, call: Caller, params: dict[str, Any], kind: str, method: str) -> dict[str, Any]:
        """``tools/call`` or ``prompts/get``: forwarded to the upstream that serves the name, as its own name."""
        name = self._name_param(params)
        found = self.upstreams.named(call.principal.tenant, kind, name)
        if found is None:
            raise rpc.RpcError(rpc.INVALID_PARAMS, f"Unknown {kind[:-1]}: {name}", {"name": name})
        upstream, own = found
        return await self.upstreams.forward(call.principal, upstream, method, {**params, "name": own},
                                            session=call.session, request_id=call.request_id, progress=call.progress)

    async def _tools_call(self, call: Caller, params: dict[str, Any]) -> dict[str, Any]:
        return await self._named_call(call, params, "tools", "tools/call")

    async def _prompts_get(self, call: Caller, params: dict[str, Any]) -> dict[str, Any]:
        return await self._named_call(call, params, "prompts", "prompts/get")

    async def _complete(self, call: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``completion/complete``: to the upstream of the prompt or the resource (template) it refers to."""
        ref = params.get("ref")
        if not isinstance(ref, dict) or ref.get("type") not in ("ref/prompt", "ref/resource"):
            raise rpc.RpcError(rpc.INVALID_PARAMS, 'params.ref must be {"type": "ref/prompt", "name": …} or '
                               '{"type": "ref/resource", "uri": …}')
        tenant = call.principal.tenant
        if ref["type"] == "ref/prompt":
            name = ref.get("name")
            found = self.upstreams.named(tenant, "prompts", name) if isinstance(name, str) else None
            if found is None:
                raise rpc.RpcError(rpc.INVALID_PARAMS, f"Unknown prompt: {name}", {"name": name})
            upstream, own = found
            params = {**params, "ref": {**ref, "name": own}}
        else:
            uri = ref.get("uri")
            owner = self.upstreams.owner(tenant, uri) if isinstance(uri, str) else None
            if owner is None:
                return {"completion": {"values": [], "hasMore": False}}  # the broker's own complete nothing
            upstream = owner
        return await self.upstreams.forward(call.principal, upstream, "completion/complete", params,
                                            session=call.session, request_id=call.request_id, progress=call.progress)
