"""Crash injection and driving helpers for in-process tests.

In-process crashes use the runtime's named failpoints (:mod:`wal_engine.failpoints`) with
the ``raise`` action: :class:`~wal_engine.failpoints.SimulatedCrash` unwinds the task run at
that point without any cleanup write, as if the worker had vanished; the task keeps its
lease until it expires (or :func:`expire_leases` ends it at once). Out-of-process crashes
(SIGKILL at a failpoint) are in :mod:`wal_engine.testing.processes`.

The helpers move time forward by writing the database, never by sleeping:
:func:`expire_leases` puts leases in the past and runs the sweeper's statement,
:func:`advance_timers` makes durable timers due, :func:`deliver_signals` answers the tasks
that wait for a signal. :func:`drive_to_quiescence` combines them with worker runs until
every task is terminal (the liveness check, RELIABILITY.md I11).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec

from replay.state import AgentState
from wal_engine import failpoints
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.store import Database, TaskHead

if TYPE_CHECKING:
    from wal_engine.engine import Engine
    from wal_engine.runtime.worker import Worker

POINTS: Final = failpoints.POINTS
"""Every named crash point of the runtime."""

FAST_TIMINGS: Final[dict[str, Any]] = {
    "lease_ttl_ms": 30_000, "heartbeat_ms": 25, "poll_ms": 20, "sweep_ms": 50,
    "drain_timeout_s": 5.0,
}
"""Worker timings for tests: leases end only when a test expires them (long TTL), and the
heartbeat is frequent so that the ``during_heartbeat`` point is reached."""

run_timeout_s_default: Final = 30.0

EXPIRE_LEASES: Final = """
UPDATE wal_tasks SET lease_expires_at = now() - interval '1 millisecond'
 WHERE tenant = current_setting('wal.tenant', true) AND status IN ('RUNNING', 'CHECKPOINTED')
   AND lease_expires_at IS NOT NULL
   AND ($1::text[] IS NULL OR task_id = ANY($1::text[]))
"""
BREAK_LEASES: Final = "SELECT count(*) AS broken FROM wal_break_leases($1)"
ADVANCE_TIMERS: Final = """
UPDATE wal_tasks SET wake_at = now()
 WHERE tenant = current_setting('wal.tenant', true) AND status = 'WAITING' AND wake_at > now()
   AND ($1 OR waiting_signal IS NULL)
RETURNING task_id
"""
WAITING_FOR_SIGNAL: Final = """
SELECT task_id, waiting_signal FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true)
    AND status = 'WAITING' AND waiting_signal IS NOT NULL
   AND ($1::text[] IS NULL OR task_id = ANY($1::text[]))
 ORDER BY task_id LIMIT 10000
"""
OPEN_TASKS: Final = """
SELECT task_id FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND status NOT IN ('COMPLETED', 'FAILED')
   AND ($1::text[] IS NULL OR task_id = ANY($1::text[]))
 ORDER BY task_id LIMIT 10000
