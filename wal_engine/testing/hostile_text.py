"""Hostile texts for redaction patterns, and a check that redaction time grows linearly.

Tool results and signal payloads are attacker-controlled text, and redaction runs every
credential pattern over them on the worker's event loop. A regex that backtracks over the
rest of the text from each of its possible starts takes time quadratic in the text: a
128 KiB run of ``"eyJ-"`` once held a worker's loop for 20 s (RELIABILITY.md B10). The
inputs that expose this are repetitions of what a pattern starts with, glued to a
character of its body or to one that ends it, so that every position is a start and no
match completes.

:func:`hostile_units` derives such units from patterns (their triggers, each followed by
one of a set of characters, plus units written for the shapes that hurt regexes most: an
unterminated PEM header, a JWT prefix, URL schemes, assignments); :func:`hostile_text`
repeats one to a size; :func:`linearity_violation` times a redaction over sizes that
grow fourfold and says where the time grew much faster than the size. Use them to check
``DefaultRedactor(extra_patterns=...)`` formats of your own::

    units = hostile_units(my_patterns)
    assert all(linearity_violation(redactor.redact_text, u) is None for u in units)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Final, Protocol

KIB: Final = 1024

UNIT_SUFFIXES: Final = ("", "-", "a", "A", "0", "_", "=", " ", ".", ":", "/", "@", "\n")
"""What follows a trigger in a unit: nothing, a body character, or a terminator."""

SHAPED_UNITS: Final = (
    "eyJ-", "eyJa.", "eyJaaaaa.", "eyJaaaaa.eyJaaaaa.",
    "-----BEGIN PRIVATE KEY-----", "-----BEGIN RSA ", "-----BEGIN ", "-----END ",
    "a.", "a-", "a://", "a://b:", "a://b:c", "a://b:c/", "x:y@", "a@", "a:",
    "bearer ", "Bearer a", "Bearer a.", "authorization: basic ", "Authorization: ",
    "password=", "password ", "password: ", "token= ", "token=token", "key:", "key=\"",
    "\"password\": \"", "DB_PASSWORD=", "x_secret_", "Cookie: a=", "ghp_" + "a" * 40,
    "AKIA", "AccountKey=", "xoxb-", "sk-", "GOCSPX-", "\\\"", "'", "\"",
)
"""Units for the shapes that have been slow: unterminated blocks, runs that every
position of could start, separators with nothing after them."""

SIZES_BYTES: Final = (16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB)
"""Each four times the one before: linear time grows 4x a step, quadratic 16x."""


class HasTriggers(Protocol):
    """A pattern with trigger substrings (``redaction.CredentialPattern``)."""

    @property
    def triggers(self) -> tuple[str, ...]: ...


def hostile_units(patterns: Iterable[HasTriggers]) -> tuple[str, ...]:
    """Units to repeat: every trigger of ``patterns`` with each suffix, then the shaped
    units (in a stable order, without duplicates)."""
    units = [trigger + suffix for pattern in patterns for trigger in pattern.triggers
             for suffix in UNIT_SUFFIXES]
    return tuple(dict.fromkeys([*units, *SHAPED_UNITS]))


GATE_OPENER: Final = " A J 0 . : = @ - _ :// "
"""Put at the end of every hostile text: it holds the characters that the quick tests of
the default formats require (``CredentialPattern.requires``) and a URL's ``://``, so that
every format's regex really runs over the text (a run of ``"eyJ-"`` alone lacks the ``.``
a JWT needs)."""


def hostile_text(unit: str, size: int) -> str:
    """``unit`` repeated, then :data:`GATE_OPENER`: exactly ``size`` characters."""
    body = size - len(GATE_OPENER)
    return (unit * (body // len(unit) + 1))[:body] + GATE_OPENER


def cpu_time_s(function: Callable[[str], object], text: str, repeats: int = 3) -> float:
    """The least CPU time of ``repeats`` calls of ``function(text)`` (CPU time, and the
    least of a few, so that neighbours on a shared machine barely move it)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        function(text)
        best = min(best, time.process_time() - started)
    return best


def linearity_violation(
    function: Callable[[str], object],
    unit: str,
    *,
    sizes: tuple[int, ...] = SIZES_BYTES,
    factor: float = 8.0,
    floor_s: float = 0.002,
    confirmations: int = 2,
) -> str | None:
    """Where ``function`` (a redaction) stops being linear on ``unit`` repeated, or None.

    For each pair of consecutive sizes (each 4x the one before), the time of the larger
    must stay under ``factor`` x the time of the smaller, the smaller counted as at least
    ``floor_s`` (CPU timers are coarse, and below it noise dominates). Linear time gives
    4x, quadratic 16x: the default factor of 8 leaves room for noise both ways. A pair
    over the bound is timed again, both sizes, ``confirmations`` more times, and counts
    only if it stays over every time: on a shared machine a neighbour that evicts the
    caches can double one measurement, while a quadratic pattern is over on every one.
    Only the sizes up to the first that takes over a second are timed.
    """
    previous: tuple[int, float] | None = None
    for size in sizes:
        text = hostile_text(unit, size)
        elapsed = cpu_time_s(function, text)
        if previous is not None:
            violation = _growth_violation(unit, previous, (size, elapsed), factor, floor_s)
            for _ in range(confirmations):
                if violation is None:
                    break
                again = (previous[0],
                         cpu_time_s(function, hostile_text(unit, previous[0])))
                violation = _growth_violation(unit, again,
                                              (size, cpu_time_s(function, text)),
                                              factor, floor_s)
            if violation is not None:
                return violation
        if elapsed > 1.0:
            break
        previous = (size, elapsed)
    return None


def _growth_violation(unit: str, smaller: tuple[int, float], larger: tuple[int, float],
                      factor: float, floor_s: float) -> str | None:
    """The message when ``larger`` took over ``factor`` x (scaled to the growth) the
    time of ``smaller``, else None."""
    growth = larger[0] / smaller[0]
    allowed = factor * (growth / 4) * max(smaller[1], floor_s)
    if larger[1] <= allowed:
        return None
    return (f"{unit!r}: {smaller[0] // KIB} KiB took {smaller[1] * 1e3:.1f} ms,"
            f" {larger[0] // KIB} KiB took {larger[1] * 1e3:.1f} ms"
            f" (over {allowed * 1e3:.1f} ms)")
