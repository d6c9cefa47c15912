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
    if not _storable(value, depth):
        _explain(value, path, depth)  # Raises, naming the JSON path of the first bad value.
        raise InvalidPayload(path, "not a storable plain JSON value")


def _storable(value: Any, depth: int) -> bool:
    """Whether ``value`` is storable: the walk of every append, so it builds no paths."""
    kind = type(value)
    if kind is str:
        return "\x00" not in value and (value.isascii() or _utf8(value))
    if value is None or value is True or value is False:
        return True
    if kind is int:
        return bool(_int_min <= value <= _int_max)
    if kind is float:
        return math.isfinite(value)
    if kind is dict:
        if depth >= limits.payload_depth_max:
            return False
        for key, item in value.items():
            if type(key) is not str or "\x00" in key or not (key.isascii() or _utf8(key)):
                return False
            if not _storable(item, depth + 1):
                return False
        return True
    if kind is list or kind is tuple:
        if depth >= limits.payload_depth_max:
            return False
        for item in value:
            if not _storable(item, depth + 1):
                return False
        return True
    return False


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _explain(value: Any, path: str = "$", depth: int = 0) -> None:
    """The slow walk, taken only for a value :func:`_storable` refused: raise with its path."""
    if value is None or value is True or value is False:
        return
    kind = type(value)
    if kind is str:
        _check_text(value, path)
    elif kind is int:
        if not _int_min <= value <= _int_max:
            raise InvalidPayload(path, "integer outside the signed 64-bit range")
    elif kind is float:
        if not math.isfinite(value):
            raise InvalidPayload(path, f"{value!r} is not a JSON number")
    elif kind is list or kind is tuple:
        _check_depth(path, depth)
        for index, item in enumerate(value):
            _explain(item, f"{path}[{index}]", depth + 1)
    elif kind is dict:
        _check_depth(path, depth)
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidPayload(path, f"object key {key!r} is not a string")
            _check_text(key, path)
            _explain(item, f"{path}.{key}", depth + 1)
    else:
        raise InvalidPayload(path, f"{kind.__name__} is not a plain JSON value")


def _check_depth(path: str, depth: int) -> None:
    if depth >= limits.payload_depth_max:
        raise InvalidPayload(path, f"nested deeper than {limits.payload_depth_max} levels")


def _check_text(text: str, path: str) -> None:
    if "\x00" in text:
        raise InvalidPayload(path, "contains the NUL character, which PostgreSQL cannot store")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidPayload(path, "contains a lone surrogate (not valid UTF-8)") from error


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
