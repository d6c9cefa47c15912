"""The one retry helper of infrastructure operations and the one translation of driver
errors: policies bound attempts and time, jitter is deterministic, and every kind of lost
connection becomes DatabaseUnavailable (ConnectionLost once a statement was in flight)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from wal_engine.errors import (
    ConnectionLost,
    DatabaseError,
    DatabaseUnavailable,
    DuplicateRow,
    IllegalTransition,
)
from wal_engine.retries import (
    EMIT_RETRY,
    RESOLVE_RETRY,
    STATEMENT_RETRY,
    InfraPolicy,
    infra_jitter,
    retrying,
)
from wal_engine.store import sqlstate


class FakeTime:
    """A clock that moves only when the helper sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    async def sleep(self, delay_s: float) -> None:
        self.sleeps.append(delay_s)
        self.now += delay_s

    def clock(self) -> float:
        return self.now


def _failing(times: int, error: Exception
             ) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def operation() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    return calls, operation


def test_retries_until_success_within_attempts() -> None:
    """Two failures then success under a three-attempt policy: the result, two sleeps."""
    fake = FakeTime()
    calls, operation = _failing(2, TimeoutError())
    result = asyncio.run(retrying(STATEMENT_RETRY, operation,
                                  retry_if=lambda e: True, sleep=fake.sleep, clock=fake.clock))
    assert result == "done" and len(calls) == 3 and len(fake.sleeps) == 2


def test_last_error_raised_when_attempts_run_out() -> None:
    """Past attempts_max the last error is raised unchanged (the caller names it)."""
    fake = FakeTime()
    error = TimeoutError("still down")
    calls, operation = _failing(10, error)
    with pytest.raises(TimeoutError) as raised:
        asyncio.run(retrying(STATEMENT_RETRY, operation,
                             retry_if=lambda e: True, sleep=fake.sleep, clock=fake.clock))
    assert raised.value is error and len(calls) == STATEMENT_RETRY.attempts_max


def test_refused_error_is_not_retried() -> None:
    """An error retry_if refuses is raised at once, with no sleep."""
    fake = FakeTime()
    calls, operation = _failing(1, ValueError("bad"))
    with pytest.raises(ValueError):
        asyncio.run(retrying(STATEMENT_RETRY, operation,
                             retry_if=lambda e: isinstance(e, TimeoutError),
                             sleep=fake.sleep, clock=fake.clock))
    assert len(calls) == 1 and fake.sleeps == []


def test_deadline_bounds_an_unlimited_policy() -> None:
    """A policy bounded by time only stops once its deadline has passed."""
    fake = FakeTime()
    _calls, operation = _failing(10_000, ConnectionError())
    with pytest.raises(ConnectionError):
        asyncio.run(retrying(RESOLVE_RETRY, operation,
                             retry_if=lambda e: True, sleep=fake.sleep, clock=fake.clock))
    assert RESOLVE_RETRY.deadline_s is not None
    assert fake.now >= RESOLVE_RETRY.deadline_s
    assert fake.now - fake.sleeps[-1] < RESOLVE_RETRY.deadline_s
    assert max(fake.sleeps) == RESOLVE_RETRY.max_delay_s  # Capped, no jitter.


def test_jitter_is_deterministic_and_spread_by_key() -> None:
    """The same attempt of the same key waits the same; another key waits otherwise; every
    delay stays under its cap."""
    assert EMIT_RETRY.delay_s(3, "task-a") == EMIT_RETRY.delay_s(3, "task-a")
    assert EMIT_RETRY.delay_s(3, "task-a") != EMIT_RETRY.delay_s(3, "task-b")
    for attempt in range(1, 20):
        cap = min(EMIT_RETRY.max_delay_s,
                  EMIT_RETRY.initial_delay_s * EMIT_RETRY.multiplier ** (attempt - 1))
        assert 0 <= EMIT_RETRY.delay_s(attempt, "k") < cap
    assert 0 <= infra_jitter("x", "y", 1) < 1


def test_policy_without_bounds_is_never_exhausted() -> None:
    """A reconnect policy (no attempts cap, no deadline) is never exhausted."""
    policy = InfraPolicy(name="forever", attempts_max=None)
    assert not policy.exhausted(10**6, 10**6)


@pytest.mark.parametrize("error", [
    ConnectionRefusedError(111, "refused"),
    OSError(113, "no route to host"),
    TimeoutError(),
    asyncpg.exceptions.ConnectionDoesNotExistError("closed"),
    asyncpg.exceptions.AdminShutdownError("terminating connection"),
    asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
    asyncpg.exceptions.TargetServerAttributeNotMatched("not a standby"),
    asyncpg.exceptions.InterfaceError("connection is closed"),
])
def test_disconnects_become_database_unavailable(error: Exception) -> None:
    """Every kind of lost or refused connection is ConnectionLost (a DatabaseUnavailable),
    whose ``sent`` says whether a statement was in flight (its outcome unknown)."""
    before = sqlstate.translate_failure(error, "postgresql://h/d", sent=False)
    after = sqlstate.translate_failure(error, "postgresql://h/d", sent=True)
    assert isinstance(before, ConnectionLost) and isinstance(after, ConnectionLost)
    assert isinstance(after, DatabaseUnavailable)
    assert (before.sent, after.sent) == (False, True)
    assert type(error).__name__ in after.reason


def test_sql_errors_map_through_sqlstate() -> None:
    """A unique violation is DuplicateRow, an engine SQLSTATE its typed error, a transient
    one is left to the retry, an unknown one is DatabaseError (with its SQLSTATE)."""
    duplicate = sqlstate.translate_failure(asyncpg.exceptions.UniqueViolationError("dup"), "d")
    assert isinstance(duplicate, DuplicateRow)
    timeout = asyncpg.exceptions.QueryCanceledError("statement timeout")
    assert sqlstate.is_transient(timeout)
    assert sqlstate.translate_failure(timeout, "d") is None
    privilege = asyncpg.exceptions.InsufficientPrivilegeError("denied")
    refused = sqlstate.translate_failure(privilege, "d")
    assert isinstance(refused, DatabaseError) and refused.sqlstate == "42501"
    assert isinstance(sqlstate.typed(timeout), DatabaseUnavailable)
    illegal = type("Illegal", (asyncpg.PostgresError,), {"sqlstate": "WE001"})("no")
    assert isinstance(sqlstate.translate_failure(illegal, "d", task_id="t"),
                      IllegalTransition)
