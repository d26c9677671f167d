"""Bounds on JSON values taken from clients: nesting depth, the types JSON and msgpack carry, size.

Pure: no I/O. A value accepted here encodes with orjson and msgpack, which is what the broker
does with it later, often in another process (fan-out, a session restored from Redis): an
encoding failure there would cost someone else, so it must be found here, at the door.
"""

from __future__ import annotations

import math
from typing import Any, Final

import orjson

__all__ = ["JsonRefused", "check_json", "encode_bounded"]

#: The integers both encoders carry: msgpack and orjson stop at 64 bits (signed or unsigned).
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1


class JsonRefused(ValueError):
    """A value that is not JSON the broker can keep: too deep, too large, or of a type JSON lacks."""


def check_json(value: Any, max_depth: int) -> None:
    """Check ``value`` is plain JSON (dict with str keys, list, str, int, finite float, bool, None)
    nested at most ``max_depth`` containers deep. Iterative, so no input can exhaust the stack.

    Raises:
        JsonRefused: with a message that names the rule broken.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > max_depth:
                raise JsonRefused(f"nested deeper than {max_depth} levels")
            for key, child in item.items():
                if not isinstance(key, str):
                    raise JsonRefused("object keys must be strings")
                if isinstance(child, (dict, list)):
                    stack.append((child, depth + 1))
                else:
                    _check_scalar(child)
        elif isinstance(item, list):
            if depth > max_depth:
                raise JsonRefused(f"nested deeper than {max_depth} levels")
            for child in item:
                if isinstance(child, (dict, list)):
                    stack.append((child, depth + 1))
                else:
                    _check_scalar(child)
        else:
            _check_scalar(item)


def _check_scalar(value: Any) -> None:
    if value is None or isinstance(value, (str, bool)):
        return
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise JsonRefused("integers must fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise JsonRefused("numbers must be finite (no NaN or infinity)")
    else:
        raise JsonRefused(f"a {type(value).__name__} is not a JSON value")


def encode_bounded(value: Any, max_depth: int, max_bytes: int, what: str) -> bytes:
    """``value`` checked by ``check_json`` and encoded, refused when the encoding exceeds ``max_bytes``.

    Raises:
        JsonRefused: the message starts with ``what`` and names the limit that was passed.
    """
    # Encoded first (in C): a value too large is refused without a walk over every item of it.
    try:
        data = orjson.dumps(value)
    except TypeError as exc:  # orjson.JSONEncodeError: the walk below says which rule, if one
        try:
            check_json(value, max_depth)
        except JsonRefused as refused:
            raise JsonRefused(f"{what}: {refused}") from exc
        raise JsonRefused(f"{what}: {exc}") from exc
    if len(data) > max_bytes:
        raise JsonRefused(f"{what} is {len(data)} bytes encoded, more than the limit of {max_bytes} bytes")
    try:
        check_json(value, max_depth)  # what orjson takes but msgpack, or the depth bound, does not
    except JsonRefused as exc:
        raise JsonRefused(f"{what}: {exc}") from exc
    return data
