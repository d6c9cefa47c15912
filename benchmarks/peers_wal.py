"""wal-engine in the suite: tool steps through the real runtime (engine, worker, agent code).

A step is ``ctx.tool("work", ...)``: the intent (carrying the ~500-byte message as the
call's arguments) appended and committed, the tool run, its ~1 KB result appended and
committed; two fenced, hash-chained appends. Every ``CHECKPOINT_EVERY_STEPS`` steps the
agent marks a step boundary (``ctx.checkpoint()``), where the engine's default snapshot
policy may write a snapshot. Concurrent tasks share one worker process, whose appends are
group-committed. Resume is :func:`wal_engine.runtime.resume.resume` on a fresh connection.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Final

import asyncpg

from benchmarks import harness
from benchmarks.peers_workload import (
    CHECKPOINT_EVERY_STEPS,
    CONCURRENT_TASKS,
    Driver,
    StepClock,
    history_figures,
    message,
    result,
    tables_bytes,
)
from replay.snapshot import encode_state
from wal_engine import limits
from wal_engine.engine import Engine, connect
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.resume import resume
from wal_engine.store import Database, Store
from wal_engine.store.connection import session_settings

NAME: Final = "wal-engine"
DRIVEN_AGENT: Final = "suite_driven"
HISTORY_AGENT: Final = "suite_history"
TABLE_PATTERNS: Final = ("wal\\_%",)
"""Every wal-engine table (events, tasks, snapshots, idempotency, signals, ...)."""
WORKER_POLL_MS: Final = 20


async def tool_step(ctx: AgentContext, step: int) -> Any:
    """Step ``step``: one tool call written ahead; a step boundary every N steps.

    The tool is a coroutine function, run on the worker's loop: a plain ``def`` runs on
    the worker's thread pool (a hop of its own, measured by ``benchmarks.sync_tools``),
    and this suite measures the log's cost per step, as the raw reference does.
    """
    async def work(_args: Any) -> Any:
        return {"result": result(step)}

    outcome = await ctx.tool("work", work, {"message": message(step)})
    if (step + 1) % CHECKPOINT_EVERY_STEPS == 0:
        await ctx.checkpoint()
    return outcome


def register_driven(engine: Engine, driver: Driver) -> None:
    """The agent of the in-process workloads: one step each time the driver says go."""

    @engine.agent(DRIVEN_AGENT)
    async def driven(ctx: AgentContext, task_input: Any) -> Any:
        step = 0
        while await driver.go[ctx.task_id].get():
            await tool_step(ctx, step)
            step += 1
            driver.done[ctx.task_id].put_nowait(None)
        return step


class WalPeer:
    """The in-process contender: 1 + 64 tasks of the driven agent on one live worker."""

    name = NAME

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.driver = Driver()
        self.engine: Engine | None = None
        self.running: asyncio.Task[None] | None = None
        self.task_ids: list[str] = []
        self.worker: Any = None

    async def open(self) -> None:
        """Connect, start a worker, submit the tasks (each waits for its first go)."""
        self.engine = await connect(self.dsn)
        register_driven(self.engine, self.driver)
        self.worker = self.engine.worker(concurrency=CONCURRENT_TASKS + 1,
                                         poll_ms=WORKER_POLL_MS)
        self.running = asyncio.create_task(self.worker.run())
        run = uuid.uuid4().hex[:8]
        self.task_ids = [f"wal-seq-{run}"] + [f"wal-c{i:02d}-{run}"
                                              for i in range(CONCURRENT_TASKS)]
        for task_id in self.task_ids:
            self.driver.add(task_id)
            await self.engine.submit(DRIVEN_AGENT, task_id=task_id)

    async def step_one(self) -> None:
        """One step of the sequential task."""
        await self.driver.step(self.task_ids[0])

    async def step_all(self) -> None:
        """One step of each of the 64 concurrent tasks, all at once."""
        await asyncio.gather(*(self.driver.step(task_id) for task_id in self.task_ids[1:]))

    async def extra(self) -> dict[str, Any]:
        """Appends and flushes of the group committer so far."""
        assert self.engine is not None
        return {"group_commit": {"appends": self.engine.committer.appends,
                                 "flushes": self.engine.committer.flushes}}

    async def close(self) -> None:
        """Let every task return, stop the worker, close the engine."""
        if self.engine is None:
            return
        for task_id in self.task_ids:
            await self.driver.stop(task_id)
        if self.task_ids:
            await self.engine.wait(self.task_ids[0], timeout_s=60)
        if self.worker is not None:
            self.worker.stop()
        if self.running is not None:
            await self.running
        await self.engine.close()


def live_peer(arguments: dict[str, Any]) -> WalPeer:
    """(Child) The live contender of ``serve``."""
    return WalPeer(arguments["dsn"])


# ----------------------------------------------------------------------------- histories


class _Pause:
    """Where the history agent stops so its tables can be measured, and the go-ahead."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.reached = asyncio.Event()
        self.release = asyncio.Event()


