"""B10: redaction takes time linear in the text on hostile input (repetitions of what every
default pattern starts with), and an oversized value is refused before any regex runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wal_engine import events as ev
from wal_engine.errors import PayloadTooLarge
from wal_engine.security.redaction import (
    DEFAULT_PATTERNS,
    DefaultRedactor,
    check_size,
    redact_bounded,
    redact_event,
)
from wal_engine.testing.hostile_text import (
    KIB,
    SHAPED_UNITS,
    hostile_text,
    hostile_units,
    linearity_violation,
)

UNITS = hostile_units(DEFAULT_PATTERNS)
REDACTOR = DefaultRedactor()


# Each example times up to 1.3 MiB of redaction three times over: a few dozen draws keep
# the test to seconds. Two or three units glued together mix the shapes.
@settings(max_examples=24)
@given(st.lists(st.one_of(st.sampled_from(SHAPED_UNITS), st.sampled_from(UNITS)),
                min_size=1, max_size=3).map("".join))
def test_redaction_time_grows_linearly_on_hostile_text(unit: str) -> None:
    """Text 4x longer takes under 8x the CPU time (linear gives 4x, quadratic 16x)."""
    assert linearity_violation(REDACTOR.redact_text, unit) is None


@pytest.mark.parametrize("unit", SHAPED_UNITS)
def test_each_shaped_unit_is_redacted_in_linear_time(unit: str) -> None:
    """The units that once took quadratic time (unterminated PEM, JWT prefixes, URL
    schemes, assignments) stay linear, each one checked, not only the drawn ones."""
    assert linearity_violation(REDACTOR.redact_text, unit,
                               sizes=(16 * KIB, 64 * KIB, 256 * KIB)) is None


def test_the_walk_over_values_is_linear_too() -> None:
    """A JSON value holding hostile strings under keys and in lists costs what its text does."""
    def walk(text: str) -> object:
        return REDACTOR({"result": [text[: len(text) // 2], {"body": text[len(text) // 2:]}]})

    assert linearity_violation(walk, "eyJ-") is None
    assert linearity_violation(walk, "-----BEGIN PRIVATE KEY-----") is None


def test_oversized_values_are_refused_before_any_regex() -> None:
    """A value that cannot fit in the payload limit raises PayloadTooLarge without calling
    the redactor at all."""
    calls: list[object] = []

    def redactor(value: object) -> object:
        calls.append(value)
        return value

    huge = {"page": hostile_text("eyJ-", 2 * 1024 * KIB)}
    with pytest.raises(PayloadTooLarge):
        redact_bounded(redactor, huge, 1024 * KIB)
    with pytest.raises(PayloadTooLarge):
        redact_event(ev.ToolCallCompleted(call_id="c", result=huge), redactor,
                     bytes_max=1024 * KIB)
    assert calls == []
    small = {"page": "fine"}
    assert redact_bounded(redactor, small, 1024 * KIB) is small
    assert calls == [small]


def test_size_check_is_a_lower_bound_of_the_encoding() -> None:
    """The count never exceeds the encoded size, so nothing storable is refused."""
    import orjson

    value = {"a": ["é" * 10, 1, None, {"k": "v" * 100}], "b": 2.5}
    assert check_size(value, None) == 0
    assert check_size(value, 10**9) <= len(orjson.dumps(value))


def test_the_check_finds_a_quadratic_pattern_and_confirms_before_it_says_so() -> None:
    """The check can fail: a pattern that scans the rest of the text from every start is
    reported (it stays over the bound when timed again), and a linear one is not."""
    import re

    quadratic = re.compile(r"eyJ[\w-]*\.")
    linear = re.compile(r"eyJ[\w-]{1,8}\.")
    sizes = (2 * KIB, 8 * KIB, 32 * KIB)
    found = linearity_violation(quadratic.findall, "eyJ-", sizes=sizes, floor_s=0.0005)
    assert found is not None and found.startswith("'eyJ-': ")
    assert linearity_violation(linear.findall, "eyJ-", sizes=sizes) is None
