"""The payload boundary refuses what PostgreSQL or a JSON reader cannot store."""

from __future__ import annotations

import math

import pytest

from wal_engine.errors import InvalidPayload, PayloadTooLarge
from wal_engine.payloads import decode_payload, encode_payload


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (math.nan, "$"),
        ({"a": [1, math.inf]}, "$.a[1]"),
        ({"x": -math.inf}, "$.x"),
        ("nul\x00inside", "$"),
        ({"k\x00": 1}, "$"),
        ("\ud800", "$"),
        ({"a": object()}, "$.a"),
        ({1: "int key"}, "$"),
        (2**70, "$"),
        (b"bytes", "$"),
        ({1.5}, "$"),
    ],
)
def test_unstorable_values_are_refused_with_their_path(value: object, path: str) -> None:
    """Each unstorable value raises InvalidPayload naming where it is."""
    with pytest.raises(InvalidPayload) as caught:
        encode_payload(value)
    assert caught.value.path == path


def test_deep_nesting_is_refused() -> None:
    """JSON nested past the depth limit is refused before PostgreSQL's stack limit."""
    value: object = 1
    for _ in range(20_000):
        value = [value]
    with pytest.raises(InvalidPayload, match="nested deeper"):
        encode_payload(value)


def test_size_limit_is_enforced() -> None:
    """An encoding over the limit raises PayloadTooLarge with both sizes."""
    with pytest.raises(PayloadTooLarge) as caught:
        encode_payload("x" * 100, payload_bytes_max=50)
    assert caught.value.limit_bytes == 50
    assert caught.value.size_bytes == 102


def test_encoding_is_canonical() -> None:
    """Key order does not change the bytes; values round-trip."""
    first = encode_payload({"b": 1, "a": [1.5, "é", None, True]})
    second = encode_payload({"a": [1.5, "é", None, True], "b": 1})
    assert first == second == '{"a":[1.5,"é",null,true],"b":1}'.encode()
    assert decode_payload(first) == {"a": [1.5, "é", None, True], "b": 1}
