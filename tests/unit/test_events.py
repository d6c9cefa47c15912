"""The event vocabulary: closed, versioned, fails closed on what it does not know."""

from __future__ import annotations

import pytest

from wal_engine import events
from wal_engine.errors import UndecodableEvent, UnknownEventType, UnknownEventVersion


def test_vocabulary_covers_the_issue_list() -> None:
    """Every transition and observation named by the design has an event type."""
    required = {
        "task_submitted", "task_claimed", "step_checkpointed", "tool_call_intended",
        "tool_call_completed", "tool_call_failed", "llm_call_intended", "llm_call_completed",
        "message_appended", "timer_started", "timer_fired", "signal_awaited",
        "signal_received", "task_orphaned", "task_resumed", "budget_exceeded",
        "task_forked", "task_completed", "task_failed", "task_cancelled",
    }
    assert required <= set(events.EVENT_TYPES)


def test_tags_are_past_tense_snake_case() -> None:
    """Tags are stable snake_case identifiers that fit the schema's CHECK."""
    for tag in events.EVENT_TYPES:
        assert tag.islower() and " " not in tag and len(tag) <= 64


def test_unknown_type_fails_closed() -> None:
    """A type outside the closed union is an error naming it, never skipped."""
    with pytest.raises(UnknownEventType, match="x-unknown"):
        events.decode_event("x-unknown", 1, b"{}", seq=7)


def test_unknown_version_fails_closed() -> None:
    """A future version is an error naming type and version."""
    with pytest.raises(UnknownEventVersion) as caught:
        events.decode_event("task_completed", 99, b"{}", seq=3)
    assert (caught.value.event_type, caught.value.version, caught.value.seq) == (
        "task_completed", 99, 3)


def test_wrong_shape_is_undecodable() -> None:
    """A payload of the wrong shape raises UndecodableEvent, not a bare msgspec error."""
    with pytest.raises(UndecodableEvent):
        events.decode_event("task_failed", 1, b'{"reason": 5}', seq=2)


def test_target_status_of_transitions() -> None:
    """Transition events name the status they move to; observations name none."""
    assert events.target_status("task_submitted") == "QUEUED"
    assert events.target_status("task_completed") == "COMPLETED"
    assert events.target_status("tool_call_intended") is None
