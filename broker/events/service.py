"""The events extension assembled: its four methods for ``Methods.extend``, and the worker's delivery task."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from broker.auth import Anonymous, Authenticator
from broker.backends.base import Inboxes, Leases, Webhooks
from broker.config import Settings
from broker.events.callbacks import Callbacks
from broker.events.delivery import Revoked, WebhookDelivery
from broker.events.model import EVENTS, event_type
from broker.events.poll import EventPolls
from broker.events.subscribe import WebhookSubscriptions
from broker.feeds.service import Feeds
from broker.methods import Call, Handler, Methods
from broker.protocol import jsonrpc as rpc
from broker.quotas import Quotas, TenantQuotas

__all__ = ["Events"]


class Events:
    """``events/list``, ``events/poll``, ``events/subscribe``, ``events/unsubscribe``, and webhook delivery."""

    def __init__(self, settings: Settings, methods: Methods, feeds: Feeds, inboxes: Inboxes, store: Webhooks,
                 leases: Leases, touch: Callable[[Sequence[str]], Awaitable[None]], *, authenticator: Authenticator,
                 quotas: TenantQuotas | None = None, revoked: Revoked | None = None,
                 buckets: Quotas | None = None) -> None:
        """``authenticator``: the broker's (webhooks are offered unless it is ``Anonymous``, whatever
        the settings say: a custom one passed to ``Broker`` brings credentials of its own).
        ``quotas``: the tenants' ``webhooks`` quotas. ``revoked``: the lookup
        of stored keys that no longer hold (``StoredKeys.invalid``), when there are stored keys.
        ``buckets``: the worker's ``Quotas``, which count each tenant's webhook verifications."""
        self.settings = settings
        self.callbacks = Callbacks(settings)
        self.polls = EventPolls(settings, methods, feeds)
        self.webhooks = WebhookSubscriptions(settings, methods, feeds, store, self.callbacks,
                                             authenticated=not isinstance(authenticator, Anonymous), quotas=quotas,
                                             buckets=buckets)
        self.delivery = WebhookDelivery(settings, store, leases, inboxes, feeds, self.webhooks, self.callbacks, touch,
                                        revoked)
        # The draft: an unauthenticated server may offer poll, not webhooks.
        self.modes = ["poll", "webhook"] if self.webhooks.authenticated else ["poll"]

    def install(self, methods: Methods) -> None:
        handlers: dict[str, Handler] = {
            "events/list": self._list,
            "events/poll": self.polls.poll,
            "events/subscribe": self.webhooks.subscribe,
            "events/unsubscribe": self.webhooks.unsubscribe,
        }
        methods.extend(handlers, {EVENTS: {"listChanged": False, "experimental": True}})

    async def _list(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        if params.get("cursor") is not None:  # one page holds every event type: no cursor is ever issued
            raise rpc.RpcError(rpc.INVALID_PARAMS, "Invalid cursor", {"cursor": params["cursor"]}, invalid=True)
        return {"events": [event_type(self.modes, self.settings.max_listen_uris)]}
