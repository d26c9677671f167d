"""A small, real OAuth 2.1 authorization server for the tests: metadata, keys, tokens, introspection.

``Authority`` holds the keys (RSA and EC) and mints tokens of any shape with PyJWT, good or bad;
``Authority.app`` serves it over HTTP as an authorization server does:

* ``/.well-known/oauth-authorization-server`` (RFC 8414), the issuer being ``Authority.issuer``;
* ``/jwks``: the public keys, each with its ``kid``;
* ``/token``: the client credentials grant (RFC 6749 §4.4; ``client_secret_basic`` or
  ``_post``), with RFC 8707's ``resource`` becoming the token's ``aud``;
* ``/introspect`` (RFC 7662) for opaque tokens registered with ``opaque``, asked by a resource
  server with its own client credentials.

Faults a test may turn on: ``introspection_delay`` (seconds each introspection answer takes, as
from a server far away or busy) and ``trickle`` (the key set sent one byte every that many
seconds, a server that accepts connections but hardly answers).

``IssuerServer`` runs the app with uvicorn in a thread, on a loopback port chosen up front, so a
test can point a broker at it before it listens (the "down at start" case) and start it later.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jwt
import uvicorn
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from jwt.algorithms import ECAlgorithm, RSAAlgorithm
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support import free_port, wait_until

#: The resource server's own credentials at the introspection endpoint.
INTROSPECTOR = ("broker", "broker-secret")


@dataclass
class Client:
    """A registered client: its secret, and the claims its tokens carry (a tenant, usually)."""

    secret: str
    claims: dict[str, Any] = field(default_factory=dict)


class Authority:
    """The keys and the rules of the test authorization server (no I/O: ``app`` serves it)."""

    def __init__(self, issuer: str, audience: str) -> None:
        self.issuer = issuer
        self.audience = audience
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ec = ec.generate_private_key(ec.SECP256R1())
        #: Published keys: kid -> (private key, alg).
        self.keys: dict[str, tuple[Any, str]] = {"rsa-1": (self.rsa, "RS256"), "ec-1": (self.ec, "ES256")}
        self.clients: dict[str, Client] = {}
        self.opaque_tokens: dict[str, dict[str, Any]] = {}
        #: What the server was asked: ("token", form) and ("introspect", token) in order.
        self.requests: list[tuple[str, Any]] = []
        #: Faults: seconds each introspection answer takes; seconds between the key set's bytes.
        self.introspection_delay = 0.0
        self.trickle: float | None = None
        #: Seconds the client credentials grant's tokens live (its ``expires_in``).
        self.token_lifetime = 300
        self.app = Starlette(routes=[
            Route("/.well-known/oauth-authorization-server", self._metadata),
            Route("/jwks", self._jwks),
            Route("/token", self._token, methods=["POST"]),
            Route("/introspect", self._introspect, methods=["POST"]),
            Route("/authorize", lambda request: JSONResponse({"error": "unsupported_response_type"}, 400)),
        ])

    # -- minting -----------------------------------------------------------------------------
    def claims(self, tenant: str | None = "acme", **overrides: Any) -> dict[str, Any]:
        """Valid claims for ``tenant``; an override of None leaves that claim out."""
        now = int(time.time())
        claims: dict[str, Any] = {"iss": self.issuer, "aud": self.audience, "sub": "alice", "tenant": tenant,
                                  "iat": now, "exp": now + 300, "scope": "resources:read resources:subscribe "
                                  "records:write changes:publish", "jti": secrets.token_hex(8)}
        claims.update(overrides)
        return {name: value for name, value in claims.items() if value is not None}

    def mint(self, tenant: str | None = "acme", *, kid: str = "rsa-1", alg: str | None = None,
             key: Any = None, headers: dict[str, Any] | None = None, **claims: Any) -> str:
        """A JWT signed with the key ``kid`` names (or ``key``), its header naming ``kid``."""
        private, default_alg = self.keys.get(kid, (self.rsa, "RS256"))
        return jwt.encode(self.claims(tenant, **claims), private if key is None else key,
                          algorithm=alg or default_alg, headers={"kid": kid, **(headers or {})})

    def unsigned(self, tenant: str = "acme") -> str:
        """A token with ``alg: none``: a header, the claims and an empty signature."""
        return jwt.encode(self.claims(tenant), None, algorithm="none", headers={"kid": "rsa-1"})

    def hs256_with_public_key(self, tenant: str = "acme") -> str:
        """The algorithm-confusion forgery: HMAC-SHA256 keyed with the RSA public key (PEM), which anyone
        has. Built by hand: PyJWT itself refuses to use a PEM key as an HMAC secret."""
        pem = self.rsa.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
        header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}).encode())
        payload = _b64(json.dumps(self.claims(tenant)).encode())
        signature = hmac.new(pem, f"{header}.{payload}".encode(), hashlib.sha256).digest()
        return f"{header}.{payload}.{_b64(signature)}"

    def rotate(self) -> str:
        """Publish a new RSA key (the old ones stay); returns its kid."""
        kid = f"rsa-{len(self.keys) + 1}"
        self.keys[kid] = (rsa.generate_private_key(public_exponent=65537, key_size=2048), "RS256")
        return kid

    def register(self, client_id: str, **claims: Any) -> str:
        """A client for the client credentials grant; returns its secret."""
        secret = secrets.token_urlsafe(16)
        self.clients[client_id] = Client(secret, claims)
        return secret

    def opaque(self, active: bool = True, **claims: Any) -> str:
        """An opaque token the introspection endpoint knows."""
        token = "opaque-" + secrets.token_urlsafe(24)
        self.opaque_tokens[token] = {"active": active, **(self.claims(**claims) if active else {})}
        return token

    # -- serving -----------------------------------------------------------------------------
    async def _metadata(self, request: Request) -> Response:
        return JSONResponse({
            # RFC 8414 requires an authorization endpoint (the SDK's model too); this server has none to
            # offer (client credentials only), and answers there with an error.
            "issuer": self.issuer, "authorization_endpoint": self.issuer + "/authorize",
            "jwks_uri": self.issuer + "/jwks", "token_endpoint": self.issuer + "/token",
            "introspection_endpoint": self.issuer + "/introspect", "grant_types_supported": ["client_credentials"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
            "response_types_supported": ["code"],
        })

    async def _jwks(self, request: Request) -> Response:
        keys = []
        for kid, (private, alg) in list(self.keys.items()):
            to_jwk = RSAAlgorithm.to_jwk if alg.startswith("RS") else ECAlgorithm.to_jwk
            keys.append({**to_jwk(private.public_key(), as_dict=True), "kid": kid, "alg": alg, "use": "sig"})
        if self.trickle is not None:
            return StreamingResponse(self._trickled(json.dumps({"keys": keys}).encode(), self.trickle),
                                     media_type="application/json")
        return JSONResponse({"keys": keys})

    @staticmethod
    async def _trickled(body: bytes, every: float) -> Any:
        for byte in body:
            yield bytes([byte])
            await asyncio.sleep(every)

    def _client(self, request: Request, form: dict[str, str]) -> tuple[str, Client] | None:
        client_id, secret = form.get("client_id"), form.get("client_secret")
        basic = request.headers.get("authorization", "")
        if basic.lower().startswith("basic "):
            from urllib.parse import unquote

            client_id, _, secret = base64.b64decode(basic[6:]).decode().partition(":")
            client_id, secret = unquote(client_id), unquote(secret)
        client = self.clients.get(client_id or "")
        if client_id is None or client is None or not secrets.compare_digest(client.secret, secret or ""):
            return None
        return client_id, client

    async def _token(self, request: Request) -> Response:
        form = {name: str(value) for name, value in (await request.form()).items()}
        self.requests.append(("token", form))
        if form.get("grant_type") != "client_credentials":
            return JSONResponse({"error": "unsupported_grant_type"}, 400)
        found = self._client(request, form)
        if found is None:
            return JSONResponse({"error": "invalid_client"}, 401)
        client_id, client = found
        scope = form.get("scope") or "resources:read"
        token = jwt.encode(self.claims(**{"sub": client_id, "aud": form.get("resource", self.audience),
                                          "scope": scope, "exp": int(time.time()) + self.token_lifetime,
                                          **client.claims}),
                           self.rsa, algorithm="RS256", headers={"kid": "rsa-1"})
        return JSONResponse({"access_token": token, "token_type": "Bearer", "expires_in": self.token_lifetime,
                             "scope": scope})

    async def _introspect(self, request: Request) -> Response:
        form = {name: str(value) for name, value in (await request.form()).items()}
        self.requests.append(("introspect", form.get("token")))
        if self.introspection_delay:
            await asyncio.sleep(self.introspection_delay)
        basic = request.headers.get("authorization", "")
        expected = "Basic " + base64.b64encode(":".join(INTROSPECTOR).encode()).decode()
        if not secrets.compare_digest(basic, expected):
            return JSONResponse({"error": "invalid_client"}, 401)
        return JSONResponse(self.opaque_tokens.get(form.get("token", ""), {"active": False}))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class IssuerServer:
    """``Authority`` over HTTP on a loopback port, started and stopped at will."""

    def __init__(self, audience: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.authority = Authority(self.url, audience)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> IssuerServer:
        config = uvicorn.Config(self.authority.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", ws="none", http="h11", access_log=False)
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, name="oauth-issuer", daemon=True)
        self._thread.start()
        wait_until(lambda: server.started, what="the test authorization server to listen")
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = self._thread = None

    def __enter__(self) -> IssuerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
