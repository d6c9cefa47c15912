"""Small helpers shared by the tests (not fixtures)."""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from wal_engine import events as ev
from wal_engine.store import Database, Store, TaskHead
from wal_engine.store.records import AppendResult


async def log_snapshot(database: Database) -> tuple[list[Any], list[Any]]:
    """Every row of the log and the task heads, to assert that nothing changed."""
    events = await database.fetch(
        "SELECT task_id, seq, type, version, epoch, payload, hash FROM wal_events"
        " ORDER BY task_id, seq"
    )
    tasks = await database.fetch(
        "SELECT task_id, status, head_seq, head_hash, lease_epoch FROM wal_tasks ORDER BY task_id"
    )
    return [tuple(row) for row in events], [tuple(row) for row in tasks]


async def claim(database: Database, worker: str = "w1", ttl_ms: int = 30_000) -> list[Any]:
    """Claim every due task for ``worker`` (one statement)."""
    return await database.fetch("SELECT * FROM wal_claim_tasks($1, 100, $2)", worker, ttl_ms)


async def claimed_task(store: Store, task_id: str = "task-1") -> TaskHead:
    """Create a task and claim it; return its head (RUNNING, epoch 1)."""
    await store.create_task(task_id, "agent")
    await claim(store.database)
    return await store.read_head(task_id)


def head_args(head: TaskHead | AppendResult, epoch: int) -> dict[str, Any]:
    """Keyword arguments that fence an append on ``head``."""
    return {"epoch": epoch, "expected_seq": head.head_seq, "prev_hash": head.head_hash}


async def task_with_messages(store: Store, task_id: str, messages: int) -> int:
    """A claimed task whose log ends with ``messages`` observations; returns its head seq."""
    await store.create_task(task_id, "agent")
    await claim(store.database)
    head = await store.read_head(task_id)
    seq, digest = head.head_seq, head.head_hash
    for index in range(messages):
        result = await store.append_events(
            task_id, [ev.MessageAppended(role="user", content=f"message {index}")],
            epoch=head.lease_epoch, expected_seq=seq, prev_hash=digest)
        seq, digest = result.head_seq, result.head_hash
    return seq


REPOSITORY = Path(__file__).resolve().parents[1]


async def run_module(module: str, *args: str, timeout_s: float) -> str:
    """Run ``python -m module args`` from the repository; its stdout once it exited 0 (the
    process is killed past ``timeout_s``; a failure shows its output)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, cwd=REPOSITORY,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    output = stdout.decode()
    assert process.returncode == 0, f"exit {process.returncode}\n{output}\n{stderr.decode()}"
    return output


async def escalations(engine: Any, task_id: str) -> list[ev.ToolCallUncertain]:
    """The ``tool_call_uncertain`` events of a task, in order."""
    found = []
    for record in await engine.history(task_id):
        event = record.decode()
        if isinstance(event, ev.ToolCallUncertain):
            found.append(event)
    return found


DRIVE_TIMINGS: dict[str, Any] = {"lease_ttl_ms": 600, "heartbeat_ms": 150, "poll_ms": 50,
                                 "sweep_ms": 100}
"""Worker timings of :func:`drive`: short leases, so that a run held up is noticed fast."""


async def drive(engine: Any, task_id: str, status: str | None = None, *,
                timings: dict[str, Any] | None = None) -> Any:
    """Run an in-process worker until the task is terminal (its output) or reaches
    ``status``."""
    from wal_engine.testing.processes import wait_until

    worker = engine.worker(concurrency=2, **(timings or DRIVE_TIMINGS))
    running = asyncio.create_task(worker.run())
    try:
        if status is None:
            return await engine.wait(task_id, timeout_s=20)

        async def reached() -> bool:
            return str((await engine.head(task_id)).status) == status
        return await wait_until(reached, f"task {task_id} to be {status}", 20)
    finally:
        worker.stop()
        await running


def sql_literal(value: Any) -> str:
    """A SQL literal for EXPLAIN EXECUTE of a prepared statement (test values only)."""
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"'\\x{value.hex()}'::bytea"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "ARRAY[" + ", ".join(sql_literal(item) for item in value) + "]"
    if isinstance(value, dt.datetime):
        return f"'{value.isoformat()}'::timestamptz"
    return "'" + str(value).replace("'", "''") + "'"


def plan_nodes(plan: Any) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan."""
    found: list[dict[str, Any]] = []
    pending = [item["Plan"] for item in plan]
    while pending:
        node = pending.pop()
        found.append(node)
        pending.extend(node.get("Plans", []))
    return found
