"""What each request needs the caller's credential to allow, and the refusal when it does not.

A principal carries the scopes its credential grants (an OAuth token's ``scope`` / ``scp``, a
key's list). Every route and MCP method that touches a tenant's data names one scope here, and
a principal without it is refused before anything is read or written: 403 with
``WWW-Authenticate: Bearer error="insufficient_scope", scope="..."`` over HTTP (RFC 6750 §3.1,
as the MCP authorization specification asks), and on ``/mcp`` a JSON-RPC error whose
``data.scope`` names what was missing. Methods that reveal nothing of a tenant (``ping``,
``initialize``, ``server/discover``) need no scope.
"""

from __future__ import annotations

from typing import Final

from broker.auth import Principal
from broker.auth.identity import CONSOLE
from broker.protocol import jsonrpc as rpc

__all__ = ["ADMIN", "CONSOLE", "METHOD_SCOPES", "PUBLISH", "READ", "SUBSCRIBE", "TOOLS", "WRITE", "InsufficientScope",
           "challenge", "forbidden", "require"]

#: Read resources: list, read, templates (MCP), and records and collections (REST).
READ: Final = "resources:read"
#: Watch resources: subscribe, unsubscribe, the legacy GET stream, ``subscriptions/listen``, ``events/*``.
SUBSCRIBE: Final = "resources:subscribe"
#: Write records: PUT, PATCH, DELETE (each write also publishes its change).
WRITE: Final = "records:write"
#: Publish changes of any resource of the tenant: ``POST /changes``.
PUBLISH: Final = "changes:publish"
#: Call the tools of the MCP servers behind the broker (``MCP_BROKER_UPSTREAMS``): ``tools/call``.
TOOLS: Final = "tools:call"
#: Manage the tenant's API keys (the admin API).
ADMIN: Final = "keys:admin"

#: (``CONSOLE``, ``console:read``: the live console and ``mcp-broker status``; see ``broker.auth.identity``.)

#: The scope each MCP method needs; a method not named here needs none.
METHOD_SCOPES: Final = {
    "resources/list": READ,
    "resources/read": READ,
    "resources/templates/list": READ,
    "resources/subscribe": SUBSCRIBE,
    "resources/unsubscribe": SUBSCRIBE,
    "subscriptions/listen": SUBSCRIBE,
    "events/list": SUBSCRIBE,
    "events/poll": SUBSCRIBE,
    "events/subscribe": SUBSCRIBE,
    "events/unsubscribe": SUBSCRIBE,
    # The upstreams' (``broker.upstreams``): listing and prompts are reading; a tool may change anything.
    "tools/list": READ,
    "tools/call": TOOLS,
    "prompts/list": READ,
    "prompts/get": READ,
    "completion/complete": READ,
}


class InsufficientScope(Exception):
    """The caller's credential does not grant ``scope`` (HTTP 403)."""

    def __init__(self, scope: str) -> None:
        super().__init__(f"this request needs the scope {scope}")
        self.scope = scope


def require(principal: Principal, scope: str) -> None:
    """Raises ``InsufficientScope`` unless ``principal`` holds ``scope``."""
    if scope not in principal.scopes:
        raise InsufficientScope(scope)


def forbidden(method: str, scope: str) -> rpc.RpcError:
    """The JSON-RPC error of an MCP request whose caller lacks ``scope`` (HTTP 403 when it is the whole answer)."""
    return rpc.RpcError(rpc.INSUFFICIENT_SCOPE, f"Forbidden: {method} needs the scope {scope}",
                        {"scope": scope})


def challenge(scope: str, resource_metadata: str | None = None) -> str:
    """The ``WWW-Authenticate`` value of a 403 for a missing ``scope`` (RFC 6750 §3, RFC 9728 §5.1)."""
    value = f'Bearer error="insufficient_scope", scope="{scope}"'
    if resource_metadata:
        value += f', resource_metadata="{resource_metadata}"'
    return value
