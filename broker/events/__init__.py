"""Resource updates as events: the Events extension draft (``io.modelcontextprotocol/events``), experimental.

One event type, ``mcp.resource.updated`` (the name the draft's open question gives), delivered
by ``events/poll`` and by webhooks (``events/subscribe``). Both keep their state the way a
resumable listen does: a hidden session bound to the principal, its subscriptions the URIs of
the arguments, its inbox filled by fan-out and readable by any worker. ``model`` holds the
wire shapes, ``poll`` and ``subscribe`` the methods, ``callbacks`` the callback safety and the
signed POST, ``delivery`` the per-subscription delivery under a lease (docs/EVENTS.md).
"""

from __future__ import annotations
