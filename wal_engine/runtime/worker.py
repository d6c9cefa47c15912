"""Workers: claim due tasks, keep their leases, break dead workers' leases, shut down gently.

A worker runs three loops under one owner that cancels them at shutdown, and a lease
keeper on a thread of its own (:mod:`wal_engine.runtime.leases`):

* claim: one ``FOR UPDATE SKIP LOCKED`` statement per batch takes QUEUED, RESUMING and due
  WAITING tasks, bumping each lease epoch (the fencing token); woken by LISTEN/NOTIFY, a
  finished task run, or the poll interval as the fallback;
* heartbeat (the lease keeper's thread): on its own connection (so a busy pool cannot
  starve it, RELIABILITY.md D11) and its own event loop (so a blocked worker loop cannot
  stop it), one statement renews every lease the worker holds, each fenced by its epoch;
  a task missing from the answer was lost and its run is stopped at once;
* sweep: breaks leases not renewed in time (database clock): the task becomes RESUMING with
  a ``task_orphaned`` event and a NOTIFY. It sleeps until the earliest lease expiry, so a
  dead worker's task is picked up within milliseconds of its lease running out;
  With the metrics extra installed, the sweep also reads the tenant's live tasks by agent
  and version (one grouped statement, at most every ``live_tasks_refresh_sweeps`` sweep
  intervals) into the ``wal_engine_live_tasks`` gauge;
* listen: LISTEN ``wal_engine_wake`` on its own connection, reconnecting with backoff;
* schedules: fires the tenant's due schedules on its own connection, one task per tick
  (:mod:`wal_engine.runtime.schedules`), sleeping until the next tick (at most ``poll_ms``).

SIGTERM (or :meth:`Worker.stop`) stops claiming, lets every running task reach its next
durable point, hands it back (RESUMING), and returns. Past ``drain_timeout_s`` the runs are
cancelled; one inside a sync call keeps its task (lease renewed) until the call's thread
has ended, records the outcome, then hands back (``drain_waiting_on_thread``).

Plain ``def`` tools and LLM functions run on the worker's thread pool (``sync_threads``
threads), never on its event loop; the pool is shut down with the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

import asyncpg
import msgspec
import structlog

from wal_engine import failpoints
from wal_engine.errors import DatabaseError
from wal_engine.failpoints import SimulatedCrash
from wal_engine.observability import metrics
from wal_engine.observability.logs import get_logger
from wal_engine.retries import CLAIM_RETRY, RECONNECT_RETRY, retrying
from wal_engine.runtime.leases import LeaseKeeper
from wal_engine.runtime.ports import AgentRegistry, RunServices
from wal_engine.runtime.registry import (
    record_worker,
    refresh_every_s_default,
    runnable_versions,
)
from wal_engine.runtime.run import TaskRun
from wal_engine.runtime.schedules import ScheduleTicker
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.store import queries
from wal_engine.store.connection import (
    CONNECTION_ERRORS,
    UNAVAILABLE_ERRORS,
    is_outage,
    is_unavailable,
)
from wal_engine.store.queues import queue_rows_max, queue_stats, running_by_queue

log = get_logger(__name__)

WAKE_CHANNEL: Final = "wal_engine_wake"
sweep_batch_max: Final = 100
cancel_again_after_s: Final = 1.0
"""A task still running this long after its cancellation is cancelled again."""
live_tasks_refresh_sweeps: Final = 3
"""The live-tasks gauge is read at most once per this many ``sweep_ms`` (15 s by default)."""
live_statuses: Final = [status.value for status in Status if status not in TERMINAL]
tasks_by_version_rows_max: Final = 10_000
next_expiry_sql: Final = """
SELECT extract(epoch FROM min(lease_expires_at) - now()) * 1000 AS wait_ms
  FROM wal_tasks WHERE tenant = current_setting('wal.tenant', true)
   AND status IN ('RUNNING', 'CHECKPOINTED')