def register_history(engine: Engine, pause: _Pause, clock: StepClock) -> None:
    """The agent of a history build: ``steps`` tool steps, pausing once, then it returns."""

    @engine.agent(HISTORY_AGENT)
    async def history(ctx: AgentContext, task_input: Any) -> Any:
        for step in range(int(task_input["steps"])):
            if step == pause.at_step:
                pause.reached.set()
                await pause.release.wait()
            await tool_step(ctx, step)
            clock.steps += 1
        return {"steps": task_input["steps"]}


async def build(arguments: dict[str, Any]) -> dict[str, Any]:
    """(Child) Run a task of ``steps`` steps through a worker; measure its tables."""
    dsn, steps, window = arguments["dsn"], int(arguments["steps"]), int(arguments["window"])
    task_id = arguments["task_id"]
    engine = await connect(dsn)
    pause, clock = _Pause(steps - window), StepClock()
    register_history(engine, pause, clock)
    connection = await asyncpg.connect(dsn, timeout=limits.connect_timeout_s)
    worker = engine.worker(concurrency=1, poll_ms=WORKER_POLL_MS)
    running = asyncio.create_task(worker.run())
    try:
        before = await tables_bytes(connection, "public", TABLE_PATTERNS)
        clock.started = time.perf_counter()
        await engine.submit(HISTORY_AGENT, {"steps": steps}, task_id=task_id)
        await pause.reached.wait()
        middle = await tables_bytes(connection, "public", TABLE_PATTERNS)
        clock.mark_window()
        pause.release.set()
        await engine.wait(task_id, timeout_s=3600)
        after = await tables_bytes(connection, "public", TABLE_PATTERNS)
        snapshots = await connection.fetchval(
            "SELECT count(*) FROM wal_snapshots WHERE task_id = $1", task_id)
    finally:
        worker.stop()
        await running
        await connection.close()
        await engine.close()
    return history_figures(steps=steps, window=window, before=before, middle=middle,
                           after=after, clock=clock, extra={"snapshots_kept": snapshots})


async def encoded_state(dsn: str, task_id: str) -> bytes:
    """The task's state at its head, in the engine's snapshot encoding (the floor's row)."""
    database = await Database.open(dsn, min_size=1, max_size=1, migrate=False)
    try:
        return encode_state(await resume(Store(database), task_id))
    finally:
        await database.close()


def resume_operation(dsn: str, task_id: str, steps: int) -> harness.Operation:
    """Time ``resume`` on a fresh connection (the pool of one is opened untimed)."""

    async def operation() -> int:
        pool = await asyncpg.create_pool(
            dsn, min_size=1, max_size=1, timeout=limits.connect_timeout_s,
            command_timeout=limits.command_timeout_s,
            server_settings=session_settings("default", "bench:suite-resume"),
        )
        assert pool is not None
        try:
            store = Store(Database(pool, dsn))
            start = time.perf_counter_ns()
            state = await resume(store, task_id)
            elapsed = time.perf_counter_ns() - start
        finally:
            await pool.close()
        assert state.usage.tool_calls == steps, (state.usage.tool_calls, steps)
        return elapsed

    return operation
