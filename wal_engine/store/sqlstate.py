"""The one place where driver errors become wal-engine exceptions.

PostgreSQL errors are keyed by SQLSTATE (:func:`translate`); a lost or refused connection,
whatever raised it (the socket, asyncpg's client, a server shutting down), becomes
:class:`~wal_engine.errors.DatabaseUnavailable`, or :class:`~wal_engine.errors.ConnectionLost`
when a statement was in flight (:func:`translate_failure`). The original error is always
kept as ``__cause__``.
"""

from __future__ import annotations

from typing import Final

import asyncpg

from wal_engine.errors import (
    AppendOnlyViolation,
    CapExceeded,
    ConnectionLost,
    DatabaseError,
    DatabaseUnavailable,
    DuplicateRow,
    IllegalTransition,
    InvalidInput,
    RetentionRefused,
    TaskQuotaExceeded,
    UnknownLimiter,
    UnknownTask,
    WalError,
)

ILLEGAL_TRANSITION: Final = "WE001"
APPEND_ONLY: Final = "WE002"
HEAD_REGRESSED: Final = "WE003"
UNKNOWN_TASK: Final = "WE004"
TASK_QUOTA: Final = "WE005"
CAP_EXCEEDED: Final = "WE008"
UNKNOWN_LIMITER: Final = "WE240"
RETENTION_REFUSED: Final = "WE009"
CHECK_VIOLATION: Final = "23514"
UNIQUE_VIOLATION: Final = "23505"
EVENT_BOUNDS: Final = "wal_events_bounds"
"""The CHECK on the log's seq, epoch and payload size (schema.sql, issue 16 section)."""
"""Builtin codes the engine reacts to."""

TRANSIENT_SQLSTATES: Final = frozenset({
    "57014",  # query_canceled: statement_timeout
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "55P03",  # lock_not_available: lock_timeout
    "53000", "53100", "53200", "53300",  # insufficient resources: disk, memory, connections
})
"""Errors after which the statement was rolled back whole (nothing of it committed): a
statement of its own may run again; after the last attempt (or inside a caller's
transaction) it surfaces as :class:`DatabaseUnavailable`, which a task run treats as an
interruption, never as the agent's failure (RELIABILITY.md D5, D6, D8)."""

DISCONNECT_SQLSTATES: Final = frozenset({
    "57P01",  # admin_shutdown: the server is stopping, or the session was terminated
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now: starting up, or in recovery
})
"""Server errors that end the session (with class 08, connection_exception)."""

CLIENT_DISCONNECTS: Final = (
    # Raised on a pooled session the server terminated while asyncpg still thought a
    # statement was in progress ("cannot switch to state ...; another operation is in
    # progress", seen under pg_terminate_backend), and for target_session_attrs refusals
    # (TargetServerAttributeNotMatched) during a failover: the session is unusable.
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.InterfaceError,
    ConnectionError,
    OSError,
    TimeoutError,
)
"""Client-side errors of a session that is gone, refused, or did not answer in time."""


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is a statement rolled back whole that may simply run again."""
    return isinstance(error, asyncpg.PostgresError) and error.sqlstate in TRANSIENT_SQLSTATES


def is_disconnect(error: BaseException) -> bool:
    """Whether ``error`` says the session is lost, refused or unanswered (not a SQL error)."""
    if isinstance(error, asyncpg.PostgresError):
        code = str(error.sqlstate or "")
        return code.startswith("08") or code in DISCONNECT_SQLSTATES
    return isinstance(error, CLIENT_DISCONNECTS)


def translate_failure(error: BaseException, dsn_redacted: str, *, task_id: str | None = None,
                      sent: bool = True) -> WalError | None:
    """The wal-engine exception for any driver error, or None when it has none.

    A disconnect becomes :class:`ConnectionLost` (its ``sent`` says whether a statement was
    in flight, its outcome unknown, or nothing reached the server).
    A transient SQLSTATE is left to the caller (see :data:`TRANSIENT_SQLSTATES`); any other
    becomes its own error, or :class:`~wal_engine.errors.DatabaseError`.
    """
    if isinstance(error, WalError):
        return None
    if is_disconnect(error):
        reason = f"{type(error).__name__}: {error}".rstrip(": ")
        return ConnectionLost(dsn_redacted, reason, sent=sent)
    if isinstance(error, asyncpg.PostgresError) and not is_transient(error):
        return typed(error, task_id)
    return None


def typed(error: asyncpg.PostgresError, task_id: str | None = None, *,
          dsn_redacted: str = "the database") -> WalError:
    """:func:`translate`, falling back to :class:`DatabaseError` for a SQLSTATE the engine
    has no error of its own for: no driver error reaches a caller of the public API. A
    transient one (rolled back whole, for code that does not retry it) is
    :class:`DatabaseUnavailable`."""
    if is_transient(error):
        return DatabaseUnavailable(dsn_redacted, f"SQLSTATE {error.sqlstate}: {error}")
    translated = translate(error, task_id)
    if translated is not None:
        return translated
    return DatabaseError(str(error.sqlstate or "?"), str(error))


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
    if code == UNKNOWN_LIMITER:
        return UnknownLimiter(str(error.detail or "?"))
    if code == RETENTION_REFUSED:
        return RetentionRefused(error.detail or None, str(error))
    if code == CAP_EXCEEDED:
        return CapExceeded(str(error.detail or "cap"), str(error))
    if code == CHECK_VIOLATION and error.constraint_name == EVENT_BOUNDS:
        return CapExceeded("event_bounds", str(error))
    if code == UNIQUE_VIOLATION:
        return DuplicateRow(error.constraint_name, str(error.detail or error))
    if code in _input_codes:
        return InvalidInput(f"rejected by PostgreSQL ({code}): {error}")
    return None
