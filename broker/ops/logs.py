"""Logs: one configuration for every command, a JSON format for pipelines, and what is said about a request.

``configure`` sets up the broker's loggers (and uvicorn's) on stderr, at ``log_level``, as
readable text or as one JSON object a line (``log_format``): time, level, logger, the worker's
pid, the message, and the tenant, session and request id of the request being served when there
is one (``bind``, set by the app for each request). The session and request id are headers a
client writes, so each field is cut to ``MAX_FIELD`` characters and percent-encoded but for
letters, digits and ``-._~:/+@``: a forged ``tenant=`` field, a line break (NEL included) or a
30 kB header cannot make a line lie or grow. ``rejected`` logs refused requests (401, 403, 413,
421, 429, ...) with their method and path, escaped alike, at a bounded rate, so a flood of bad
requests cannot flood the log: at most one line per route and status every ``REJECTED_EVERY``
seconds, with how many were refused meanwhile.
``startup`` is the one line each worker writes at start with its effective configuration, secrets
masked.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from typing import Any, Final
from urllib.parse import quote

from broker import __version__
from broker.config import Settings

__all__ = ["MAX_FIELD", "REJECTED_EVERY", "JsonFormatter", "bind", "configure", "escaped", "rejected",
           "startup_line"]

logger = logging.getLogger("broker.requests")

#: Characters of one request field (tenant, session, request id) a line carries; the rest is cut.
MAX_FIELD: Final = 128
#: Seconds between two lines about refused requests of one route and status.
REJECTED_EVERY: Final = 10.0
#: The request being served: tenant, session, request id (absent keys are left out of JSON lines).
_CONTEXT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("mcp_broker_log", default=None)
_HANDLER: Final = "mcp-broker"
TEXT_FORMAT: Final = "%(asctime)s %(levelname)-7s %(name)s [%(process)d]%(context)s %(message)s"


def bind(**fields: str | None) -> None:
    """Name the request this task serves in every line it logs from now on (each request has its task)."""
    _CONTEXT.set({k: escaped(v) for k, v in fields.items() if v})


def escaped(value: str) -> str:
    """A field a client wrote, as a line may carry it: cut to ``MAX_FIELD`` characters, percent-encoded."""
    return quote(value[:MAX_FIELD], safe="-._~:/+@")


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        fields = _CONTEXT.get()
        record.context_fields = fields or {}
        record.context = "".join(f" {k}={v}" for k, v in fields.items()) if fields else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line; never raises on an odd argument (it logs its ``repr``)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "context_fields", {}) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=repr, ensure_ascii=False)


def configure(settings: Settings, *, level: str | None = None, fmt: str | None = None) -> None:
    """Log the broker's (and uvicorn's) records to stderr at ``level`` in ``fmt`` (the settings' by default)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    if (fmt or settings.log_format) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.set_name(_HANDLER)
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == _HANDLER:  # configured again (a worker, a test): replace ours, keep others'
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel((level or settings.log_level).upper())
    for name in ("uvicorn", "uvicorn.error"):
        # uvicorn's own handlers would print a second, differently formatted copy of each line.
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    # No line per request: refusals are logged (``rejected``), and answers are counted in the metrics.
    logging.getLogger("uvicorn.access").disabled = True


_refused: dict[tuple[str, int], tuple[float, int]] = {}


def rejected(route: str, status: int, peer: str | None = None, *, method: str = "", path: str = "") -> None:
    """A request was refused with ``status``: said at most every ``REJECTED_EVERY`` seconds per route and status.

    The line names the method and path of the request that made it (escaped: a client wrote them).
    """
    now = time.monotonic()
    last, count = _refused.get((route, status), (0.0, 0))
    if now - last < REJECTED_EVERY:
        _refused[(route, status)] = (last, count + 1)
        return
    _refused[(route, status)] = (now, 0)
    more = f" (and {count} more since the last such line)" if count else ""
    request = f": {escaped(method)} {escaped(path)}" if method or path else ""
    logger.warning("refused a request to %s with %d%s%s%s", route, status, request, f" from {peer}" if peer else "",
                   more)


def startup_line(settings: Settings) -> str:
    """The effective configuration, one line, secrets left out (keys are counted, URLs lose their password)."""
    from urllib.parse import urlsplit

    backend = "memory"
    if settings.redis_url:
        parts = urlsplit(settings.redis_url)
        host = parts.hostname or ""
        backend = f"{parts.scheme}://{host}{':' + str(parts.port) if parts.port else ''}{parts.path}"
    methods = settings.auth_methods
    # With keys on, the keys stored at run time (the admin API, ``mcp-broker keys``) are accepted
    # whether or not the settings name any.
    static = f" and {len(settings.api_keys)} API keys of the settings" if settings.api_keys else ""
    auth = " and ".join(([f"stored API keys{static}"] if "keys" in methods else [])
                        + ([f"OAuth tokens of {settings.oauth_issuer}"] if "oauth" in methods else [])) \
        or f"off (anonymous principal of tenant {settings.default_tenant!r})"
    hosts = "loopback names" if settings.allowed_hosts is None and settings.host in ("127.0.0.1", "localhost", "::1") \
        else ("any" if settings.allowed_hosts is None else ",".join(settings.allowed_hosts))
    return (f"mcp-broker {__version__} pid {os.getpid()}: backend {backend}, change-log partitions "
            f"{settings.changelog_partitions or 'as stored'}, auth {auth}, allowed hosts {hosts}, allowed origins "
            f"{','.join(settings.allowed_origins)}, fan-out {'embedded' if settings.embedded_fanout else 'separate'}, "
            f"metrics {'on' if settings.metrics else 'off'}, demo {'on' if settings.demo else 'off'}")
