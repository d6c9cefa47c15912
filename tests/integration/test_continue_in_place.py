"""Continuing under the same lease after a lost connection: at the moment the network fault
tests showed was still costing claims (the first read of the task's state after its claim),
and what the interruption record keeps."""

from __future__ import annotations

import urllib.parse
from typing import Any

import asyncpg

from wal_engine.engine import Engine, connect
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.resume import RESUME_HEAD
from wal_engine.state_machine import Status
from wal_engine.store import queries
from wal_engine.testing.crash import run_worker_until_idle


async def test_a_connection_lost_at_the_first_read_keeps_the_claim(database_dsn: str) -> None:
    """The state read just after the claim loses its connection twice: the run retries it
    under its lease and completes on its one claim (it left the task to lease expiry, a
    second claim 30 s later here, before)."""
    engine: Engine = await connect(database_dsn, migrate=False)
    lost: list[str] = []
    fetch = engine.database.fetch

    async def flaky_fetch(query: str, *args: Any, **kwargs: Any) -> Any:
        if query == RESUME_HEAD and len(lost) < 2:
            lost.append(query)
            raise asyncpg.exceptions.ConnectionDoesNotExistError(
                "test: the connection dropped while the state was read")
        return await fetch(query, *args, **kwargs)

    try:
        @engine.agent("first_read")
        async def first_read(ctx: AgentContext, task_input: Any) -> Any:
            return await ctx.tool("echo", lambda args: args["n"], {"n": task_input["n"]})

        task_id = await engine.submit("first_read", {"n": 7})
        engine.database.fetch = flaky_fetch  # type: ignore[method-assign]
        await run_worker_until_idle(engine, worker_id="steady", timeout_s=20)
        engine.database.fetch = fetch  # type: ignore[method-assign]
        state = await engine.state(task_id)
    finally:
        await engine.close()
    assert len(lost) == 2
    assert state.status is Status.COMPLETED and state.output == 7
    assert state.attempts == 1


async def test_run_interrupted_records_the_reason_without_the_database_address(
        database_dsn: str) -> None:
    """A result's append lost before it reached the server: the run records the result
    again and ``run_interrupted`` with the reason, and the DSN's host, port and database
    stay out of the task's history."""
    engine: Engine = await connect(database_dsn, migrate=False)
    appends = (queries.OBSERVE_ONE, queries.OBSERVE_MANY, queries.TRANSITION,
               queries.APPEND_MANY)
    drop: list[bool] = []
    fetch = engine.database.fetch

    async def dropping_fetch(query: str, *args: Any, **kwargs: Any) -> Any:
        if query in appends and drop == [True]:
            drop.append(False)
            raise asyncpg.exceptions.ConnectionDoesNotExistError("test: dropped before sending")
        return await fetch(query, *args, **kwargs)

    def act(args: Any) -> Any:
        drop.append(True)
        return "acted"

    try:
        @engine.agent("interrupted")
        async def interrupted(ctx: AgentContext, task_input: Any) -> Any:
            return await ctx.tool("act", act, {})

        task_id = await engine.submit("interrupted", {})
        engine.database.fetch = dropping_fetch  # type: ignore[method-assign]
        await run_worker_until_idle(engine, worker_id="steady", timeout_s=20)
        engine.database.fetch = fetch  # type: ignore[method-assign]
        state = await engine.state(task_id)
        records = [r.decode() for r in await engine.history(task_id)
                   if r.type == "run_interrupted"]
    finally:
        await engine.close()
    assert state.status is Status.COMPLETED and state.output == "acted" and drop == [True, False]
    assert len(records) == 1 and "dropped before sending" in records[0].error
    address = urllib.parse.urlsplit(database_dsn)
    assert f"{address.hostname}:{address.port}" not in records[0].error
    assert (address.path.lstrip("/") or "postgres") not in records[0].error
