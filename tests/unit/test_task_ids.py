"""Task ids minted by the engine are time-ordered (decision 70): their text sorts by the
millisecond they were minted at, so a month's tasks fall in that month's partition."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from wal_engine.errors import InvalidInput
from wal_engine.ids import new_task_id, validate_task_id


def test_a_minted_id_is_a_uuid7_whose_first_digits_are_its_millisecond() -> None:
    """``t-`` and 32 hex digits, a version-7 UUID, the first 12 digits the clock given."""
    moment = dt.datetime(2026, 12, 4, 10, 0, tzinfo=dt.UTC)
    millis = int(moment.timestamp() * 1000)
    task_id = new_task_id(millis)
    assert validate_task_id(task_id) == task_id and len(task_id) == 34
    assert task_id[2:14] == f"{millis:012x}"
    parsed = uuid.UUID(task_id[2:])
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122


def test_ids_sort_by_time_and_fall_inside_their_month() -> None:
    """An id minted later sorts after (by its text, as the partitions compare them); every
    id of a month lies in [its month's bound, the next month's bound)."""
    start = int(dt.datetime(2026, 11, 1, tzinfo=dt.UTC).timestamp() * 1000)
    end = int(dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp() * 1000)
    lower, upper = f"t-{start:012x}", f"t-{end:012x}"
    minted = [new_task_id(millis) for millis in (start, start + 1, end - 1)]
    assert minted == sorted(minted)
    assert all(lower <= task_id < upper for task_id in minted)
    assert not lower <= new_task_id(end) < upper
    assert len({new_task_id(start) for _ in range(1000)}) == 1000  # Random beyond the clock.


def test_a_clock_outside_48_bits_is_refused() -> None:
    """A negative or too large clock is bad input, not a malformed id."""
    for millis in (-1, 1 << 48):
        with pytest.raises(InvalidInput):
            new_task_id(millis)
    assert new_task_id().startswith("t-")
