"""While the database is away (connections refused, or left unanswered by a partition),
every call of the Engine's API raises a WalError (DatabaseUnavailable), never an asyncpg
error, an OSError or a bare TimeoutError; a worker waits the outage out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from wal_engine import limits
from wal_engine.engine import Engine, connect
from wal_engine.errors import DatabaseUnavailable, WaitTimedOut, WalError
from wal_engine.testing.crash import connect_engine
from wal_engine.testing.proxy import FaultProxy

call_deadline_s = 30.0
"""Longest any one call may take while the database is away (a connect timeout is 1 s)."""


@pytest_asyncio.fixture
async def proxied(database_dsn: str, monkeypatch: pytest.MonkeyPatch
                  ) -> AsyncIterator[tuple[Engine, FaultProxy, str]]:
    """An engine whose connections all go through a fault proxy, with one task submitted
    while the database was reachable."""
    monkeypatch.setattr(limits, "connect_timeout_s", 1.0)
    proxy = await FaultProxy.for_dsn(database_dsn).start()
    engine = await connect_engine(proxy.dsn(database_dsn), command_timeout_s=1.0,
                                  pool_size_max=2)
    # Calls safe to repeat ride an outage for unavailable_retry_s (30 s by default) before
    # they raise; here the outage lasts the whole test, so they raise after 0.3 s.
    engine.unavailable_retry_s = 0.3

    @engine.agent("away")
    async def away(ctx: Any, args: Any) -> Any:
        return await ctx.wait_signal("go")

    task_id = await engine.submit("away", {"n": 1})
    try:
        yield engine, proxy, task_id
    finally:
        proxy.set("pass")
        await proxy.close()
        await asyncio.wait_for(engine.close(), 10)


def _public_calls(engine: Engine, task_id: str
                  ) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    async def worker_run() -> None:
        # A worker waits for the database (it is not idle until the database says so):
        # it is still running after a second of the outage, and stops cleanly.
        worker = engine.worker(concurrency=1, poll_ms=50, sweep_ms=100, heartbeat_ms=100)
        running = asyncio.create_task(worker.run(until_idle=True))
        await asyncio.wait({running}, timeout=1.0)
        assert not running.done(), "an until_idle worker returned during the outage"
        assert not worker.database_ready
        worker.stop()
        await running

    return [
        ("submit", lambda: engine.submit("away", {"n": 2})),
        ("state", lambda: engine.state(task_id)),
        ("head", lambda: engine.head(task_id)),
        ("history", lambda: engine.history(task_id)),
        ("signal", lambda: engine.signal(task_id, "go", {"x": 1})),
        ("cancel", lambda: engine.cancel(task_id)),
        ("wait", lambda: engine.wait(task_id, timeout_s=1.5)),
        ("worker", worker_run),
    ]


async def _outcome(call: Callable[[], Awaitable[Any]]) -> BaseException | None:
    try:
        await asyncio.wait_for(call(), call_deadline_s)
    except Exception as error:
        return error
    return None


def _raw(error: BaseException) -> bool:
    """Whether ``error`` is a driver or OS error, or a bare TimeoutError (not a WalError)."""
    return (not isinstance(error, WalError)
            or type(error).__module__ in ("builtins", "asyncpg.exceptions"))


async def _assert_only_wal_errors(engine: Engine, task_id: str) -> dict[str, str]:
    seen: dict[str, str] = {}
    for name, call in _public_calls(engine, task_id):
        error = await _outcome(call)
        if name == "worker":
            # The worker waits the outage out and returns once idle: nothing may escape.
            assert error is None, f"worker.run raised {error!r}"
            continue
        assert error is not None, f"engine.{name} succeeded with the database away"
        assert not _raw(error), f"engine.{name} raised a raw {type(error).__name__}: {error}"
        expected = WaitTimedOut if name == "wait" else DatabaseUnavailable
        assert isinstance(error, expected), f"engine.{name} raised {error!r}"
        seen[name] = type(error).__name__
    return seen


@pytest.mark.asyncio
async def test_refused_connections_surface_as_database_unavailable(
        proxied: tuple[Engine, FaultProxy, str]) -> None:
    """The server refuses connections (its listener gone, open sessions reset): every
    API call raises DatabaseUnavailable (engine.wait times out with WaitTimedOut)."""
    engine, proxy, task_id = proxied
    await proxy.close()
    seen = await _assert_only_wal_errors(engine, task_id)
    assert set(seen) == {"submit", "state", "head", "history", "signal", "cancel", "wait"}


@pytest.mark.asyncio
async def test_partitioned_database_surfaces_as_database_unavailable(
        proxied: tuple[Engine, FaultProxy, str]) -> None:
    """A partition (nothing flows, sockets open): statements and connects time out, and the
    caller sees DatabaseUnavailable, never the driver's TimeoutError."""
    engine, proxy, task_id = proxied
    proxy.set("blackhole")
    seen = await _assert_only_wal_errors(engine, task_id)
    assert seen["submit"] in ("DatabaseUnavailable", "ConnectionLost")


@pytest.mark.asyncio
async def test_failover_target_refused_is_database_unavailable(database_dsn: str) -> None:
    """A DSN asking for a standby reaches only the primary (what a client sees mid-failover,
    TargetServerAttributeNotMatched): connect() raises DatabaseUnavailable."""
    separator = "&" if "?" in database_dsn else "?"
    with pytest.raises(DatabaseUnavailable) as refused:
        await connect(f"{database_dsn}{separator}target_session_attrs=standby",
                      migrate=False)
    assert isinstance(refused.value.__cause__, asyncpg.exceptions.InternalClientError)
