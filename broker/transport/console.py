"""``/console/``: the live console's page, its script and style, and the figures they poll (docs/CONSOLE.md).

The page, script and style are static files of the package (``broker/ops/console/``): they hold
no figure, so they are served without credentials (a browser cannot send a bearer token when it
opens a page); the page asks for a key when the figures are refused. ``/console/state.json`` is
the figures (``broker.ops.console.Console.state``):

* with authentication on, only to a caller holding ``console:read`` whose tenant is one of
  ``MCP_BROKER_CONSOLE_TENANTS`` (401 without credentials at the edge, 403 with
  ``insufficient_scope`` without the scope, 403 from another tenant: none while the setting is empty);
* with authentication off, only to requests whose ``Host`` is a loopback name (``localhost``,
  ``127.0.0.1``, ``[::1]``), whatever ``MCP_BROKER_ALLOWED_HOSTS`` says, sent from a loopback
  address and without a proxy's header (``Forwarded``, ``X-Forwarded-*``, ``X-Real-IP``, ``Via``):
  every caller is then anonymous, and the figures name every tenant. The ``Host`` alone would keep
  out a page on a rebound name, not a client on another machine, which can send any ``Host``. A
  proxy on this machine that relays to the loopback address without such a header (nginx's
  defaults) cannot be told from a local client: with authentication off, nothing may relay to the
  worker's loopback address. The page and its files follow the same rule.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection
from importlib import resources
from typing import Final

from starlette.responses import Response
from starlette.types import Receive, Scope

from broker.auth.scopes import CONSOLE
from broker.ops.console import Console
from broker.transport.edge import detail, json_response, principal_of
from broker.transport.guards import LOOPBACK_HOSTS, NO_SNIFF_NO_STORE, HostPolicy

__all__ = ["CONSOLE_PATHS", "STATE_PATH", "ConsolePage", "ConsoleRedirect", "ConsoleState", "loopback"]

#: The static files, by path, with their media types.
_FILES: Final = {"/console/": ("index.html", "text/html; charset=utf-8"),
                 "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
                 "/console/console.css": ("console.css", "text/css; charset=utf-8")}
STATE_PATH: Final = "/console/state.json"
CONSOLE_PATHS: Final = (*_FILES, STATE_PATH)
#: The page runs its own script and style only, and no other site may frame it.
_PAGE_HEADERS: Final = [(b"content-security-policy",
                         b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                         b"img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
                        (b"referrer-policy", b"no-referrer")]
_OFF_LOOPBACK: Final = ("the console answers this machine only (a loopback Host: localhost, 127.0.0.1, [::1], "
                        "from a loopback address, not through a proxy) while authentication is off: open it there, "
                        "or turn authentication on (docs/CONSOLE.md)")


_LOOPBACK_POLICY: Final = HostPolicy(LOOPBACK_HOSTS, "127.0.0.1")


def loopback(scope: Scope) -> bool:
    """Whether the request is this machine's own: its ``Host`` a loopback name (a request without one is
    not), its peer a loopback address, and no proxy's forwarding header in it."""
    client = scope.get("client")
    if not client or not _loopback_address(client[0]):
        return False
    host = None
    for key, value in scope["headers"]:
        if key in _FORWARDED:
            return False
        if key == b"host":
            host = value.decode("latin-1")
    return host is not None and _LOOPBACK_POLICY.allows(host)


#: The headers by which a proxy says it relays a request (a proxy that sends none is not seen).
_FORWARDED: Final = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip", b"via", b"x-forwarded-host",
                               b"x-forwarded-proto", b"x-forwarded-port"})


def _loopback_address(address: str) -> bool:
    try:
        peer = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = peer.ipv4_mapped if isinstance(peer, ipaddress.IPv6Address) else None  # ::ffff:127.0.0.1
    return (mapped or peer).is_loopback


class ConsolePage:
    """One of the console's static files."""

    def __init__(self, path: str, auth_on: bool) -> None:
        name, self.media_type = _FILES[path]
        self.body = resources.files("broker.ops.console").joinpath(name).read_bytes()
        self.auth_on = auth_on

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        if not self.auth_on and not loopback(scope):
            return detail(403, _OFF_LOOPBACK)
        response = Response(self.body, media_type=self.media_type)
        response.raw_headers += [*NO_SNIFF_NO_STORE, *_PAGE_HEADERS]
        return response


class ConsoleRedirect:
    """``/console`` to ``/console/``, relative, so it holds below a mount's prefix too."""

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        return Response(status_code=308, headers={"Location": "console/"})


class ConsoleState:
    """The figures, to an operator (``console:read``), or to loopback names while authentication is off."""

    def __init__(self, console: Console, auth_on: bool, challenge: Callable[[str], str],
                 operators: Collection[str] = ()) -> None:
        """``operators``: the tenants whose credentials may see the figures (``MCP_BROKER_CONSOLE_TENANTS``)."""
        self.console = console
        self.auth_on = auth_on
        self.challenge = challenge
        self.operators = frozenset(operators)

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        if not self.auth_on:
            if not loopback(scope):
                return detail(403, _OFF_LOOPBACK)
        else:
            # Every tenant's figures: the scope alone would do for any tenant's token from an
            # authorization server that grants scopes on request; the operators' tenants are named.
            caller = principal_of(scope)
            if CONSOLE not in caller.scopes:
                return detail(403, f"the console needs the scope {CONSOLE}",
                              {"WWW-Authenticate": self.challenge(CONSOLE)})
            if caller.tenant not in self.operators:
                return detail(403, f"the console answers the tenants of MCP_BROKER_CONSOLE_TENANTS only, "
                                   f"not tenant {caller.tenant!r} (docs/CONSOLE.md)")
        return json_response(await self.console.state())
