"""The one place where PostgreSQL errors become wal-engine exceptions, keyed by SQLSTATE."""

from __future__ import annotations

from typing import Final

import asyncpg

from wal_engine.errors import (
    AppendOnlyViolation,
    CapExceeded,
    IllegalTransition,
    InvalidInput,
    TaskQuotaExceeded,
    UnknownTask,
    WalError,
)

ILLEGAL_TRANSITION: Final = "WE001"
APPEND_ONLY: Final = "WE002"
HEAD_REGRESSED: Final = "WE003"
UNKNOWN_TASK: Final = "WE004"
TASK_QUOTA: Final = "WE005"
CAP_EXCEEDED: Final = "WE008"
CHECK_VIOLATION: Final = "23514"
EVENT_BOUNDS: Final = "wal_events_bounds"
"""The CHECK on the log's seq, epoch and payload size (schema.sql, issue 16 section)."""
"""Builtin codes the engine reacts to."""

_input_codes: Final = frozenset(
    {
        CHECK_VIOLATION,
        "22P02",  # invalid_text_representation
        "22P05",  # untranslatable_character
        "22021",  # character_not_in_repertoire
        "54001",  # statement_too_complex
        "22003",  # numeric_value_out_of_range
        "22008",  # datetime_field_overflow
        "22023",  # invalid_parameter_value: the engine's functions refusing an argument
    }
)


def translate(error: asyncpg.PostgresError, task_id: str | None = None) -> WalError | None:
    """Return the wal-engine exception for ``error``, or None if it is not an engine error.

    WE001 carries the moved-from status in the COLUMN field and the moved-to status in the
    CONSTRAINT field, so nothing here parses a message.
    """
    code = error.sqlstate
    if code == ILLEGAL_TRANSITION:
        return IllegalTransition(
            task_id, str(error.column_name or "?"), str(error.constraint_name or "?")
        )
    if code == APPEND_ONLY:
        return AppendOnlyViolation(str(error))
    if code == HEAD_REGRESSED:
        return IllegalTransition(task_id, "terminal or regressed head", "append")
    if code == UNKNOWN_TASK:
        return UnknownTask(task_id or "?")
    if code == TASK_QUOTA:
        detail = str(error.detail or "")
        return TaskQuotaExceeded(None, int(detail) if detail.isdigit() else None)
    if code == CAP_EXCEEDED:
        return CapExceeded(str(error.detail or "cap"), str(error))
    if code == CHECK_VIOLATION and error.constraint_name == EVENT_BOUNDS:
        return CapExceeded("event_bounds", str(error))
    if code in _input_codes:
        return InvalidInput(f"rejected by PostgreSQL ({code}): {error}")
    return None
