"""The MCP conversation, once, for every transport: what each message means and what it gets back.

HTTP (``transport/http.py``) and stdio (``transport/stdio.py``) frame messages, pick the era
(``protocol.envelope.http_era`` / ``stdio_era``) and turn what this module returns into
statuses, headers or lines; everything in between is here: ``initialize``, the legacy
notifications, requests and batches, the 2026-07-28 envelope and method calls, opening a
listen. Errors leave as an ``RpcError`` (a JSON-RPC code) or a domain ``Refusal`` (a quota, a
bound, an outage) that the transport spells once (``broker.protocol.refusals``) and, on HTTP,
answers with the status of its code (``broker.transport.rpc``); nothing here picks a status.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from broker.auth import Principal
from broker.auth.scopes import METHOD_SCOPES, forbidden
from broker.backends.types import SessionRecord
from broker.batches import answer_batch, check_batch, encode_batch
from broker.delivery.listen import Listen, ListenIndex
from broker.delivery.stream import EndReason
from broker.errors import AnswerTooLarge, BackendUnavailable, Refusal
from broker.feeds.listen import ResumableListen, ResumableListens, last_event_id, wants_resumable
from broker.feeds.model import FeedKind
from broker.feeds.service import Feeds
from broker.feeds.session import SessionServices, SessionStream
from broker.methods import FORWARDED, Call, Methods
from broker.protocol import jsonrpc as rpc
from broker.protocol.envelope import check_meta
from broker.protocol.jsonrpc import Message
from broker.protocol.refusals import rpc_error
from broker.protocol.versions import BATCH_VERSIONS
from broker.quotas import Lease, Quotas

__all__ = ["Dispatcher"]

logger = logging.getLogger(__name__)


class Dispatcher:
    """Serves MCP messages of both eras to whichever transport received them."""

    def __init__(self, methods: Methods, feeds: Feeds, listens: ListenIndex, streams: SessionServices, *,
                 max_batch_items: int, max_response_bytes: int, max_read_bytes: int, quotas: Quotas | None = None,
                 resumables: ResumableListens | None = None) -> None:
        """``quotas``: the tenants' ``streams`` and ``listens`` quotas (HTTP only: a stdio process is one client).
        ``resumables``: opens the listens of clients that ask for the resumable-listen extension."""
        self.resumables = resumables
        self.methods = methods
        self.quotas = quotas
        #: The quota place of each open listen that holds one, until ``close_listen``.
        self._leases: dict[Listen | ResumableListen, Lease] = {}
        self.feeds = feeds
        self.listens = listens
        self.streams = streams
        self.max_batch_items = max_batch_items
        self.max_response_bytes = max_response_bytes
        self.max_read_bytes = max_read_bytes

    @property
    def closing(self) -> bool:
        """The worker is stopping: a stream asked for now ends at once (``retry:`` / ``complete``)."""
        return self.streams.streams.closing

    # -- 2025 (sessions) --------------------------------------------------------------------
    async def initialize(self, principal: Principal, msg: Message,
                         header: Callable[[str], str | None] | None = None) -> tuple[bytes, SessionRecord]:
        """Start a session; the reply and the new session. ``header``: the HTTP request's headers (a tracer's).

        Raises:
            RpcError: -32600 when it is not a request; -32602 for bad params.
            OverQuota: the tenant's ``sessions`` quota or share. LimitExceeded: ``max_sessions`` sessions are live.
        """
        if not msg.is_request:
            raise rpc.RpcError(rpc.INVALID_REQUEST, "initialize must be a request")
        done = self.methods.begin("initialize", msg.params, header=header)
        try:
            version, client_info, caps = self.methods.initialize(msg.params)
            record = await self.feeds.create(principal, FeedKind.SESSION, version=version, client_info=client_info,
                                             capabilities=caps)
        except BaseException as exc:
            done(exc)
            raise
        done(None)
        return rpc.encode_result(msg.id, self.methods.initialize_result(version, principal.tenant)), record

    async def load_session(self, session_id: str, principal: Principal) -> SessionRecord:
        """The principal's live session. Raises ``SessionNotFound`` (MCP: 404, initialize again), for
        a feed of another kind too (a resumable listen's or a poll's id is no session)."""
        return await self.feeds.load(session_id, principal, FeedKind.SESSION)

    def refusal(self, principal: Principal, method: str | None) -> rpc.RpcError | None:
        """The 403 error of a request whose caller lacks the scope ``method`` needs, None when it may go on.

        ``Methods.call`` refuses the same way; asking first lets a transport answer a lone
        request with the 403 status rather than inside a 200.
        """
        needed = METHOD_SCOPES.get(method or "")
        if needed is None or needed in principal.scopes:
            return None
        return forbidden(method or "", needed)

    async def legacy(self, call: Call, msg: Message, *, whole: bool = False) -> bytes | None:
        """A legacy request's reply, or None for a notification (which has none).

        ``whole``: the reply is the whole answer, so a refusal is raised (the transport answers it
        with its status and ``Retry-After``, e.g. a quota's 429) rather than put in the reply.
        """
        if msg.is_request:
            return await self.request(call, msg, whole=whole)
        await self.notify(call, msg)
        return None

    async def notify(self, call: Call, msg: Message) -> None:
        """A legacy notification: ``notifications/initialized`` is recorded, the rest accepted and dropped.

        ``notifications/cancelled`` cancels nothing of the broker's own: every legacy request is
        answered before the message that carried it returns. A session with sessions at upstreams
        passes it on to them: the request it names may be a forwarded one, running on any worker.
        Responses need no answer (the broker sends no requests).
        """
        if msg.method == "notifications/initialized" and call.session is not None:
            await self.feeds.initialized(call.session.id)
        elif msg.method == "notifications/cancelled" and call.session is not None and self.methods.upstreams:
            # A forwarded request, running here or on another worker: ended here, told to its upstream.
            await self.methods.upstreams.cancelled(call.session, msg.params)

    async def request(self, call: Call, msg: Message, *, whole: bool = False) -> bytes:
        """One request's reply: its result, or the error a method raised (see ``legacy`` for ``whole``).

        Raises ``BackendUnavailable``: the transport answers an outage (HTTP: 503 for the whole message).
        """
        assert msg.id is not None  # a request has one (parse_message)
        try:
            return self.answer(msg, await self.call(call, msg))
        except rpc.RpcError as exc:
            return rpc.encode_error(msg.id, exc)
        except BackendUnavailable:
            raise
        except Refusal as exc:
            if whole:
                raise
            return rpc.encode_error(msg.id, rpc_error(exc))

    def answer(self, msg: Message, result: dict[str, Any]) -> bytes:
        """``result`` encoded as the reply to ``msg``, or, when that is more than ``max_read_bytes``, the
        -32602 error that says so (``AnswerTooLarge``).

        Every transport encodes its replies here. A provider that can tell the size before it reads
        refuses earlier (``broker/sources/files.py``, ``broker/sources/postgres.py``); this catches what only the
        encoding shows (a control character is six bytes in JSON) and any provider's answer. The
        refused reply was built once and is dropped at once, so it costs a few times the bound for
        a moment, never a client's connection.
        """
        reply = rpc.encode_result(msg.id, result)
        if len(reply) <= self.max_read_bytes:
            return reply
        uri = msg.params.get("uri")
        refused = AnswerTooLarge(uri if isinstance(uri, str) else None, self.max_read_bytes, msg.method or "reply")
        return rpc.encode_error(msg.id, rpc.RpcError(rpc.INVALID_PARAMS, refused.message, refused.data))

    async def call(self, call: Call, msg: Message) -> dict[str, Any]:
        """One request's result. Raises the ``RpcError`` or ``Refusal`` its method raised."""
        assert msg.method is not None  # a request has one (parse_message)
        if msg.method in FORWARDED and call.request_id is None:
            call = replace(call, request_id=msg.id)  # forwarded as the caller's own (its cancel names it)
        return await self.methods.call(call, msg.method, msg.params)

    async def batch(self, call: Call, items: list[Any],
                    member: Callable[[Message], Awaitable[bytes | None]] | None = None) -> bytes | None:
        """A 2025-03-26 batch's answer (None when it held only notifications).

        Each member is answered by ``member`` (``legacy`` by default); stdio passes its own,
        which answers an outage in the member's reply, having no status to say it with.

        Raises:
            RpcError: -32600 for a session of a version without batches, an empty batch or one
                longer than ``max_batch_items``.
        """
        self.check_batch(items)
        if call.session is None:
            raise rpc.RpcError(rpc.INVALID_REQUEST,
                               f"Invalid Request: batches are only part of {', '.join(sorted(BATCH_VERSIONS))}")
        if call.session.protocol_version not in BATCH_VERSIONS:
            raise rpc.RpcError(rpc.INVALID_REQUEST,
                               f"Invalid Request: batches are not part of {call.session.protocol_version}")
        answer = member or (lambda msg: self.legacy(call, msg))
        replies = await answer_batch(items, answer, self.max_response_bytes)
        return encode_batch(replies) if replies else None

    def check_batch(self, items: list[Any]) -> None:
        """Refuse an empty batch or one longer than ``max_batch_items`` (before anything else is looked at).

        Raises:
            RpcError: -32600.
        """
        check_batch(items, self.max_batch_items)

    def legacy_stream(self, session: SessionRecord, cursor: int | None, *, resync: bool = False,
                      priming: bool = False, principal: Principal | None = None) -> SessionStream:
        """The session's stream from ``cursor`` (see ``SessionStream``); ``run`` it on the transport's writer.

        With ``principal``, the stream ends when the principal's credential expires or is revoked.
        """
        stream = SessionStream(self.streams, session, cursor, resync=resync, priming=priming)
        if principal is not None:
            stream.bind(principal.credential, principal.expires_at)
        return stream

    async def stream_lease(self, session: SessionRecord) -> Callable[[EndReason | None], None] | None:
        """Take the session's place in its tenant's ``streams`` quota; what releases it when the
        stream ends (None: the tenant has no such quota). The place is the session's, so a takeover
        of its stream holds the same one, and the stream it took over leaves it in place.

        Raises:
            OverQuota: the tenant has its quota of open streams.
        """
        if self.quotas is None:
            return None
        lease = await self.quotas.acquire("streams", session.tenant, session.id)
        if lease is None:
            return None
        quotas = self.quotas
        return lambda reason: quotas.release(lease, keep=reason is EndReason.TAKEOVER)

    async def end_session(self, session: SessionRecord) -> None:
        await self.feeds.end(session.id)
        if session.upstreams and self.methods.upstreams is not None:
            await self.methods.upstreams.ended(session)

    # -- 2026-07-28 (stateless) -----------------------------------------------------------------
    async def modern(self, principal: Principal, msg: Message,
                     header: Callable[[str], str | None] | None = None,
                     progress: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                     ) -> bytes | Listen | ResumableListen:
        """A modern request's reply, or the listen it opened (the transport runs it and then ``close_listen``).

        ``header`` looks up the request's HTTP headers (SEP-2243); stdio has none. ``progress``: where
        an upstream's notifications about a forwarded request go (None: dropped).

        Raises:
            RpcError, Refusal: the request's error, the whole reply: on 2026-07-28 its HTTP status
                says what kind of error it is (docs/PROTOCOL.md).
        """
        assert msg.method is not None and msg.id is not None
        check_meta(msg, header)
        call = Call(principal, True, header=header, progress=progress)
        if msg.method == "subscriptions/listen":
            if self.resumables is not None and wants_resumable(msg.params):
                return await self.resumable_listen(call, msg, header)
            return await self.leased_listen(call, msg)
        return self.answer(msg, await self.methods.call(call, msg.method, msg.params))

    def listen(self, call: Call, msg: Message,
               listen_filter: tuple[list[str], bool, dict[str, Any]] | None = None) -> Listen:
        """Open a listen: its filter checked (unless ``listen_filter`` is the checked one), registered
        at once (capacity included) so nothing handed on from now on is missed; refusals come back
        before any stream starts.

        Raises:
            RpcError: -32602 for a bad filter.
            LimitExceeded: this worker has ``max_listens`` open. OverQuota: the tenant has its share of
                them (``MCP_BROKER_TENANT_SHARE``).
        """
        assert msg.id is not None
        uris, list_changed, ack = listen_filter or self.methods.listen_filter(call, msg.params)
        listen = self.listens.open(msg.id, call.principal.tenant, uris, list_changed, ack)
        listen.bind(call.principal.credential, call.principal.expires_at)  # it ends with the credential
        return listen

    async def leased_listen(self, call: Call, msg: Message) -> Listen:
        """``listen``, holding a place in the tenant's ``listens`` quota when it has one.

        The worker's broadcast subscription is confirmed first (``ListenIndex.ready``), and the
        listen is registered with no wait in between, so it receives every change fanned out
        after its ack; a listen refused there was never counted nor held a place.

        Raises:
            RpcError, LimitExceeded, OverQuota: as ``listen``; OverQuota also when the tenant has its quota of listens.
            BackendUnavailable: this worker could not subscribe the broadcast.
        """
        listen_filter = self.methods.listen_filter(call, msg.params)  # a bad filter takes no place
        lease = await self._listen_lease(call.principal.tenant)
        try:
            await self.listens.ready()
            listen = self.listen(call, msg, listen_filter)
        except BaseException:
            if lease is not None and self.quotas is not None:
                self.quotas.release(lease)
            raise
        if lease is not None:
            self._leases[listen] = lease
        if self.methods.wants is not None:  # an upstream's URI among them: its watch is wanted
            try:
                await self.methods.wants.want(call.principal.tenant, listen.uris)
            except BaseException:
                self.close_listen(listen)
                raise
        return listen

    async def _listen_lease(self, tenant: str) -> Lease | None:
        """A place in the tenant's ``listens`` quota, None when it has none.

        Raises:
            OverQuota: the tenant has its quota of listens.
        """
        if self.quotas is None or self.quotas.limits(tenant).listens is None:
            return None
        return await self.quotas.acquire("listens", tenant)

    async def resumable_listen(self, call: Call, msg: Message,
                               header: Callable[[str], str | None] | None) -> ResumableListen:
        """Open a resumable listen (``broker.feeds.listen``), new or from the last event id its client
        received (the ``Last-Event-ID`` header, or on stdio its ``_meta``), holding a place in the
        tenant's ``listens`` quota as a plain listen does.

        Raises:
            RpcError: -32602 for a bad filter or an id the broker never issues.
            OverQuota: over the tenant's ``listens`` or ``sessions`` quota. LimitExceeded: ``max_sessions``
                sessions are live (a resumable listen keeps its state in one).
        """
        assert msg.id is not None and self.resumables is not None
        uris, list_changed, ack = self.methods.listen_filter(call, msg.params)
        stdio = header is None  # stdio has no headers: the id travels in ``_meta``
        resume_from = last_event_id(msg.params, None if header is None else header("last-event-id"))
        lease = await self._listen_lease(call.principal.tenant)
        try:
            listen = await self.resumables.open(call.principal, msg.id, uris, list_changed, ack, resume_from,
                                                stdio=stdio)
        except BaseException:
            if lease is not None and self.quotas is not None:
                self.quotas.release(lease)
            raise
        if lease is not None:
            self._leases[listen] = lease
        return listen

    def close_listen(self, listen: Listen | ResumableListen) -> None:
        """Release a listen however it ended, even if it never ran."""
        if isinstance(listen, Listen):
            self.listens.close(listen)
        else:
            listen.unbind()  # its stream unregistered itself when it ended
        lease = self._leases.pop(listen, None)
        if lease is not None and self.quotas is not None:
            self.quotas.release(lease)
