"""The tracing seam: where a change's trace context travels, and the hooks a tracer is called at.

A change's W3C trace context (``traceparent``, ``tracestate``) travels in its ``meta``: a producer
puts it there, or sends a ``traceparent`` header with ``POST /changes`` (``header_context``), and
the change log, fan-out on any worker and every notification of the change carry it on, in the
notification's ``params._meta`` as the MCP semantic conventions of OpenTelemetry propagate it.
That costs nothing more than any other ``meta`` key, with tracing on or off.

Spans are made by a ``Tracer`` only when tracing is on (``broker.ops.otel``, which imports
OpenTelemetry; nothing here does). Components hold ``Tracer | None`` and test it once per
publish, batch or write, so with tracing off the hot path runs no tracing code at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

from broker.changes import Change

__all__ = ["CONTEXT_KEYS", "ENDPOINT_VARIABLES", "TRACEPARENT", "TRACESTATE", "Finish", "Tracer", "enabled",
           "header_context", "valid_traceparent", "valid_tracestate"]

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
#: The keys of a change's ``meta`` (and of a notification's ``_meta``) that hold its trace context.
CONTEXT_KEYS: Final = (TRACEPARENT, TRACESTATE)

#: Tracing is on when one of them is set (the standard variables of OpenTelemetry's OTLP exporter).
ENDPOINT_VARIABLES: Final = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_HEX: Final = frozenset("0123456789abcdef")
#: A tracestate longer than this is dropped rather than stored with every change (W3C: 32 members, 512 is usual).
MAX_TRACESTATE: Final = 512
#: W3C Trace Context: at most 32 list members, each ``key=value``.
MAX_TRACESTATE_MEMBERS: Final = 32
_TRACESTATE_MEMBER: Final = re.compile(
    r"(?P<key>[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")

#: Ends the spans of one step; given the ids of the changes published (or None) and the error, if any.
Finish = Callable[[Sequence[str] | None, BaseException | None], None]


def enabled(environ: Mapping[str, str]) -> bool:
    """Is tracing on: an OTLP endpoint set, and neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none``?"""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def valid_traceparent(value: str) -> bool:
    """Is ``value`` a W3C ``traceparent`` of version 00 with a trace id and a parent id that are not zero?"""
    parts = value.split("-")
    if len(value) != 55 or len(parts) != 4 or parts[0] != "00":
        return False
    version, trace_id, parent_id, flags = parts
    return (len(trace_id) == 32 and len(parent_id) == 16 and len(flags) == 2
            and set(value.replace("-", "")) <= _HEX
            and trace_id != "0" * 32 and parent_id != "0" * 16)


def valid_tracestate(value: str) -> bool:
    """Is ``value`` a W3C ``tracestate``: at most ``MAX_TRACESTATE`` characters, at most 32 members of
    printable ASCII, each ``key=value`` as the grammar has them, no key twice?

    What is not is dropped unread: OpenTelemetry's parser would log a bad member as it came, control
    characters and all, once per message that carried it."""
    if len(value) > MAX_TRACESTATE:
        return False
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue  # empty members are allowed
        match = _TRACESTATE_MEMBER.fullmatch(member)
        if match is None or match["key"] in keys:
            return False
        keys.add(match["key"])
    return len(keys) <= MAX_TRACESTATE_MEMBERS


def header_context(traceparent: str | None, tracestate: str | None) -> dict[str, str] | None:
    """The trace context of a request's W3C headers, as a change's ``meta`` keys; None without a valid one.

    An invalid ``traceparent`` is ignored, as W3C Trace Context asks of a receiver (the change is
    published without a context, never refused for it).
    """
    if traceparent is None:
        return None
    traceparent = traceparent.strip().lower()
    if not valid_traceparent(traceparent):
        return None
    context = {TRACEPARENT: traceparent}
    if tracestate and valid_tracestate(tracestate):
        context[TRACESTATE] = tracestate.strip()
    return context


class Tracer(Protocol):
    """Makes the spans of a change's way through the broker, and of MCP requests (``broker.ops.otel``)."""

    def publishing(self, changes: list[Change], source: str, max_meta_bytes: int) -> tuple[list[Change], Finish]:
        """A span per change about to be appended, child of the change's own context; the changes
        to append, whose ``meta`` now carries their publish span's context (unless it would then
        encode to more than ``max_meta_bytes``), and what ends the spans."""

    def fanning_out(self, batch: Sequence[tuple[str, Change]]) -> tuple[Sequence[tuple[str, Change]], Finish]:
        """A span per change of a fan-out batch, child of the context its ``meta`` carries; the batch
        to fan out, whose notifications now carry the fan-out span's context, and what ends the spans."""

    def delivered(self, session_id: str | None, frames: Iterable[bytes]) -> None:
        """Notifications were just written to a client: a span for each that carries a trace context."""

    def request(self, method: str, params: dict[str, Any], session_id: str | None,
                header: Callable[[str], str | None] | None = None) -> Finish:
        """An MCP request begins (its span, child of the context in ``params._meta``, else of its W3C
        ``traceparent`` header, looked up with ``header``); what ends it."""

    def close(self) -> None:
        """Export what is left and stop (the worker stops)."""
