"""Legacy sessions: creation, lookup bound to the principal, and ending."""

from __future__ import annotations

import secrets
import time
from typing import Any

from broker.auth import Principal
from broker.backends.base import Backend, SessionRecord
from broker.config import Settings
from broker.errors import LimitExceeded, SessionNotFound

__all__ = ["Sessions"]


class Sessions:
    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend

    async def create(self, principal: Principal, version: str, client_info: dict[str, Any],
                     capabilities: dict[str, Any]) -> SessionRecord:
        """A new session with a cryptographically random id (visible ASCII only).

        Raises:
            LimitExceeded: ``max_sessions`` live sessions exist already.
        """
        if await self.backend.count_sessions() >= self.settings.max_sessions:
            raise LimitExceeded("too many sessions")
        record = SessionRecord(
            id=secrets.token_urlsafe(24),
            tenant=principal.tenant,
            principal=principal.key,
            protocol_version=version,
            epoch=self.backend.epoch,
            created_at=time.time(),
            client_info=client_info,
            client_capabilities=capabilities,
        )
        await self.backend.create_session(record)
        return record

    async def load(self, session_id: str, principal: Principal) -> SessionRecord:
        """The live session, with its idle clock restarted.

        Raises:
            SessionNotFound: unknown, expired or ended, or created by another principal.
        """
        if not session_id or len(session_id) > 128:
            raise SessionNotFound(session_id)
        record = await self.backend.get_session(session_id, touch_as=principal.key)
        # A session of another principal is indistinguishable from one that does not exist
        # (and its idle clock is left alone).
        if record is None or record.principal != principal.key:
            raise SessionNotFound(session_id)
        return record

    async def end(self, session_id: str) -> None:
        await self.backend.delete_session(session_id)
        # Wake the stream of the session, wherever it is, so it closes.
        await self.backend.claim_stream(session_id)
