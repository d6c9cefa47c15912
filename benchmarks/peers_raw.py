"""The raw-asyncpg reference of the suite: the physical limit of the workload.

* A step is two one-row ``INSERT`` commits (the intent's row, then the result's row), rows
  of the same stored size as wal-engine's ``tool_call_intended`` and ``tool_call_completed``
  events, into a bare table with a primary key; sequential on one connection, or on 64
  connections at once.
* The resume floor: one ``SELECT`` of a row holding the task's whole state at its head
  (the engine's own msgpack encoding of it) and its decoding, on a fresh connection.
  Resume can never beat reading the state it returns.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Final

import asyncpg

from benchmarks import harness
from benchmarks.append import RAW_PADDING_BYTES
from benchmarks.peers_workload import (
    CONCURRENT_TASKS,
    StepClock,
    history_figures,
    message,
    result,
    tables_bytes,
)
from replay import decode_state
from replay.state import args_hash
from wal_engine import events as vocabulary
from wal_engine import limits
from wal_engine.ids import idempotency_key

NAME: Final = "raw asyncpg"
TABLE: Final = "bench_suite_raw_steps"
STATE_TABLE: Final = "bench_suite_raw_state"
CREATE_TABLES: Final = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    task_id text NOT NULL, seq bigint NOT NULL, type text NOT NULL, payload bytea NOT NULL,
    hash bytea NOT NULL, PRIMARY KEY (task_id, seq)
);
CREATE TABLE IF NOT EXISTS {STATE_TABLE} (task_id text PRIMARY KEY, state bytea NOT NULL);
"""
INSERT: Final = (
    f"INSERT INTO {TABLE} (task_id, seq, type, payload, hash) VALUES ($1, $2, $3, $4, $5)"
)
SELECT_STATE: Final = f"SELECT state FROM {STATE_TABLE} WHERE task_id = $1"
UPSERT_STATE: Final = (
    f"INSERT INTO {STATE_TABLE} (task_id, state) VALUES ($1, $2)"
    " ON CONFLICT (task_id) DO UPDATE SET state = excluded.state"
)
ROW_BYTES: Final = f"SELECT avg(pg_column_size(r.*))::float8 FROM {TABLE} r WHERE task_id = $1"


def step_rows(task_id: str, step: int) -> tuple[bytes, bytes]:
    """The payloads of step ``step``'s two rows, sized like wal-engine's two events."""
    call_id = f"tool-{step}"
    args = {"message": message(step)}
    intent = vocabulary.ToolCallIntended(
        call_id=call_id, tool="work", args=args,
        args_hash=args_hash(args),
        idempotency_key=idempotency_key(task_id, 2 * step + 3),
    )
    completed = vocabulary.ToolCallCompleted(call_id=call_id, result={"result": result(step)})
    padding = b"p" * RAW_PADDING_BYTES
    return (vocabulary.encode_event(intent)[2] + padding,
            vocabulary.encode_event(completed)[2] + padding)


class RawTask:
    """One raw task: its id and next step."""

    __slots__ = ("step", "task_id")

    def __init__(self, task_id: str) -> None:
        self.task_id, self.step = task_id, 0

    async def run_step(self, connection: asyncpg.Connection) -> None:
        """Two one-row INSERT commits (autocommit), as a write-ahead step needs."""
        intent, completed = step_rows(self.task_id, self.step)
        seq = 2 * self.step + 1
        await connection.execute(INSERT, self.task_id, seq, "intent", intent, bytes(32))
        await connection.execute(INSERT, self.task_id, seq + 1, "result", completed, bytes(32))
        self.step += 1


async def open_pool(dsn: str, size: int) -> asyncpg.Pool:
    """A pool with the store's settings (no reset round trip on release), tables created."""
    pool = await asyncpg.create_pool(
        dsn, min_size=size, max_size=size, timeout=limits.connect_timeout_s,
        command_timeout=limits.command_timeout_s, reset=harness.no_session_reset,
        server_settings={"application_name": "bench:suite-raw"},
    )
    assert pool is not None
    await pool.execute(CREATE_TABLES)
    return pool


class RawPeer:
    """The in-process raw reference: one sequential task, and 64 tasks on 64 connections."""

    name = NAME

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.pool: asyncpg.Pool | None = None
        run = uuid.uuid4().hex[:8]
        self.single = RawTask(f"raw-seq-{run}")
        self.many = [RawTask(f"raw-c{i:02d}-{run}") for i in range(CONCURRENT_TASKS)]

    async def open(self) -> None:
        """Open the pool (64 connections)."""
        self.pool = await open_pool(self.dsn, CONCURRENT_TASKS)

    async def step_one(self) -> None:
        """One step of the sequential task."""
        assert self.pool is not None
        async with self.pool.acquire() as connection:
            await self.single.run_step(connection)

    async def step_all(self) -> None:
        """One step of each of the 64 tasks, each on its own connection, all at once."""
        pool = self.pool
        assert pool is not None

        async def one(task: RawTask) -> None:
            async with pool.acquire() as connection:
                await task.run_step(connection)

        await asyncio.gather(*(one(task) for task in self.many))

    async def extra(self) -> dict[str, Any]:
        """The average stored size of this run's rows (pg_column_size), to check that they
        match wal-engine's events."""
        assert self.pool is not None
        return {"raw_row_bytes": float(await self.pool.fetchval(ROW_BYTES, self.single.task_id)
                                       or 0)}

    async def close(self) -> None:
        """Close the pool."""
        if self.pool is not None:
            await self.pool.close()


def live_peer(arguments: dict[str, Any]) -> RawPeer:
    """(Child) The live contender of ``serve``."""
    return RawPeer(arguments["dsn"])


# ----------------------------------------------------------------------------- histories


async def build(arguments: dict[str, Any]) -> dict[str, Any]:
    """(Child) Write a task of ``steps`` steps, one row per commit; measure its tables."""
    steps, window = int(arguments["steps"]), int(arguments["window"])
    connection = await asyncpg.connect(arguments["dsn"], timeout=limits.connect_timeout_s)
    try:
        await connection.execute(CREATE_TABLES)
        task = RawTask(arguments["task_id"])
        before = await tables_bytes(connection, "public", [TABLE])
        clock = StepClock()
        middle = before
        for step in range(steps):
            if step == steps - window:
                middle = await tables_bytes(connection, "public", [TABLE])
                clock.mark_window()
            await task.run_step(connection)
            clock.steps += 1
        after = await tables_bytes(connection, "public", [TABLE])
    finally:
        await connection.close()
    return history_figures(steps=steps, window=window, before=before, middle=middle,
                           after=after, clock=clock)


async def store_state(dsn: str, task_id: str, state: bytes) -> None:
    """Store the floor's row: ``state`` (an encoded AgentState) under ``task_id``."""
    connection = await asyncpg.connect(dsn, timeout=limits.connect_timeout_s)
    try:
        await connection.execute(CREATE_TABLES)
        await connection.execute(UPSERT_STATE, task_id, state)
    finally:
        await connection.close()


def floor_operation(dsn: str, task_id: str, steps: int) -> harness.Operation:
    """Time reading and decoding the state row on a fresh connection (opened untimed)."""

    async def operation() -> int:
        connection = await asyncpg.connect(dsn, timeout=limits.connect_timeout_s)
        try:
            start = time.perf_counter_ns()
            encoded = await connection.fetchval(SELECT_STATE, task_id)
            state = decode_state(encoded)
            elapsed = time.perf_counter_ns() - start
        finally:
            await connection.close()
        assert state.usage.tool_calls == steps, (state.usage.tool_calls, steps)
        return elapsed

    return operation
