"""What the commands that ask a running server share (``publish --url``, ``status``): one request,
a redirect never followed, and a JSON object back or an error that says so on one line.

A redirect is an error: ``urllib``'s own opener follows it with the ``Authorization`` header, which
would hand the key to whatever host the answer names.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Final

__all__ = ["BadAnswer", "error_detail", "request_json"]


class BadAnswer(ValueError):
    """The server answered, but not with what the command expects (a proxy's page, another service)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None  # the 3xx is raised as an HTTPError, as any other status that is not a success


_OPENER: Final = urllib.request.build_opener(_NoRedirects)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def request_json(request: urllib.request.Request, timeout: float = 10) -> dict[str, Any]:
    """The JSON object a server answered ``request`` with.

    Raises:
        urllib.error.HTTPError: an error status, or a redirect (not followed: ``error_detail`` says where).
        OSError: the server could not be reached.
        BadAnswer: an answer that is not HTTP, or not a JSON object.
    """
    try:
        with _OPENER.open(request, timeout=timeout) as answer:
            body = answer.read()
    except http.client.HTTPException as exc:  # not an HTTP server
        raise BadAnswer(f"not an HTTP answer ({type(exc).__name__})") from exc
    try:
        value = json.loads(body)
    except ValueError:
        raise BadAnswer("the answer is not JSON") from None
    if not isinstance(value, dict):
        raise BadAnswer("the answer is not a JSON object")
    return value


def error_detail(error: urllib.error.HTTPError) -> str:
    """What an error answer says, on one line: where a redirect points, a REST ``detail``, or nothing."""
    if 300 <= error.code < 400:
        return f"a redirect to {_one_line(error.headers.get('location') or '?')}, not followed: give that address"
    try:
        body = json.loads(error.read())
    except (ValueError, OSError, http.client.HTTPException):
        return ""
    detail = body.get("detail") if isinstance(body, dict) else None
    return _one_line(detail) if isinstance(detail, str) else ""