"""


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Timings and sizes of a worker (defaults from DESIGN.md section 6).

    Attributes:
        concurrency: Most task runs at once.
        lease_ttl_ms: A lease not renewed for this long is broken by any live worker.
        heartbeat_ms: Interval of lease renewal; must be at most a third of the TTL.
        poll_ms: Fallback claim interval when no NOTIFY arrives.
        sweep_ms: Longest wait between two sweeps for expired leases.
        drain_timeout_s: How long a graceful stop waits for runs to reach a durable point
            (then they are cancelled; a run whose sync call's thread is running keeps its
            task until that thread has ended, since the thread cannot be stopped).
        sync_threads: Threads that run plain ``def`` tools and LLM functions (0: the
            concurrency plus 4). A sync call that timed out keeps its thread until it
            returns, so the pool bounds how many of them can pile up; a call that finds
            no free thread within its ``timeout_s`` never starts (``DidNotAct``).
        stall_warn_ms: An event loop that does not answer the watchdog for this long is
            logged as stalled, with the code it is stuck in.
        stall_abandon_ms: An event loop stalled this long is presumed wedged: the worker
            stops renewing its leases, so other workers take its tasks over.
    """

    concurrency: int = 8
    lease_ttl_ms: int = 45_000
    heartbeat_ms: int = 15_000
    poll_ms: int = 1_000
    sweep_ms: int = 5_000
    drain_timeout_s: float = 30.0
    sync_threads: int = 0
    stall_warn_ms: int = 1_000
    stall_abandon_ms: int = 600_000

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.sync_threads < 0:
            raise ValueError("sync_threads must be at least 0")
        if self.stall_warn_ms < 1 or self.stall_abandon_ms < self.lease_ttl_ms:
            raise ValueError("stall_warn_ms must be positive and stall_abandon_ms at least "
                             "lease_ttl_ms")
        if self.heartbeat_ms * 3 > self.lease_ttl_ms:
            raise ValueError("heartbeat_ms must be at most lease_ttl_ms / 3 (RELIABILITY.md R6)")


