"""The payload boundary: plain JSON values, validated and canonically encoded (pure).

Everything stored in the log passes through :func:`encode_payload`. It accepts only plain
JSON values (``None``, ``bool``, ``int`` in the signed 64-bit range, finite ``float``,
``str``, ``list``/``tuple`` and ``dict`` with ``str`` keys) and refuses, with the JSON path of
the offending value, what PostgreSQL or a JSON reader would choke on later (RELIABILITY.md
P16-P22): NaN and infinities (orjson would silently turn them into ``null``), the NUL
character (jsonb rejects ``\\u0000``), lone surrogates, nesting deeper than
:data:`limits.payload_depth_max`, and encodings over the size limit.

The encoding is orjson with sorted keys. The bytes it returns are the bytes that are
stored (``bytea``) and hashed; they are never re-encoded by another codec, so the chain
hash can always be recomputed from the row.
"""

from __future__ import annotations

import math
from typing import Any, Final

import orjson

from wal_engine import limits
from wal_engine.errors import InvalidPayload, PayloadTooLarge

_int_min: Final = -(2**63)
_int_max: Final = 2**63 - 1
_encode_options: Final = orjson.OPT_SORT_KEYS


def validate_json_value(value: Any, path: str = "$", depth: int = 0) -> None:
    """Raise :class:`InvalidPayload` unless ``value`` is a storable plain JSON value."""
    problem = _problem(value, depth)
    if problem is not None:
        steps, reason = problem
        raise InvalidPayload(path + "".join(reversed(steps)), reason)


Problem = tuple[list[str], str]
"""Where a value is not storable (path steps, innermost first) and why."""


def _problem(value: Any, depth: int) -> Problem | None:
    """The first reason ``value`` cannot be stored, or None. The walk of every append: it
    builds the JSON path only on the way out of a failure."""
    kind = type(value)
    if kind is str:
        reason = _text_problem(value)
        return None if reason is None else ([], reason)
    if value is None or value is True or value is False:
        return None
    if kind is int:
        return None if _int_min <= value <= _int_max else (
            [], "integer outside the signed 64-bit range")
    if kind is float:
        return None if math.isfinite(value) else ([], f"{value!r} is not a JSON number")
    if kind is dict or kind is list or kind is tuple:
        if depth >= limits.payload_depth_max:
            return [], f"nested deeper than {limits.payload_depth_max} levels"
        is_dict = kind is dict
        for key, item in value.items() if is_dict else enumerate(value):
            if is_dict:
                if type(key) is not str:
                    return [], f"object key {key!r} is not a string"
                if "\x00" in key or not key.isascii():
                    reason = _text_problem(key)
                    if reason is not None:
                        return [], reason
            # The common leaves (plain ASCII text without NUL, None, booleans) are checked
            # here rather than in a call per value.
            if type(item) is str:
                if item.isascii() and "\x00" not in item:
                    continue
            elif item is None or item is True or item is False:
                continue
            found = _problem(item, depth + 1)
            if found is not None:
                found[0].append(f".{key}" if is_dict else f"[{key}]")
                return found
        return None
    return [], f"{kind.__name__} is not a plain JSON value"


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "contains the NUL character, which PostgreSQL cannot store"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "contains a lone surrogate (not valid UTF-8)"
    return None


def encode_payload(value: Any, *, payload_bytes_max: int = limits.payload_bytes_max) -> bytes:
    """Validate ``value`` and return its canonical JSON bytes (sorted keys, compact)."""
    validate_json_value(value)
    encoded = orjson.dumps(value, option=_encode_options)
    if len(encoded) > payload_bytes_max:
        raise PayloadTooLarge(len(encoded), payload_bytes_max)
    return encoded


def decode_payload(encoded: bytes) -> Any:
    """Decode stored payload bytes into plain JSON values."""
    return orjson.loads(encoded)
