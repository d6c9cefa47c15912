"""Every event type round-trips through the stored encoding."""

from __future__ import annotations

from hypothesis import given

from tests.property.event_strategies import any_event
from wal_engine import events


@given(any_event)
def test_every_event_round_trips(event: events.Event) -> None:
    """encode_event then decode_event gives back an equal event, with stable bytes."""
    kind, version, payload = events.encode_event(event)
    decoded = events.decode_event(kind, version, payload)
    assert decoded == event
    assert events.encode_event(decoded) == (kind, version, payload)
