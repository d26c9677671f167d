"""Tenant names: what a valid one looks like. Pure: no I/O.

A tenant name becomes part of Redis key names, record URIs (``mcpb://<tenant>/...``) and log
lines, so it is kept to a small alphabet: a letter or digit, then up to 63 letters, digits,
``.``, ``_`` or ``-``. Principals are only made from names checked here (the settings refuse
anything else at start); the Redis keys escape whatever they are given anyway (``keys.py``).
"""

from __future__ import annotations

import re

__all__ = ["TENANT_RULE", "tenant_problem"]

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

#: The rule, as said to whoever wrote a bad name.
TENANT_RULE = "a letter or digit, then at most 63 letters, digits, '.', '_' or '-'"


def tenant_problem(name: str) -> str | None:
    """Why ``name`` is not a valid tenant name, or None when it is."""
    if _TENANT.fullmatch(name):
        return None
    return f"tenant {name!r} is not a valid tenant name ({TENANT_RULE})"