class SyncPool(ThreadPoolExecutor):
    """The worker's thread pool for sync calls, counting the calls its threads run now."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._busy = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def counted() -> Any:
            with self._lock:
                self._busy += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._busy -= 1

        return super().submit(counted)

    @property
    def busy(self) -> int:
        """Calls running on a thread of the pool now (a timed-out one included)."""
        with self._lock:
            return self._busy


def new_worker_id() -> str:
    """A worker id naming the host and process, unique per start."""
    host = socket.gethostname().split(".")[0][:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """Runs tasks of the registered ``agents`` until stopped, with the engine's ``services``
    (built by :meth:`wal_engine.engine.Engine.worker`). ``agents`` is read at each claim:
    agents registered later are served too."""

    def __init__(self, services: RunServices, agents: AgentRegistry, config: WorkerConfig,
                 worker_id: str | None = None) -> None:
        self.services = services
        self.agents = agents
        self.config = config
        self.worker_id = worker_id or new_worker_id()
        self.runs: dict[str, TaskRun] = {}
        self.draining = False
        self._closing = False
        """Set when :meth:`run` ends: the background loops return at their next turn (a
        cancellation alone can be lost: Python 3.11's ``wait_for`` drops one that arrives
        as its inner await completes)."""
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._run_tasks: set[asyncio.Task[None]] = set()
        self.log = log.bind(worker_id=self.worker_id)
        self.claimed = 0
        self.queue_of: dict[str, str] = {}
        """The queue of each task this worker claimed (for the per-worker limits)."""
        self.database_ready = False
        """Whether a claim statement has been answered since the start (a worker started
        during an outage waits for the database: ``worker_database_ready``)."""
        self._outage_since: float | None = None
        """Monotonic start of the outage the claim loop is waiting out, if any."""
        self._started_at = time.monotonic()
        self.registration_every_s = refresh_every_s_default
        self._live_tasks_due = 0.0
        self.keeper = LeaseKeeper(
            dsn=services.database.dsn,
            session_settings=services.database.session_settings(
                f"wal-engine:{self.worker_id}:heartbeat"),
            lease_ttl_ms=config.lease_ttl_ms, heartbeat_ms=config.heartbeat_ms,
            stall_warn_ms=config.stall_warn_ms, stall_abandon_ms=config.stall_abandon_ms,
            on_lost=self._lease_lost, worker_id=self.worker_id,
            pooler=services.database.pooler)
        self.executor: SyncPool | None = None

    @property
    def lease_ttl_ms(self) -> int:
        """The lease TTL of this worker's claims."""
        return self.config.lease_ttl_ms

    def sync_calls_running(self) -> int:
        """Sync calls (plain ``def`` tools, LLM functions) running on the worker's threads
        now, a timed-out one included."""
        return 0 if self.executor is None else self.executor.busy

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Graceful stop: no new claims; runs hand their tasks back at a durable point.

        The runs are asked at once, not when the claim loop next wakes and drains: a run
        that reached its next call first went on past the stop (a flaky hand-back)."""
        if not self.draining:
            self.log.info("worker_draining", running=len(self.runs))
        self.draining = True
        for run in list(self.runs.values()):
            run.request_suspend()
        self._wake.set()

    async def run(self, *, install_signal_handlers: bool = False,
                  until_idle: bool = False) -> None:
        """Work until :meth:`stop` (or SIGTERM when ``install_signal_handlers``).

        With ``until_idle`` the worker returns once no task is running and none is due.
        """
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            loop.add_signal_handler(signal.SIGTERM, self.stop)
            loop.add_signal_handler(signal.SIGINT, self.stop)
        self.executor = SyncPool(
            max_workers=self.config.sync_threads or self.config.concurrency + 4,
            thread_name_prefix=f"wal-engine-sync-{self.worker_id}")
        self._started_at = time.monotonic()
        self.keeper.start()
        await self._register()
        loops = [
            asyncio.create_task(self._sweep_loop(), name="sweep"),
            asyncio.create_task(self._listen_loop(), name="listen"),
            asyncio.create_task(self._register_loop(), name="register"),
            asyncio.create_task(self._with_connection("schedules", None, ScheduleTicker(
                self.services.store, idle_s=self.config.poll_ms / 1000, log=self.log).step),
                name="schedules"),
        ]
        self.log.info("worker_started", concurrency=self.config.concurrency)
        try:
            await self._claim_loop(until_idle)
            await self._drain()
        finally:
            # A worker that ends without draining (cancelled) takes its runs with it: left
            # running, they would go on with no keeper renewing their leases and no thread
            # pool for their sync calls (which would fail as if the tool had).
            self._closing = True
            for run in self.runs.values():
                run.stop_forced = True
            runs = list(self._run_tasks)
            for task in runs:
                task.cancel()
            await _cancel_until_done(loops)
            await asyncio.gather(*runs, return_exceptions=True)
            await asyncio.to_thread(self.keeper.stop)
            # A run keeps its task while its sync call's thread runs, even through a
            # drain; one still running here belongs to a run cancelled twice (a forced
            # stop): its task is left to lease expiry, as in a crash. It is not waited for
            # here (it cannot be interrupted), but Python waits for it before the process
            # exits: the CLI's forced stop exits at once instead (sync_calls_running).
            running_calls = self.sync_calls_running()
            if running_calls:
                self.log.warning("worker_stopped_with_sync_calls_running",
                                 running=running_calls)
            self.executor.shutdown(wait=False, cancel_futures=True)
            if install_signal_handlers:
                loop.remove_signal_handler(signal.SIGTERM)
                loop.remove_signal_handler(signal.SIGINT)
            self._stopped.set()
            self.log.info("worker_stopped", claimed=self.claimed)

    async def _register(self) -> None:
        """Record which agents this worker serves (advisory: ``submit`` warns about an
        agent no worker serves); a database outage does not stop the worker starting."""
        try:
            await record_worker(self.services.database, self.worker_id, self.agents)
        except (*UNAVAILABLE_ERRORS, DatabaseError) as error:
            self.log.warning("worker_registration_failed", error=repr(error))

    async def _register_loop(self) -> None:
        """Record the agents again every ``registration_every_s`` (the registration is
        read as recent for a day only; agents registered since the start are included)."""
        while not self._closing:
            await asyncio.sleep(self.registration_every_s)
            await self._register()

    async def _drain(self) -> None:
        if not self._run_tasks:
            return
        self.draining = True
        for run in list(self.runs.values()):
            run.request_suspend()
        _, pending = await asyncio.wait(set(self._run_tasks),
                                           timeout=self.config.drain_timeout_s)
        # Cancelled once: a run waiting on its sync call's thread goes on waiting (a second
        # cancellation is a forced stop, which leaves the task to lease expiry).
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # ------------------------------------------------------------------ claims

    async def _claim_loop(self, until_idle: bool) -> None:
        poll_s = self.config.poll_ms / 1000
        while not self.draining:
            self._wake.clear()
            free = self.config.concurrency - len(self.runs)
            claimed: int | None = 0
            if free > 0:
                claimed = await self._guarded(functools.partial(self._claim, free))
            # Idle only when the database said so: a worker started during an outage (or
            # caught by one) waits for it rather than returning as if there were no work.
            if until_idle and claimed == 0 and not self.runs:
                return
            if claimed is not None and claimed == free and free > 0:
                continue  # There may be more due work: claim again at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), poll_s)

    async def _claim(self, free: int) -> int:
        sent_at = time.monotonic()
        agents, versions = runnable_versions(self.agents)
        # The queues' per-worker limits count this worker's runs, which it tells the claim.
        self.queue_of = {task: queue for task, queue in self.queue_of.items()
                         if task in self.runs}
        queues, running = running_by_queue(self.queue_of, set(self.runs))
        rows = await self.services.database.fetch(
            queries.CLAIM_TASKS_BY_QUEUE, self.worker_id, free, self.config.lease_ttl_ms,
            agents, versions, queues, running,
        )
        for row in rows:
            self.queue_of[row["task_id"]] = row["queue"]
            self.keeper.hold(row["task_id"], row["lease_epoch"], sent_at)
            self._start_run(row)
        self.claimed += len(rows)
        metrics.tasks_claimed(len(rows))
        for row in rows:
            metrics.task_claimed_at_version(row["agent"], row["agent_version"])
            metrics.claimed_in_queue(row["queue"])
        return len(rows)

    def _start_run(self, row: Any) -> None:
        run = TaskRun(self.services, self, row, self.agents.get(row["agent"]))
        self.runs[run.task_id] = run
        task = asyncio.create_task(self._execute(run), name=f"task:{run.task_id}")
        self._run_tasks.add(task)
        task.add_done_callback(self._run_tasks.discard)

    async def _execute(self, run: TaskRun) -> None:
        structlog.contextvars.bind_contextvars(**run.log.context, seq=run.head_seq)
        try:
            failpoints.hit("after_claim")
            await run.execute()
        except SimulatedCrash as crash:
            # The worker 'died' for this task: no cleanup write; its lease will expire.
            run.log.warning("simulated_crash", point=str(crash))
            run.leased = False
        except UNAVAILABLE_ERRORS as error:
            # The database went away where the run could not wait for it (its lease no
            # longer trusted, a hand-back that did not land): an outage, not a crash of
            # the run. The task is the next owner's once its lease expires.
            run.log.warning("task_run_lost_connection", error=_error_text(error),
                            reason="the database is unavailable; the task is left to its "
                                   "lease")
        except Exception:
            run.log.exception("task_run_crashed")
        finally:
            await run.settle_snapshot()
            self.runs.pop(run.task_id, None)
            self.keeper.drop(run.task_id)
            self._wake.set()

    async def _guarded(self, work: Callable[[], Awaitable[int]]) -> int | None:
        """Run one statement of a loop, a few times (CLAIM_RETRY); a database outage is
        then left to the loop's next poll, not fatal (None: the database did not answer)."""
        try:
            result = await retrying(CLAIM_RETRY, work, retry_if=_outage, key=self.worker_id,
                                    on_retry=self._statement_failed)
        except (*UNAVAILABLE_ERRORS, DatabaseError) as error:
            self._statement_failed(error, CLAIM_RETRY.attempts_max or 1, 0.0)
            return None
        self._database_answered()
        return result

    def _statement_failed(self, error: BaseException, attempt: int, delay_s: float) -> None:
        """One failed claim statement: the first of an outage is a warning (what it is),
        the others while it lasts are debug lines (not one warning per poll)."""
        if not is_outage(error):  # A refusal (a revoked privilege): each one a warning.
            self.log.warning("worker_statement_failed", error=repr(error), attempt=attempt,
                             delay_s=round(delay_s, 3))
            return
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self.log.warning("worker_database_unavailable", error=_error_text(error),
                             running=len(self.runs), ready=self.database_ready)
        self.log.debug("worker_statement_failed", error=repr(error), attempt=attempt,
                       delay_s=round(delay_s, 3))

    def _database_answered(self) -> None:
        """A claim statement was answered: the first one (``worker_database_ready``), or
        the first after an outage (``worker_database_back``)."""
        now = time.monotonic()
        if not self.database_ready:
            self.database_ready = True
            self.log.info("worker_database_ready", waited_s=round(now - self._started_at, 3),
                          dsn=self.services.database.dsn_redacted)
        elif self._outage_since is not None:
            self.log.info("worker_database_back", outage_s=round(now - self._outage_since, 3),
                          running=len(self.runs))
        self._outage_since = None

    # ------------------------------------------------------------------ leases

    def _lease_lost(self, task_id: str, epoch: int) -> None:
        """The keeper found the lease of ``task_id`` at ``epoch`` taken over."""
        run = self.runs.get(task_id)
        # A run whose append gives the lease up (a wait, say) may hear of it from the
        # keeper before the append's answer: that is no other owner, and fencing it would
        # drop the run's last look for a signal that raced with its wait.
        if run is not None and run.leased and not run.leaving_lease and run.epoch == epoch:
            run.fence("lease not renewed: another worker owns the task")

    def lease_valid(self, task_id: str, epoch: int) -> bool:
        """Whether this worker may still trust its lease (its own clock, no round trip)."""
        return self.keeper.valid(task_id, epoch)

    async def _sweep_loop(self) -> None:
        await self._with_connection("sweep", None, self._sweep)

    async def _sweep(self, connection: asyncpg.Connection) -> float:
        rows = await connection.fetch(queries.BREAK_LEASES, sweep_batch_max)
        for row in rows:
            self.log.warning("lease_broken", task_id=row["task_id"],
                             previous_owner=row["previous_owner"],
                             previous_epoch=row["previous_epoch"])
        metrics.tasks_orphaned(len(rows))
        if rows:
            self._wake.set()
        await self._read_live_tasks(connection)
        wait_ms = await connection.fetchval(next_expiry_sql)
        ceiling_s = self.config.sweep_ms / 1000
        if wait_ms is None:
            return ceiling_s
        return max(0.001, min(ceiling_s, float(wait_ms) / 1000 + 0.001))

    async def _read_live_tasks(self, connection: asyncpg.Connection) -> None:
        """Refresh the live-tasks gauge when it is due (never without the metrics extra)."""
        if not metrics.available() or time.monotonic() < self._live_tasks_due:
            return
        self._live_tasks_due = (time.monotonic()
                                + live_tasks_refresh_sweeps * self.config.sweep_ms / 1000)
        rows = await connection.fetch(queries.TASKS_BY_VERSION, tasks_by_version_rows_max,
                                      live_statuses)
        metrics.live_tasks_read(self.services.database.tenant, rows)
        metrics.queues_read(self.services.database.tenant, queue_stats(
            await connection.fetch(queries.QUEUE_STATS, queue_rows_max)))

    async def _listen_loop(self) -> None:
        if not self.services.database.listens:
            # A transaction pooler hands each transaction any server connection: a LISTEN
            # there hears nothing (docs/pgbouncer.md). Claims come every poll_ms instead.
            self.log.warning("listen_off_polling", pooler=self.services.database.pooler,
                             poll_ms=self.config.poll_ms,
                             fix="pass listen_dsn= (a direct DSN) to connect()")
            return

        async def listen(connection: asyncpg.Connection) -> None:
            closed = asyncio.Event()
            connection.add_termination_listener(lambda *_: closed.set())
            await connection.add_listener(WAKE_CHANNEL, self._on_notify)
            self._wake.set()  # Catch up on anything that became due while not listening.
            # Wait for the stop, or for the session to die (terminated, server restarted):
            # an idle LISTEN session sends nothing, so nothing else would notice.
            waits = [asyncio.ensure_future(self._stopped.wait()),
                     asyncio.ensure_future(closed.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            if closed.is_set() and not self._stopped.is_set():
                raise ConnectionError("the LISTEN session was closed")

        await self._with_connection("listen", None, listen)

    def _on_notify(self, _connection: object, _pid: object, _channel: object,
                   payload: object) -> None:
        # Another tenant's wake-up (same channel, its own token) is not ours to act on.
        if payload in (self.services.wake_token, ""):
            self._wake.set()

    async def _with_connection(
        self, role: str, interval_s: float | None,
        step: Callable[[asyncpg.Connection], Awaitable[Any]],
    ) -> None:
        """Run ``step`` forever on a dedicated connection, reconnecting with backoff.

        ``step`` returns the seconds to wait before its next call, or None to use
        ``interval_s``.
        """
        database = self.services.database
        name = f"wal-engine:{self.worker_id}:{role}"

        def connect_failed(error: BaseException, attempt: int, delay_s: float) -> None:
            self.log.warning("worker_connect_failed", role=role, error=repr(error),
                             attempt=attempt, delay_s=round(delay_s, 3))

        while not self._closing:
            connection = await retrying(
                RECONNECT_RETRY,
                lambda: database.connect_session(name, listen=role == "listen"),
                retry_if=_outage, key=f"{self.worker_id}:{role}", on_retry=connect_failed)
            try:
                while not self._closing:
                    wait_s = await step(connection)
                    await asyncio.sleep(wait_s if isinstance(wait_s, float) else interval_s or 1.0)
            except (*CONNECTION_ERRORS, asyncpg.PostgresError) as error:
                self.log.warning("worker_connection_lost", role=role, error=repr(error))
            except Exception as error:
                # The loop must outlive any error (asyncpg's InternalClientError on a session
                # terminated mid-statement, for one): a dead heartbeat or sweep loop leaves
                # leases unrenewed or expired leases unbroken for good.
                self.log.error("worker_loop_failed", role=role, error=repr(error))
                await asyncio.sleep(RECONNECT_RETRY.initial_delay_s)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(connection.close(), 2)


async def _cancel_until_done(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel the background loops ``tasks`` and wait until each has ended, cancelling again
    those still running after a while: a cancellation can be lost (Python 3.11's ``wait_for``
    drops one that arrives as its inner await completes), and a loop that lost it would run
    on forever (a worker's stop then never returned). Not for runs: a run cancelled twice is
    stopped by force."""
    pending = set(tasks)
    rounds = 0
    while pending:
        if rounds:
            log.info("worker_task_cancelled_again", tasks=sorted(t.get_name() for t in pending),
                     round=rounds)
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=cancel_again_after_s)
        rounds += 1


def _error_text(error: BaseException) -> str:
    """``error`` as one line: its type and message, and its cause's."""
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__
    if cause is not None and type(cause).__name__ not in text:
        text += f" (from {type(cause).__name__}: {cause})"
    return " ".join(text.split())


def _outage(error: BaseException) -> bool:
    """A database outage, or a SQL error of the engine's own loop statements (waited out)."""
    return is_unavailable(error) or isinstance(error, DatabaseError | asyncpg.PostgresError)
