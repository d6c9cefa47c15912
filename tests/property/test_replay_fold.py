"""Properties of the fold over generated valid histories: splits, snapshots, determinism."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay import StateBuilder, apply, decode_state, encode_state, fold, initial_state
from replay import snapshot as snapshot_module
from replay.snapshot import SnapshotSegments, decode_snapshot, encode_snapshot
from tests.property.event_strategies import any_event
from tests.strategies import chained, histories
from wal_engine import events as ev
from wal_engine.errors import ReplayError

TASK = "task-1"


class Row(msgspec.Struct, frozen=True):
    """A stored row, as the store would return it."""

    seq: int
    type: str
    version: int
    payload: bytes
    hash: bytes


def rows_of(history: list[tuple[int, ev.Event]]) -> list[Row]:
    """Encode a history into stored rows with their chain hashes."""
    return [Row(seq, *ev.encode_event(event), digest)
            for seq, event, digest in chained(TASK, history)]


@given(histories(), st.data())
def test_fold_equals_fold_of_tail_onto_fold_of_head(
    history: list[tuple[int, ev.Event]], data: st.DataObject
) -> None:
    """For any split k: fold(E) == fold(E[k:], start=fold(E[:k])), also via a snapshot."""
    items = chained(TASK, history)
    k = data.draw(st.integers(0, len(items)), label="k")
    whole = fold(items, task_id=TASK)
    head = fold(items[:k], task_id=TASK)
    assert fold(items[k:], start=head) == whole
    restored = decode_state(encode_state(head))
    assert restored == head
    resumed = fold(items[k:], start=restored)
    assert resumed == whole
    assert encode_state(resumed) == encode_state(whole)


@given(histories(), st.integers(1, 3), st.data())
def test_segmented_snapshot_round_trip_equals_the_fold(
    history: list[tuple[int, ev.Event]], size: int, data: st.DataObject
) -> None:
    """With tiny segments: any prefix's snapshot assembles to its fold, byte-identically,
    and a writer that stored the previous snapshot sends only segments that changed."""
    items = chained(TASK, history)
    k = data.draw(st.integers(0, len(items)), label="k")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(snapshot_module, "segment_items", size)
        head, whole = fold(items[:k], task_id=TASK), fold(items, task_id=TASK)
        writer = SnapshotSegments()
        first = writer.encode(head)
        writer.stored_as(first)
        restored = decode_snapshot(first.head, first.new)
        assert restored == head and list(restored.calls) == list(head.calls)
        assert encode_snapshot(restored) == encode_snapshot(head) == first
        resumed = fold(items[k:], start=restored)
        assert resumed == whole
        second = writer.encode(resumed)
        assert second == msgspec.structs.replace(encode_snapshot(whole), new=second.new)
        changed = {ref.digest for ref in second.refs} - {ref.digest for ref in first.refs}
        assert {segment.digest for segment in second.new} == changed
        stored = {segment.digest: segment for segment in [*first.new, *second.new]}
        assert decode_snapshot(second.head, stored.values()) == whole


@given(histories())
def test_fold_is_deterministic_to_the_byte(history: list[tuple[int, ev.Event]]) -> None:
    """Folding the same events twice gives byte-identical snapshots."""
    assert encode_state(fold(history, task_id=TASK)) == encode_state(fold(history, task_id=TASK))


@given(histories())
def test_stored_rows_fold_like_the_events(history: list[tuple[int, ev.Event]]) -> None:
    """Folding encoded rows (decoded on the way) equals folding the events themselves."""
    from_rows = fold(rows_of(history), task_id=TASK)
    assert from_rows == fold(chained(TASK, history), task_id=TASK)
    assert from_rows.last_hash == chained(TASK, history)[-1][2]


@given(histories(max_events=25))
def test_apply_and_builder_agree_with_fold(history: list[tuple[int, ev.Event]]) -> None:
    """apply step by step and a StateBuilder both reach the fold's state."""
    state = initial_state(TASK)
    builder = StateBuilder(task_id=TASK)
    for seq, event in history:
        state = apply(state, event, seq=seq)
        builder.apply(event, seq=seq)
    assert state == builder.state() == fold(history, task_id=TASK)


@given(histories(), st.data())
def test_a_missing_event_is_a_gap(history: list[tuple[int, ev.Event]], data: st.DataObject) -> None:
    """Dropping any event but the last leaves a gap that is refused at the next seq."""
    if len(history) < 2:
        return
    index = data.draw(st.integers(0, len(history) - 2), label="dropped")
    with_gap = history[:index] + history[index + 1:]
    try:
        fold(with_gap, task_id=TASK)
    except ReplayError as error:
        assert error.seq == index + 2
    else:
        raise AssertionError("a gap folded without error")


@given(histories(), any_event)
def test_fold_is_total(history: list[tuple[int, ev.Event]], event: ev.Event) -> None:
    """Any event of the vocabulary after any history folds or raises ReplayError, nothing else."""
    state = fold(history, task_id=TASK)
    try:
        after = apply(state, event)
    except ReplayError as error:
        assert error.seq == state.last_seq + 1
    else:
        assert after.last_seq == state.last_seq + 1 and not state.terminal


@given(histories(), any_event)
def test_nothing_follows_a_terminal_status(
    history: list[tuple[int, ev.Event]], event: ev.Event
) -> None:
    """Once a history is terminal, every further event is refused."""
    state = fold(history, task_id=TASK)
    if not state.terminal:
        return
    try:
        apply(state, event)
    except ReplayError as error:
        assert "terminal" in error.reason
    else:
        raise AssertionError("an event folded after a terminal status")
