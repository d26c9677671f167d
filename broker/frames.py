"""The frames legacy sessions receive, built in one place for fan-out and for the gap rule.

A frame's key says what it is about (``u:<uri>`` or ``l``); frames with one key coalesce.
"""

from __future__ import annotations

from typing import Any, Final

from broker.backends.base import Frame
from broker.protocol.messages import notification

__all__ = ["LIST_CHANGED", "update_frame"]

LIST_CHANGED: Final = Frame("l", notification("notifications/resources/list_changed"))


def update_frame(uri: str, meta: dict[str, Any] | None = None, change: str = "") -> Frame:
    """``notifications/resources/updated`` for ``uri``; a change's ``meta`` goes into ``params._meta``.

    ``change``: the id of the change behind it, for fan-out (see ``Frame.change``).
    """
    params: dict[str, Any] = {"uri": uri}
    if meta:
        params["_meta"] = meta
    return Frame("u:" + uri, notification("notifications/resources/updated", params), change)
