"""Upcasting: stored payloads of old versions are lifted step by step to the current one."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from replay import UpcasterRegistry, decode_record, fold
from wal_engine import events as ev
from wal_engine.errors import UndecodableEvent, UnknownEventType, UnknownEventVersion


class Row(msgspec.Struct, frozen=True):
    """A stored row as the fold reads it."""

    seq: int
    type: str
    version: int
    payload: bytes
    hash: bytes = b""


@pytest.fixture
def message_v3(monkeypatch: pytest.MonkeyPatch) -> UpcasterRegistry:
    """Pretend message_appended is at version 3, with upcasters from versions 1 and 2.

    Version 1 stored the text under ``text``; version 2 renamed it ``body``; version 3 (the
    "current" one) calls it ``content`` and adds the role.
    """
    monkeypatch.setattr(ev.MessageAppended, "VERSION", 3)
    registry = UpcasterRegistry()

    @registry.upcaster("message_appended", 1)
    def _v1(payload: dict[str, Any]) -> dict[str, Any]:
        return {"body": payload["text"]}

    @registry.upcaster("message_appended", 2)
    def _v2(payload: dict[str, Any]) -> dict[str, Any]:
        return {"role": "user", "content": payload["body"]}

    return registry


def test_old_versions_are_lifted_step_by_step(message_v3: UpcasterRegistry) -> None:
    """A version-1 payload passes through both upcasters and decodes as the current event."""
    event = decode_record("message_appended", 1, b'{"text":"hi"}', 5, registry=message_v3)
    assert event == ev.MessageAppended(role="user", content="hi")
    event = decode_record("message_appended", 2, b'{"body":"yo"}', 5, registry=message_v3)
    assert event == ev.MessageAppended(role="user", content="yo")


def test_current_version_skips_upcasters(message_v3: UpcasterRegistry) -> None:
    """A row already at the current version decodes directly."""
    event = decode_record("message_appended", 3, b'{"role":"ai","content":"x"}',
                          registry=message_v3)
    assert event == ev.MessageAppended(role="ai", content="x")


def test_version_without_a_path_names_type_and_version(message_v3: UpcasterRegistry) -> None:
    """A version with no upcaster chain (or from the future) fails closed, naming both."""
    with pytest.raises(UnknownEventVersion) as caught:
        decode_record("message_appended", 4, b"{}", 9, registry=message_v3)
    assert (caught.value.event_type, caught.value.version, caught.value.seq) == (
        "message_appended", 4, 9)
    assert "'message_appended' version 4" in str(caught.value)
    with pytest.raises(UnknownEventVersion):
        decode_record("message_appended", 1, b'{"text":"x"}')  # the engine's registry is empty


def test_fold_reads_old_rows_through_the_registry(message_v3: UpcasterRegistry) -> None:
    """Folding stored rows upcasts old versions, so an old log stays replayable."""
    rows = [
        Row(1, *ev.encode_event(ev.TaskSubmitted(agent="a"))),
        Row(2, *ev.encode_event(ev.TaskClaimed(worker_id="w"))),
        Row(3, "message_appended", 1, b'{"text":"old"}'),
    ]
    state = fold(rows, task_id="t", registry=message_v3)
    assert [m.content for m in state.messages] == ["old"]


def test_registration_is_checked(message_v3: UpcasterRegistry) -> None:
    """Unknown types, impossible versions and duplicates cannot be registered."""
    with pytest.raises(UnknownEventType):
        message_v3.register("no_such_event", 1, dict)
    with pytest.raises(ValueError, match="current version is 3"):
        message_v3.register("message_appended", 3, dict)
    with pytest.raises(ValueError, match="exists"):
        message_v3.register("message_appended", 1, dict)


def test_bad_payloads_are_undecodable(message_v3: UpcasterRegistry) -> None:
    """A payload that is not a JSON object, or an upcaster returning junk, is refused."""
    with pytest.raises(UndecodableEvent):
        decode_record("message_appended", 1, b"[1]", registry=message_v3)
    with pytest.raises(UndecodableEvent):
        decode_record("message_appended", 1, b"{not json", registry=message_v3)
    with pytest.raises(UnknownEventType):
        decode_record("no_such_event", 1, b"{}", registry=message_v3)
