"""The ``Idempotency-Key`` header (draft-ietf-httpapi-idempotency-key-header) and the
request fingerprint.

The draft makes the header an Item Structured Header holding a String (RFC 8941):
``Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"``. Many clients send the value
bare, so a bare token of visible ASCII (no quotes, commas, semicolons, backslashes or
spaces) is accepted too; anything else is a :class:`MalformedKey` (400).
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from wal_engine.errors import MalformedKey as MalformedKey

HEADER: Final = "idempotency-key"
_QUOTED: Final = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\\"])*)"')
_BARE: Final = re.compile(r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]+")
_ESCAPE: Final = re.compile(r"\\([\\\"])")


def parse_key(values: list[str], chars_max: int) -> str | None:
    """The key in the request's ``Idempotency-Key`` header values, None when absent."""
    if not values:
        return None
    if len(values) > 1:
        raise MalformedKey("must be sent once")
    value = values[0].strip(" \t")
    quoted = _QUOTED.fullmatch(value)
    if quoted is not None:
        key = _ESCAPE.sub(r"\1", quoted.group(1))
    elif _BARE.fullmatch(value):
        key = value
    else:
        raise MalformedKey('must be a quoted string ("...") of printable ASCII, or a bare '
                           "token without spaces, quotes, commas or semicolons")
    if not key:
        raise MalformedKey("must not be empty")
    if len(key) > chars_max:
        raise MalformedKey(f"is {len(key)} characters; at most {chars_max} are accepted")
    return key


def format_key(key: str) -> str:
    """``key`` as the header value the draft specifies (a quoted sf-string)."""
    if not key or any(not 0x20 <= ord(char) <= 0x7E for char in key):
        raise MalformedKey("must be non-empty printable ASCII to be sent")
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def fingerprint(method: str, target: str, content_type: str, body: bytes) -> str:
    """What makes two requests under one key "the same request": method, path and query,
    content type and body (SHA-256, hex)."""
    digest = hashlib.sha256()
    for part in (method.encode(), target.encode(), content_type.encode()):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    digest.update(body)
    return digest.hexdigest()


def scope_digest(value: str | None) -> str:
    """A short, fixed-size stand-in for a scoping header's value (never stored in clear)."""
    if value is None:
        return "-"
    return hashlib.sha256(value.encode()).hexdigest()[:24]
