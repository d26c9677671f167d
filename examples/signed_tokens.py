"""An ``Authenticator`` in one file: bearer tokens signed by the platform with a shared secret.

A token is ``<tenant>.<subject>.<signature>``, the signature an HMAC-SHA256 of ``<tenant>.<subject>``
(hex). Wire it in with one line::

    broker = Broker(settings, authenticator=SignedTokens(b"the platform's secret"))
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from broker.auth import Principal, Unauthorized
from broker.tenants import tenant_problem


class SignedTokens:
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def sign(self, tenant: str, subject: str) -> str:
        body = f"{tenant}.{subject}"
        return body + "." + hmac.new(self.secret, body.encode(), hashlib.sha256).hexdigest()

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        authorization = headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        tenant, _, rest = token.strip().partition(".")
        subject, _, signature = rest.partition(".")
        if scheme.lower() != "bearer" or tenant_problem(tenant) is not None or not subject:
            raise Unauthorized("a signed bearer token is required", 'Bearer realm="platform"')
        if not hmac.compare_digest(self.sign(tenant, subject), token.strip()):
            raise Unauthorized("the token's signature does not match", 'Bearer realm="platform", error="invalid_token"')
        return Principal(tenant, subject)