"""
leases_broken_max: Final = 10_000


class CrashReport(msgspec.Struct, kw_only=True):
    """What an armed failpoint did during a run."""

    point: str
    nth: int
    fired: bool = False


@contextlib.contextmanager
def crash_at(point: str, nth: int = 1) -> Iterator[CrashReport]:
    """Within the block, the ``nth`` pass of ``point`` abandons the task run there.

    Yields a :class:`CrashReport` whose ``fired`` says afterwards whether the point was
    reached. Failpoints are process-wide: do not run two armed blocks at once.
    """
    report = CrashReport(point=point, nth=nth)
    failpoints.disarm()
    failpoints.arm(point, nth, "raise")
    try:
        yield report
    finally:
        report.fired = point in failpoints.fired
        failpoints.disarm()


async def run_worker_until_idle(engine: Engine, *, worker_id: str | None = None,
                                concurrency: int = 4, timeout_s: float = run_timeout_s_default,
                                **timings: Any) -> Worker:
    """Run one worker until no task is running and none is due; return it.

    Raises TimeoutError when the worker is still busy after ``timeout_s`` (a liveness
    failure: a run that never reaches a durable point).
    """
    worker = engine.worker(concurrency=concurrency, worker_id=worker_id,
                           **{**FAST_TIMINGS, **timings})
    running = asyncio.ensure_future(worker.run(until_idle=True))
    try:
        await asyncio.wait_for(asyncio.shield(running), timeout_s)
    except TimeoutError:
        worker.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(running, 10)
        raise
    return worker


async def expire_leases(engine: Engine, task_ids: Sequence[str] | None = None) -> int:
    """End every lease now (database clock) and break them as the sweeper would.

    The tasks become RESUMING with a ``task_orphaned`` event at a new epoch, so a worker
    still running one of them (a zombie) is fenced. Returns how many leases were broken.
    """
    wanted = None if task_ids is None else list(task_ids)
    await engine.database.fetch(EXPIRE_LEASES, wanted)
    rows = await engine.database.fetch(BREAK_LEASES, leases_broken_max)
    return int(rows[0]["broken"])


async def advance_timers(engine: Engine, *, signal_timeouts: bool = False) -> int:
    """Make every durable timer due now (with ``signal_timeouts``, signal timeouts too)."""
    rows = await engine.database.fetch(ADVANCE_TIMERS, signal_timeouts)
    return len(rows)


Responder = Callable[[str, str, AgentState], Awaitable[bool]]
"""``async (task_id, signal_name, state) -> sent``: answer one waiting task, or not."""


def default_responder(engine: Engine, signals: dict[str, Any] | None = None) -> Responder:
    """Approve every approval request, send ``signals[name]`` for a named wait, and
    reconcile escalated calls as failed (the harness cannot know what they did)."""
    payloads = dict(signals or {})

    async def respond(task_id: str, name: str, state: AgentState) -> bool:
        if name.startswith("~approval:"):
            call_id = name.removeprefix("~approval:")
            await engine.approve(task_id, call_id, approver="wal-engine-test")
            return True
        if name.startswith("~reconcile:"):
            call_id = name.removeprefix("~reconcile:")
            # Forced: the grace period guards against a human doing the effect by hand
            # while the attempt may still act; reconciling "as failed" does no effect, so
            # it cannot make one happen twice (and the test need not wait out a lease).
            await engine.reconcile(task_id, call_id, error="reconciled as failed by the test",
                                   force=True)
            return True
        if name in payloads:
            await engine.signal(task_id, name, payloads[name])
            return True
        return False

    return respond


async def deliver_signals(engine: Engine, responder: Responder,
                          task_ids: Sequence[str] | None = None) -> int:
    """Answer every task that waits for a signal; return how many were answered."""
    wanted = None if task_ids is None else list(task_ids)
    sent = 0
    for row in await engine.database.fetch(WAITING_FOR_SIGNAL, wanted):
        task_id, name = str(row["task_id"]), str(row["waiting_signal"])
        if await responder(task_id, name, await engine.state(task_id)):
            sent += 1
    return sent


async def open_tasks(engine: Engine, task_ids: Sequence[str] | None = None) -> list[str]:
    """Tasks that are not terminal."""
    wanted = None if task_ids is None else list(task_ids)
    return [str(r["task_id"]) for r in await engine.database.fetch(OPEN_TASKS, wanted)]


async def drive_to_quiescence(engine: Engine, task_ids: Sequence[str] | None = None, *,
                              responder: Responder | None = None, rounds_max: int = 50,
                              deadline_s: float = 60.0, worker_id: str = "finisher",
                              **timings: Any) -> list[str]:
    """Expire leases, advance timers, answer signals and run a worker, until every task
    (of ``task_ids``, or every task) is terminal; return the tasks still open (empty when
    the run is live, RELIABILITY.md I11)."""
    respond = responder or default_responder(engine)
    deadline = time.monotonic() + deadline_s
    still_open = await open_tasks(engine, task_ids)
    for _ in range(rounds_max):
        if not still_open or time.monotonic() > deadline:
            break
        await expire_leases(engine, still_open)
        await advance_timers(engine)
        await deliver_signals(engine, respond, still_open)
        await run_worker_until_idle(engine, worker_id=worker_id,
                                    timeout_s=max(1.0, deadline - time.monotonic()), **timings)
        still_open = await open_tasks(engine, task_ids)
    return still_open


async def run_crash_free(engine: Engine, agent: str, task_input: Any, *,
                         responder: Responder | None = None, task_id: str | None = None,
                         deadline_s: float = 60.0, **timings: Any) -> AgentState:
    """Submit ``agent(task_input)`` and drive it to its end with no fault armed (workers
    with ``timings``, default :data:`FAST_TIMINGS`)."""
    [state] = await run_crash_free_many(engine, [(agent, task_input, task_id)],
                                        responder=responder, deadline_s=deadline_s, **timings)
    return state


async def run_crash_free_many(engine: Engine, runs: Sequence[tuple[str, Any, str | None]], *,
                              responder: Responder | None = None, deadline_s: float = 60.0,
                              **timings: Any) -> list[AgentState]:
    """Submit every ``(agent, input, task_id)`` and drive them together to their end with no
    fault armed (one worker runs them side by side: a batch costs about its slowest task).
    Returns their final states, in order."""
    failpoints.disarm()
    chosen = [await engine.submit(agent, task_input, task_id=task_id)
              for agent, task_input, task_id in runs]
    left = await drive_to_quiescence(engine, chosen, responder=responder, deadline_s=deadline_s,
                                     worker_id="crash-free",
                                     **{"concurrency": max(4, len(chosen)), **timings})
    if left:
        heads = [str((await engine.head(task_id)).status) for task_id in left]
        unfinished = dict(zip(left, heads, strict=True))
        raise AssertionError(f"crash-free runs did not finish: {unfinished}")
    return [await engine.state(task_id) for task_id in chosen]


def is_terminal(head: TaskHead) -> bool:
    """Whether the head is COMPLETED or FAILED."""
    return head.status in TERMINAL


def outcome(state: AgentState) -> dict[str, Any]:
    """The default projection compared with the crash-free run (RELIABILITY.md I8).

    Everything the agent's code decided and observed, nothing that depends on how many
    times it crashed: status, output or failure reason, messages, every call's kind, name,
    arguments hash, status and result, the plan, the environment and the token usage. Left
    out: seqs, epochs, attempts, timings and ids of the run, and the step index (a task
    resumed from CHECKPOINTED continues the checkpointed step instead of opening the next,
    so the index depends on where crashes fell).
    """
    return {
        "status": None if state.status is None else str(state.status),
        "output": state.output,
        "failure": None if state.failure is None else state.failure.reason,
        "messages": [(m.role, m.content, m.name) for m in state.messages],
        "calls": [(str(c.kind), c.name, c.args_hash, str(c.status), c.result,
                   None if c.error is None else c.error.error_type)
                  for c in state.calls.values() if not c.call_id.startswith("~")],
        "plan": sorted(state.plan), "plan_completed": sorted(state.plan_completed),
        "env": dict(state.env),
        "tokens": (state.usage.input_tokens, state.usage.output_tokens),
    }


__all__ = [
    "FAST_TIMINGS",
    "POINTS",
    "CrashReport",
    "Responder",
    "Status",
    "advance_timers",
    "connect_engine",
    "crash_at",
    "default_responder",
    "deliver_signals",
    "drive_to_quiescence",
    "expire_leases",
    "is_terminal",
    "open_database",
    "open_tasks",
    "outcome",
    "run_crash_free",
    "run_crash_free_many",
    "run_worker_until_idle",
]


async def open_database(dsn: str, *, command_timeout_s: float | None = None,
                        pool_size_max: int = 10,
                        application_name: str = "wal-engine-test",
                        tenant: str | None = None) -> Database:
    """A :class:`~wal_engine.store.Database` with its own command timeout (no schema check):
    for fake services and harness reads that must give up fast under network faults."""
    import asyncpg

    from wal_engine import limits
    from wal_engine.store import pooler as poolers
    from wal_engine.store.connection import resolve_tenant, session_settings

    tenant = resolve_tenant(tenant)
    pooler = poolers.resolve_pooler(None)  # WAL_ENGINE_POOLER, as connect() reads it
    pool = await asyncpg.create_pool(
        dsn, min_size=1, max_size=pool_size_max, timeout=limits.connect_timeout_s,
        command_timeout=command_timeout_s or limits.command_timeout_s,
        **poolers.pool_options(pooler, session_settings(tenant, application_name)))
    assert pool is not None
    return Database(pool, dsn, tenant=tenant, pooler=pooler)


async def connect_engine(dsn: str, *, command_timeout_s: float | None = None,
                         pool_size_max: int = 10, application_name: str = "wal-engine:pool",
                         payload_bytes_max: int | None = None) -> Engine:
    """An engine whose pool has its own command timeout (for network-fault tests, where
    the default of a minute would stall a test). The schema must already be in place."""
    from wal_engine import limits
    from wal_engine.engine import Engine

    database = await open_database(dsn, command_timeout_s=command_timeout_s,
                                   pool_size_max=pool_size_max,
                                   application_name=application_name)
    return Engine(database, payload_bytes_max=payload_bytes_max or limits.payload_bytes_max)
