"""The frames legacy sessions receive, built in one place for fan-out and for the gap rule.

A frame's key says what it is about (``u:<uri>`` or ``l``); frames with one key coalesce.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from broker.backends.base import Frame
from broker.protocol.messages import notification

__all__ = ["LIST_CHANGED", "update_frame"]

logger = logging.getLogger(__name__)

LIST_CHANGED: Final = Frame("l", notification("notifications/resources/list_changed"))


def update_frame(uri: str, meta: dict[str, Any] | None = None, change: str = "") -> Frame:
    """``notifications/resources/updated`` for ``uri``; a change's ``meta`` goes into ``params._meta``.

    ``change``: the id of the change behind it, for fan-out (see ``Frame.change``). A ``meta``
    that cannot be encoded (``ChangeRules`` keeps such changes out of the log, but one may
    predate the rule) is left out: the notification still says "re-read this", and the batch it
    came in is not failed, and retried, for every tenant's changes behind it.
    """
    if not meta:
        return Frame("u:" + uri, notification("notifications/resources/updated", {"uri": uri}), change)
    try:
        data = notification("notifications/resources/updated", {"uri": uri, "_meta": meta})
    except TypeError:  # orjson.JSONEncodeError: too deep, a type JSON lacks, an integer too large
        logger.error("the meta of a change of %s cannot be encoded; notifying without it", uri)
        data = notification("notifications/resources/updated", {"uri": uri})
    return Frame("u:" + uri, data, change)
