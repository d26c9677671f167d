"""Resource updates as events: the Events extension draft (``io.modelcontextprotocol/events``), experimental.

One event type, ``mcp.resource.updated`` (the name the draft's open question gives), delivered
by ``events/poll`` and by webhooks (``events/subscribe``). Both keep their state the way a
resumable listen does: a feed (``broker.feeds``, of kind ``poll`` or ``webhook``) bound to the
principal, its filter the URIs of the arguments, its inbox filled by fan-out and readable by
any worker; a poll page and a webhook's deliveries are views of it (``feeds.poll``,
``feeds.webhook``). ``model`` holds the wire shapes, ``poll`` and ``subscribe`` the methods,
``callbacks`` the callback safety and the signed POST, ``delivery`` the leases under which a
subscription's deliveries run, the POST retries and dead letters (docs/EVENTS.md).
"""

from __future__ import annotations
