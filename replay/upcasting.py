"""Event upcasting: lift a stored payload of an old schema version to the current one (pure).

Every stored event carries its type's ``VERSION`` at the time it was written. When a type's
meaning or field types change, its ``VERSION`` is bumped and an upcaster is registered here
for the old version: a pure function from the old payload (a dict of plain JSON values) to
the payload of the next version. Reading a row of version n applies the upcasters n -> n+1
-> ... -> current, one step at a time, then decodes into the event class. A version with no
path to the current one (a gap in the chain, or a version newer than this code) fails closed
with :class:`~wal_engine.errors.UnknownEventVersion` naming the type and the version.

Upcasters are data migrations of *reads* only: the stored bytes (and their chain hashes)
never change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec

from wal_engine.errors import UndecodableEvent, UnknownEventType, UnknownEventVersion
from wal_engine.events import EVENT_TYPES, Event, decode_event

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""Lifts one payload from version n to n + 1."""

_upcast_steps_max: Final = 1000
"""Longest upcaster chain followed (a bound on the loop; real chains are a few steps)."""


class UpcasterRegistry:
    """Upcasters by ``(event type, from version)``."""

    def __init__(self) -> None:
        self._steps: dict[tuple[str, int], Upcaster] = {}

    def register(self, event_type: str, from_version: int, upcaster: Upcaster) -> None:
        """Register the function that lifts ``event_type`` from ``from_version`` to the next.

        Raises:
            UnknownEventType: ``event_type`` is not in the vocabulary.
            ValueError: ``from_version`` is not below the current version, or is taken.
        """
        cls = EVENT_TYPES.get(event_type)
        if cls is None:
            raise UnknownEventType(event_type)
        if not 1 <= from_version < cls.VERSION:
            raise ValueError(
                f"{event_type}: cannot upcast from version {from_version}; "
                f"the current version is {cls.VERSION}"
            )
        if (event_type, from_version) in self._steps:
            raise ValueError(f"{event_type}: an upcaster from version {from_version} exists")
        self._steps[(event_type, from_version)] = upcaster

    def missing_steps(self) -> list[tuple[str, int]]:
        """``(event type, from version)`` of every older version of the vocabulary's types
        with no upcaster: rows of that version would fail to read. Bumping a type's
        ``VERSION`` without registering the step shows here (a test keeps it empty)."""
        return [(event_type, version) for event_type, cls in sorted(EVENT_TYPES.items())
                for version in range(1, cls.VERSION) if (event_type, version) not in self._steps]

    def upcaster(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Decorator form of :meth:`register`."""

        def decorate(function: Upcaster) -> Upcaster:
            self.register(event_type, from_version, function)
            return function

        return decorate

    def lift(
        self, event_type: str, version: int, payload: dict[str, Any], seq: int | None = None
    ) -> dict[str, Any]:
        """Apply the upcasters from ``version`` up to the type's current version."""
        cls = EVENT_TYPES.get(event_type)
        if cls is None:
            raise UnknownEventType(event_type, seq)
        current = version
        for _ in range(_upcast_steps_max):
            if current == cls.VERSION:
                return payload
            step = self._steps.get((event_type, current))
            if step is None:
                raise UnknownEventVersion(event_type, version, cls.VERSION, seq)
            payload = step(payload)
            if not isinstance(payload, dict):
                raise UndecodableEvent(
                    event_type, seq, f"upcaster from version {current} returned no object"
                )
            current += 1
        raise UnknownEventVersion(event_type, version, cls.VERSION, seq)

    def decode_record(
        self, event_type: str, version: int, payload: bytes, seq: int | None = None
    ) -> Event:
        """Decode a stored row, upcasting it first when its version is an old one."""
        cls = EVENT_TYPES.get(event_type)
        if cls is not None and version == cls.VERSION:
            return decode_event(event_type, version, payload, seq)
        if cls is None:
            raise UnknownEventType(event_type, seq)
        try:
            fields = msgspec.json.decode(payload)
        except msgspec.DecodeError as error:
            raise UndecodableEvent(event_type, seq, str(error)) from error
        if not isinstance(fields, dict):
            raise UndecodableEvent(event_type, seq, "payload is not a JSON object")
        lifted = self.lift(event_type, version, fields, seq)
        return decode_event(event_type, cls.VERSION, lifted, seq)


upcasters: Final = UpcasterRegistry()
"""The registry the engine reads with. Register upcasters at import of the vocabulary."""


def decode_record(
    event_type: str,
    version: int,
    payload: bytes,
    seq: int | None = None,
    *,
    registry: UpcasterRegistry = upcasters,
) -> Event:
    """Decode a stored event row through ``registry`` (the engine's by default).

    Raises:
        UnknownEventType: the type is not in the vocabulary.
        UnknownEventVersion: no chain of upcasters leads from ``version`` to the current one.
        UndecodableEvent: the payload does not decode into the event.
    """
    return registry.decode_record(event_type, version, payload, seq)
