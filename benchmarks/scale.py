"""Scale benchmark (issue 23): how each cost grows with months of history.

``python -m benchmarks.scale [--tasks N] [--events M]`` starts its own embedded PostgreSQL
(``--data-dir``, default a temporary directory on the disk; ``--admin-dsn`` borrows a
server instead, e.g. a test's), creates two databases on it, ``scale_empty`` (a fixture
the size of one benchmark's tasks) and ``scale_filled`` (``--tasks`` tasks and ``--events``
events written by COPY with valid hash chains: mostly COMPLETED tool-step tasks spread
over 90 days, 100,000 QUEUED and 10,000 WAITING on timers, at most a tenth and a hundredth
of the tasks), reports the fill time and the disk used, and then measures, on both
databases in the same run, interleaved round by round:

* ``append_new`` / ``append_old``: one tool step's two appends (intent, result) on a task
  created now and on a 1,000-step task created 90 days ago;
* ``claim``: one claim (``wal_claim_tasks``, limit 1) with the queue described above;
  ``claim_other``: a claim by a worker of other agents, which finds nothing due;
* ``heartbeat_1/100/1000``: the renewal statement for that many leases of one worker;
* ``sweep_idle``: the sweeper's statement when nothing expired; ``sweep_1000``: all its
  statements (batches of the worker's ``sweep_batch_max``) after 1,000 leases expired;
* ``resume_1000``: the read and fold of a 1,000-step task (no snapshot); ``verify``: the
  verification of that task; ``list_page``: one page of 50 of ``tasks`` filtered by
  status and agent, walking pages; ``list_running``: the same for the RUNNING tasks (the
  1,000 leases), a rare status among the finished ones;
* ``timers``: ``--timers`` tasks sleeping until the same moment, 4 worker processes: the
  time from that moment until none is WAITING and until all completed their next step,
  and the workers' RSS with none of their tasks waiting, with all asleep, and after;
* ``workers``: ``--running`` tasks stepping in 1, 2 and 4 worker processes (their sum
  holding all of them), with the timers' tasks still WAITING in the database: steps/s,
  RSS and CPU per step of each process, its event-loop thread's share of the window on a
  CPU and waiting for one, and the batched-insert ceiling of the same run (``executemany``
  of 1,000 rows per transaction into a table of the log's shape, rows of the workers'
  size); ``--gc-young N`` measures each process count again with the garbage collector's
  first threshold at N (docs/architecture.md, decision 72);
* ``cpu_step``: client CPU per tool step, wal-engine vs the raw two-INSERT reference
  (:mod:`benchmarks.cpu_step`).

Results go to ``benchmarks/results/scale_<tasks>.json`` (``--json`` to choose) with the
machine header, each measure's p50/p99 on both databases and the filled/empty ratio, and
the issue's targets marked met or missed. Not part of CI; a smoke run at a tiny size is
(tests/integration/test_benchmark_scale_smoke.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import asyncpg

from benchmarks import cpu_step, harness
from wal_engine import events as vocabulary
from wal_engine.chain import GENESIS_HASH, event_hash_v2
from wal_engine.embedded import EmbeddedPostgres
from wal_engine.engine import Engine, connect
from wal_engine.ids import new_task_id
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.resume import read_state
from wal_engine.runtime.worker import sweep_batch_max
from wal_engine.store import queries
from wal_engine.store.connection import apply_schema, with_database

NAME: Final = "scale"
REPO: Final = Path(__file__).resolve().parents[1]
TENANT: Final = "default"
FILL_AGENT: Final = "scale"
def _old_task_id() -> str:
    """The 1,000-step task's id: time-ordered like the engine's (``new_task_id``'s layout),
    minted 90 days before today's midnight (UTC), so it falls in its month's partition
    (decision 70) and every process of one run names it alike."""
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    millis = int((today - dt.timedelta(days=90)).timestamp() * 1000)
    return f"t-{(millis << 80) | (0x7 << 76) | (0b10 << 62):032x}"


OLD_TASK: Final = _old_task_id()
FILL_SPAN_DAYS: Final = 90
OLD_STEPS: Final = 1000
HEARTBEAT_AGENT: Final = "scale_hb"
HEARTBEAT_WORKER: Final = "scale-hb"
HEARTBEAT_LEASES: Final = 1000
LEASE_TTL_MS: Final = 3_600_000
COPY_BATCH: Final = 50_000
LIST_PAGE: Final = 50
TIMER_AGENT: Final = "scale_timer"
LOOP_AGENT: Final = "scale_loop"
TIMER_WORKERS: Final = 4
CEILING_ROWS: Final = 1000
PAYLOAD_PAD: Final = "x" * 300
TARGET_RATIO: Final = 1.25

EVENT_COLUMNS: Final = ("tenant", "task_id", "seq", "type", "version", "epoch", "payload",
                        "idempotency_key", "hash", "recorded_at", "chain_version")
TASK_COLUMNS: Final = ("tenant", "task_id", "agent", "status", "head_seq", "head_hash",
                       "lease_owner", "lease_epoch", "lease_expires_at", "wake_at", "attempts",
                       "created_at", "started_at", "updated_at")


# ----------------------------------------------------------------------------- fill


def _encoded(event: vocabulary.Event) -> tuple[str, int, bytes]:
    return vocabulary.encode_event(event)


def _templates() -> dict[str, tuple[str, int, bytes]]:
    return {
        "submitted": _encoded(vocabulary.TaskSubmitted(agent=FILL_AGENT, input={"n": 1})),
        "claimed": _encoded(vocabulary.TaskClaimed(worker_id="scale-filler")),
        "timer": _encoded(vocabulary.TimerStarted(timer_id="sleep-1", wake_at_ms=0,
                                                  duration_ms=30 * 86_400_000)),
        "done": _encoded(vocabulary.TaskCompleted(output="done")),
    }


def _step_payloads(step: int) -> tuple[tuple[str, int, bytes], tuple[str, int, bytes]]:
    """The intent and the result of tool step ``step`` (call ids are unique in a task)."""
    call_id = f"tool-{step}"
    return (_encoded(vocabulary.ToolCallIntended(
                call_id=call_id, tool="work", args={"message": PAYLOAD_PAD},
                args_hash="0" * 64, idempotency_key=f"scale-key-{step}")),
            _encoded(vocabulary.ToolCallCompleted(call_id=call_id,
                                                  result={"result": PAYLOAD_PAD})))


class Filler:
    """Rows of tasks with valid chains, for COPY."""

    def __init__(self, base: dt.datetime) -> None:
        self.base = base
        self.templates = _templates()
        self.steps: list[tuple[tuple[str, int, bytes], tuple[str, int, bytes]]] = []
        self.events: list[tuple[Any, ...]] = []
        self.tasks: list[tuple[Any, ...]] = []

    def task(self, task_id: str, created: dt.datetime, kind: str, steps: int) -> None:
        """One task: ``queued`` (submitted), ``waiting`` (claimed, timer started),
        ``running`` (claimed, ``steps`` tool steps, leased) or ``done`` (steps, completed)."""
        while len(self.steps) < steps:
            self.steps.append(_step_payloads(len(self.steps)))
        rows = [self.templates["submitted"]]
        if kind != "queued":
            rows.append(self.templates["claimed"])
            for step in range(steps):
                rows.extend(self.steps[step])
        if kind == "waiting":
            rows.append(self.templates["timer"])
        elif kind == "done":
            rows.append(self.templates["done"])
        prev = GENESIS_HASH
        stamp = created
        for seq, (kind_name, version, payload) in enumerate(rows, start=1):
            epoch = 0 if seq == 1 else 1
            digest = event_hash_v2(prev, task_id, seq, kind_name, version, epoch, stamp, None,
                                   payload)
            self.events.append((TENANT, task_id, seq, kind_name, version, epoch, payload, None,
                                digest, stamp, 2))
            prev = digest
        status = {"queued": "QUEUED", "waiting": "WAITING", "running": "RUNNING",
                  "done": "COMPLETED"}[kind]
        leased = kind == "running"
        self.tasks.append((
            TENANT, task_id, FILL_AGENT, status, len(rows), prev,
            "scale-old-worker" if leased else None, 0 if kind == "queued" else 1,
            self.base + dt.timedelta(days=365) if leased else None,
            self.base + dt.timedelta(days=30) if kind == "waiting" else None,
            0 if kind == "queued" else 1, created,
            None if kind == "queued" else created, created,
        ))

    async def flush(self, connection: asyncpg.Connection, force: bool = False) -> None:
        """COPY what is buffered once it is large (or ``force``)."""
        if not force and len(self.events) < COPY_BATCH:
            return
        if self.tasks:
            await connection.copy_records_to_table("wal_tasks", records=self.tasks,
                                                   columns=TASK_COLUMNS)
        if self.events:
            await connection.copy_records_to_table("wal_events", records=self.events,
                                                   columns=EVENT_COLUMNS)
        self.tasks, self.events = [], []


def plan(tasks: int, events: int, queued: int | None = None) -> dict[str, int]:
    """How many tasks of each kind, and the steps of the finished ones, for the sizes."""
    queued = min(100_000, tasks // 10) if queued is None else queued
    waiting = min(10_000, tasks // 100)
    done = max(0, tasks - queued - waiting - 1)
    rest = events - queued - 3 * waiting - (2 + 2 * OLD_STEPS)
    per_done = max(3, rest // max(1, done))
    steps = max(0, (per_done - 3) // 2)
    # The rest of the events, two per step, as one more step on the first finished tasks:
    # the fill holds at least the events asked for (9,921,991 of 10,000,000 without it).
    short = rest - done * (3 + 2 * steps)
    return {"queued": queued, "waiting": waiting, "done": done, "done_steps": steps,
            "done_extra": min(done, max(0, -(-short // 2)))}


async def fill(dsn: str, tasks: int, events: int, *, queued: int | None = None) -> dict[str, Any]:
    """Fill a database with the schema applied: the plan's tasks and the old task."""
    layout = plan(tasks, events, queued)
    started = time.monotonic()
    base = dt.datetime.now(dt.UTC)
    filler = Filler(base)
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("SET session_replication_role = replica")  # no triggers
        span_s = FILL_SPAN_DAYS * 86_400
        total = layout["done"] + layout["waiting"] + layout["queued"]
        # The month partitions of the span (decision 70): the engine creates this month's
        # and the next ones; a fill dated back needs the past months too.
        await connection.fetchval(
            "SELECT count(*) FROM wal_ensure_partitions($1, $2)",
            FILL_SPAN_DAYS // 28 + 2, base - dt.timedelta(days=FILL_SPAN_DAYS + 1))
        filler.task(OLD_TASK, base - dt.timedelta(days=FILL_SPAN_DAYS), "running", OLD_STEPS)
        index = 0
        for kind in ("done", "waiting", "queued"):
            for _ in range(layout[kind]):
                # Finished tasks are the oldest; the queue and the waiting tasks the newest.
                # Ids are time-ordered as the engine mints them, so each task's rows land
                # in its creation month's partition.
                created = base - dt.timedelta(seconds=span_s * (1 - index / max(1, total)))
                steps = layout["done_steps"] + (index < layout["done_extra"]) \
                    if kind == "done" else 0
                filler.task(new_task_id(int(created.timestamp() * 1000)), created, kind, steps)
                index += 1
                await filler.flush(connection)
        await filler.flush(connection, force=True)
        await connection.execute("RESET session_replication_role")
        # What wal_count_task would have kept (the trigger was skipped).
        await connection.execute(
            "INSERT INTO wal_tenants (tenant, tasks) SELECT $1, count(*) FROM wal_tasks"
            " WHERE tenant = $1 ON CONFLICT (tenant) DO UPDATE SET tasks = excluded.tasks",
            TENANT)
        copied_s = time.monotonic() - started
        await connection.execute("VACUUM ANALYZE wal_tasks")
        await connection.execute("VACUUM ANALYZE wal_events")
        sizes = await connection.fetchrow(
            "SELECT pg_database_size(current_database()) AS database,"
            # A partitioned table's own size is 0: its partitions hold the rows.
            " (SELECT sum(pg_total_relation_size(relid))::int8"
            "    FROM pg_partition_tree('wal_events')) AS events,"
            " pg_total_relation_size('wal_tasks') AS tasks,"
            " (SELECT count(*) FROM wal_events) AS event_rows,"
            " (SELECT count(*) FROM wal_tasks) AS task_rows")
    finally:
        await connection.close()
    return {**layout, "copy_s": round(copied_s, 1),
            "fill_s": round(time.monotonic() - started, 1),
            "database_bytes": sizes["database"], "events_bytes": sizes["events"],
            "tasks_bytes": sizes["tasks"], "event_rows": sizes["event_rows"],
            "task_rows": sizes["task_rows"]}


# ----------------------------------------------------------------------------- measures


class Side:
    """One database under measurement: its engine and the fixtures the measures use."""

    def __init__(self, label: str, dsn: str, engine: Engine) -> None:
        self.label, self.dsn, self.engine = label, dsn, engine
        self.store = engine.store
        self.new_head: harness.LocalHead | None = None
        self.old_head: harness.LocalHead | None = None
        self.leases: list[tuple[str, int]] = []
        self.page_after = ""
        self.running_after = ""

    async def prepare(self) -> None:
        """A new claimed task, the old task's head, 1,000 leases of one worker."""
        (self.new_head,) = await harness.create_claimed_tasks(
            self.store, [f"scale-new-{time.monotonic_ns()}"], worker="scale-new")
        row = await self.store.database.fetchrow(
            "SELECT seq, hash, epoch FROM wal_events WHERE tenant = $1 AND task_id = $2"
            " ORDER BY seq DESC LIMIT 1", TENANT, OLD_TASK)
        self.old_head = harness.LocalHead(OLD_TASK, row["epoch"], row["seq"], row["hash"])
        for start in range(0, HEARTBEAT_LEASES, 100):
            await asyncio.gather(*(self.store.create_task(f"scale-hb-{i:05d}", HEARTBEAT_AGENT)
                                   for i in range(start, start + 100)))
        await self.claim_leases()

    async def claim_leases(self) -> None:
        rows = await self.store.database.fetch(
            "SELECT task_id, lease_epoch FROM wal_claim_tasks($1, $2, $3, ARRAY[$4])",
            HEARTBEAT_WORKER, HEARTBEAT_LEASES, LEASE_TTL_MS, HEARTBEAT_AGENT)
        self.leases = sorted((r["task_id"], r["lease_epoch"]) for r in rows)
        assert len(self.leases) == HEARTBEAT_LEASES, len(self.leases)

    async def step(self, head: harness.LocalHead, samples: list[int]) -> None:
        """One tool step: the intent's append, then the result's, each timed."""
        n = head.seq
        for event in (vocabulary.ToolCallIntended(
                          call_id=f"s{n}", tool="work", args={"message": PAYLOAD_PAD},
                          args_hash="0" * 64, idempotency_key=f"{head.task_id}:{n}"),
                      vocabulary.ToolCallCompleted(call_id=f"s{n}",
                                                   result={"result": PAYLOAD_PAD})):
            start = time.perf_counter_ns()
            result = await self.store.append_events(head.task_id, [event], epoch=head.epoch,
                                                    expected_seq=head.seq, prev_hash=head.hash)
            samples.append(time.perf_counter_ns() - start)
            head.seq, head.hash = result.head_seq, result.head_hash


async def _timed(call: Callable[[], Awaitable[Any]]) -> int:
    start = time.perf_counter_ns()
    await call()
    return time.perf_counter_ns() - start


async def measure_side(side: Side, measure: str, ops: int) -> list[int]:
    """``ops`` samples (ns) of ``measure`` on ``side``."""
    db = side.store.database
    samples: list[int] = []
    if measure in ("append_new", "append_old"):
        head = side.new_head if measure == "append_new" else side.old_head
        assert head is not None
        for _ in range(max(1, ops // 2)):
            await side.step(head, samples)
    elif measure == "claim":
        for _ in range(ops):
            samples.append(await _timed(lambda: db.fetch(
                queries.CLAIM_TASKS, "scale-claimer", 1, LEASE_TTL_MS, [FILL_AGENT], None)))
    elif measure == "claim_other":
        # A worker whose agents have nothing due while another agent's queue is long:
        # its claims find nothing, and should not read that queue to find it.
        for _ in range(ops):
            samples.append(await _timed(lambda: db.fetch(
                queries.CLAIM_TASKS, "scale-claimer", 1, LEASE_TTL_MS,
                [TIMER_AGENT, LOOP_AGENT], None)))
    elif measure.startswith("heartbeat_"):
        held = side.leases[:int(measure.split("_")[1])]
        ids, epochs = [t for t, _ in held], [e for _, e in held]
        for _ in range(ops):
            samples.append(await _timed(lambda: _renew(db, ids, epochs)))
    elif measure == "sweep_idle":
        for _ in range(ops):
            samples.append(await _timed(lambda: db.fetch(queries.BREAK_LEASES,
                                                         sweep_batch_max)))
    elif measure == "sweep_1000":
        await db.fetch(
            "UPDATE wal_tasks SET lease_expires_at = now() - interval '1 second'"
            " WHERE tenant = $1 AND lease_owner = $2", TENANT, HEARTBEAT_WORKER)
        start = time.perf_counter_ns()
        broken = 0
        while True:
            rows = await db.fetch(queries.BREAK_LEASES, sweep_batch_max)
            if not rows:
                break
            broken += len(rows)
        samples.append(time.perf_counter_ns() - start)
        assert broken == HEARTBEAT_LEASES, broken
        await side.claim_leases()
    elif measure == "resume_1000":
        for _ in range(ops):
            samples.append(await _timed(lambda: read_state(side.store, OLD_TASK,
                                                           use_snapshot=False)))
    elif measure == "verify":
        for _ in range(ops):
            samples.append(await _timed(lambda: _verify(side)))
    elif measure == "list_page":
        for _ in range(ops):
            start = time.perf_counter_ns()
            page = await side.store.list_tasks(status="COMPLETED", agent=FILL_AGENT,
                                               after_task_id=side.page_after, limit=LIST_PAGE)
            samples.append(time.perf_counter_ns() - start)
            side.page_after = page[-1].task_id if len(page) == LIST_PAGE else ""
    elif measure == "list_running":
        # A rare status among many finished tasks (the 1,000 leases held for the heartbeats).
        for _ in range(ops):
            start = time.perf_counter_ns()
            page = await side.store.list_tasks(status="RUNNING", after_task_id=side.running_after,
                                               limit=LIST_PAGE)
            samples.append(time.perf_counter_ns() - start)
            side.running_after = page[-1].task_id if len(page) == LIST_PAGE else ""
    else:
        raise ValueError(measure)
    return samples


async def _renew(db: Any, ids: list[str], epochs: list[int]) -> None:
    rows = await db.fetch(queries.RENEW_LEASES, ids, epochs, LEASE_TTL_MS)
    assert len(rows) == len(ids), (len(rows), len(ids))


async def _verify(side: Side) -> None:
    report = await side.store.verify_task(OLD_TASK)
    assert report.ok, report


LATENCY_MEASURES: Final = ("append_new", "append_old", "claim", "claim_other", "heartbeat_1",
                           "heartbeat_100", "heartbeat_1000", "sweep_idle", "sweep_1000",
                           "resume_1000", "verify", "list_page", "list_running")


async def latencies(sides: list[Side], rounds: int, ops: int) -> dict[str, Any]:
    """Every latency measure on every side, interleaved: round r starts with side r mod 2."""
    out: dict[str, Any] = {}
    for measure in LATENCY_MEASURES:
        per_side: dict[str, list[int]] = {side.label: [] for side in sides}
        count = max(3, ops // 10) if measure in ("resume_1000", "verify") else ops
        for round_index in range(rounds):
            order = sides[round_index % 2:] + sides[:round_index % 2]
            for side in order:
                await measure_side(side, measure, 2)  # warm-up (connections, plans)
                per_side[side.label].extend(await measure_side(side, measure, count))
        out[measure] = _compare(per_side)
        print(f"  {measure}: {_line(out[measure])}", flush=True)
    return out


def _stats(samples: list[int]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(ordered), "p50_us": round(statistics.median(ordered) / 1000, 1),
            "p99_us": round(harness.percentile(ordered, 99) / 1000, 1)}


def _compare(per_side: dict[str, list[int]]) -> dict[str, Any]:
    figures = {label: _stats(samples) for label, samples in per_side.items()}
    ratio = figures["filled"]["p50_us"] / max(0.1, figures["empty"]["p50_us"])
    return {**figures, "p50_ratio": round(ratio, 2), "target_met": ratio <= TARGET_RATIO}


def _line(figure: dict[str, Any]) -> str:
    e, f = figure["empty"], figure["filled"]
    return (f"empty p50 {e['p50_us']:,.0f} µs p99 {e['p99_us']:,.0f} µs | filled p50 "
            f"{f['p50_us']:,.0f} µs p99 {f['p99_us']:,.0f} µs | ratio {figure['p50_ratio']:.2f}x"
            f" {'met' if figure['target_met'] else 'MISSED'}")


# ----------------------------------------------------------------------------- workers


def register(engine: Engine) -> None:
    """The agents the worker processes run: a timer sleeper and a stepping loop."""

    async def tool(args: Any) -> Any:
        # A coroutine, as in the suite: a plain def runs on the worker's thread pool, a hop
        # of its own per call (measured by benchmarks.sync_tools) that grew the pool to
        # hundreds of threads here; this measures the log's cost per step.
        return {"result": PAYLOAD_PAD}

    @engine.agent(TIMER_AGENT)
    async def timer(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.sleep(3600)  # Made due by the benchmark (wake_at), all at one moment.
        await ctx.tool("work", tool, {"message": PAYLOAD_PAD})
        return "woken"

    @engine.agent(LOOP_AGENT)
    async def loop(ctx: AgentContext, task_input: Any) -> Any:
        for _ in range(task_input["steps"]):
            await ctx.tool("work", tool, {"message": PAYLOAD_PAD})
        return "done"


async def run_worker(dsn: str, worker_id: str, concurrency: int, gc_young: int = 0) -> None:
    """(Child process) A worker running the benchmark's agents until SIGTERM.
    ``gc_young``: the collector's first threshold (0: the interpreter's 700), the older
    two set to 20 (decision 72)."""
    if gc_young:
        gc.set_threshold(gc_young, 20, 20)
    engine = await connect(dsn, migrate=False, development=True)
    register(engine)
    worker = engine.worker(concurrency=concurrency, worker_id=worker_id, poll_ms=100,
                           sweep_ms=60_000, lease_ttl_ms=120_000, heartbeat_ms=30_000,
                           drain_timeout_s=5.0)
    print("ready", flush=True)
    await worker.run(install_signal_handlers=True)
    await engine.close()


class Workers:
    """Worker processes started by the benchmark (stopped by their pid)."""

    def __init__(self, dsn: str, count: int, concurrency: int, tag: str,
                 gc_young: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "WAL_ENGINE_LOG_LEVEL": "warning"}
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.scale", "--worker", dsn,
                 f"scale-{tag}-{i}", str(concurrency), "--gc-young", str(gc_young)],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            for i in range(count)
        ]
        for process in self.processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if b"ready" not in line:
                self.stop()
                raise RuntimeError(f"a worker process did not start: {line!r}")

    def cpu_s(self) -> list[float]:
        ticks = os.sysconf("SC_CLK_TCK")
        out = []
        for process in self.processes:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / ticks)
        return out

    def sched_s(self) -> list[tuple[float, float]]:
        """Per process, its main (event-loop) thread's time on a CPU and time waiting for
        one (runnable but not running), in seconds (``/proc/<pid>/schedstat``)."""
        out = []
        for process in self.processes:
            on_cpu, waiting, _slices = Path(f"/proc/{process.pid}/schedstat").read_text().split()
            out.append((int(on_cpu) / 1e9, int(waiting) / 1e9))
        return out

    def rss_mib(self) -> list[float]:
        out = []
        for process in self.processes:
            for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out.append(round(int(line.split()[1]) / 1024, 1))
        return out

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def _value(db: Any, query: str, *args: Any) -> Any:
    row = await db.fetchrow(query, *args)
    return None if row is None else row[0]


async def _until(probe: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not await probe():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def _submit_many(engine: Engine, agent: str, count: int, task_input: Any,
                       prefix: str) -> list[str]:
    ids: list[str] = []
    for start in range(0, count, 100):
        ids.extend(await asyncio.gather(*(
            engine.submit(agent, task_input, task_id=f"{prefix}-{i:06d}")
            for i in range(start, min(count, start + 100)))))
    return ids


async def timers(side: Side, count: int, timeout_s: float) -> dict[str, Any]:
    """``count`` sleeping tasks made due at one moment; 4 worker processes wake them."""
    db = side.store.database
    tag = f"t{time.monotonic_ns() % 10**8}"
    # The workers first, so that their RSS is read with no task of theirs waiting, then
    # with all ``count`` asleep (a waiting task should cost a worker no memory: its run
    # ended at the sleep and its lease went back to the database), then after they ran.
    workers = Workers(side.dsn, TIMER_WORKERS, max(1, min(250, count // TIMER_WORKERS + 1)), tag)
    try:
        await asyncio.sleep(1.0)  # Past the first claims' and the listener's start.
        rss_idle = workers.rss_mib()
        submitted = time.monotonic()
        await _submit_many(side.engine, TIMER_AGENT, count, None, f"{tag}")

        async def status_count(status: str) -> int:
            # A range of the (tenant, status, task_id) index: polled every 20 ms, a LIKE
            # would scan the table, a cost on the server that grows with the fill.
            return int(await _value(db,
                "SELECT count(*) FROM wal_tasks WHERE tenant = $1 AND status = $2"
                " AND task_id >= $3 AND task_id < $4", TENANT, status, f"{tag}-", f"{tag}."))

        async def all_waiting() -> bool:
            return await status_count("WAITING") == count

        await _until(all_waiting, timeout_s, "all timers started")
        to_sleep_s = time.monotonic() - submitted  # From the first submission.
        rss_waiting = workers.rss_mib()
        moment = await _value(db,
            "WITH due AS (UPDATE wal_tasks SET wake_at = now() + interval '1 second'"
            " WHERE tenant = $1 AND agent = $2 AND task_id LIKE $3 AND status = 'WAITING'"
            " RETURNING wake_at) SELECT max(wake_at) FROM due", TENANT, TIMER_AGENT, f"{tag}-%")
        now = await _value(db, "SELECT now()")
        await asyncio.sleep(max(0.0, (moment - now).total_seconds()))
        # CPU seconds of the server and of the workers from the moment to the end: what
        # the wake-up costs, less disturbed by the other load of a shared machine than
        # its time.
        postmaster = await _postmaster_pid(db)
        server_cpu0, workers_cpu0 = _tree_cpu_s(postmaster), sum(workers.cpu_s())

        async def none_waiting() -> bool:
            return await status_count("WAITING") == 0

        async def all_completed() -> bool:
            return await status_count("COMPLETED") == count

        woken_s = await _until(none_waiting, timeout_s, "all timers woken")
        completed_s = woken_s + await _until(all_completed, timeout_s, "all woken tasks done")
        server_cpu_s = _tree_cpu_s(postmaster) - server_cpu0
        workers_cpu_s = sum(workers.cpu_s()) - workers_cpu0
        rss_done = workers.rss_mib()
    finally:
        workers.stop()
    return {"timers": count, "workers": TIMER_WORKERS, "to_sleep_s": round(to_sleep_s, 2),
            "all_resuming_s": round(woken_s, 2), "all_next_step_s": round(completed_s, 2),
            "target_met": completed_s < 10.0,
            "rss_mib_none_waiting": rss_idle, "rss_mib_all_waiting": rss_waiting,
            "rss_mib_all_done": rss_done, "server_cpu_s": round(server_cpu_s, 2),
            "workers_cpu_s": round(workers_cpu_s, 2),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


async def _postmaster_pid(db: Any) -> int | None:
    """The server's postmaster pid (its data directory's postmaster.pid), when readable."""
    directory = await _value(db, "SELECT setting FROM pg_settings WHERE name = 'data_directory'")

    def read() -> int | None:
        try:
            return int(Path(directory, "postmaster.pid").read_text().split()[0])
        except (OSError, TypeError, ValueError, IndexError):
            return None

    return await asyncio.to_thread(read)


def _tree_cpu_s(postmaster: int | None) -> float:
    """CPU seconds of the postmaster and its children (its backends), or NaN."""
    if postmaster is None:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == postmaster or int(fields[1]) == postmaster:
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


CEILING_INSERT: Final = (
    f"INSERT INTO scale_ceiling ({', '.join(EVENT_COLUMNS)})"
    f" VALUES ({', '.join(f'${i}' for i in range(1, len(EVENT_COLUMNS) + 1))})")


async def ceiling(side: Side, seconds: float) -> float:
    """Rows/s of ``executemany`` of 1,000 rows per transaction into a table of the log's
    shape (``LIKE wal_events``: its columns, defaults and primary key; no triggers), the
    rows the workers' tool steps append (the same intent and result payloads, 32-byte
    hashes), so that the ceiling is the physical limit for these rows, not for smaller
    ones in a narrower table."""
    connection = await asyncpg.connect(side.dsn)
    try:
        await connection.execute(
            "CREATE TABLE IF NOT EXISTS scale_ceiling"
            " (LIKE wal_events INCLUDING DEFAULTS INCLUDING INDEXES)")
        intent, completed = _step_payloads(0)
        stamp = dt.datetime.now(dt.UTC)
        rows = 0
        started = time.monotonic()
        batch = 0
        while time.monotonic() - started < seconds:
            records = [
                (TENANT, f"c{batch}-{i // 2}", i % 2 + 1, kind, version, 1, payload,
                 f"c{batch}:{i}" if i % 2 == 0 else None, bytes(32), bytes(32), stamp, 2)
                for i, (kind, version, payload) in
                ((i, intent if i % 2 == 0 else completed) for i in range(CEILING_ROWS))]
            async with connection.transaction():
                await connection.executemany(CEILING_INSERT, records)
            rows += CEILING_ROWS
            batch += 1
        elapsed = time.monotonic() - started
        await connection.execute("DROP TABLE scale_ceiling")
    finally:
        await connection.close()
    return rows / elapsed


async def throughput(side: Side, running: int, processes: int, window_s: float,
                     timeout_s: float, gc_young: int = 0) -> dict[str, Any]:
    """``running`` stepping tasks held by ``processes`` worker processes: steps/s, RSS, CPU."""
    db = side.store.database
    tag = f"l{processes}-{time.monotonic_ns() % 10**8}"
    ids = await _submit_many(side.engine, LOOP_AGENT, running, {"steps": 1_000_000}, tag)
    workers = Workers(side.dsn, processes, running // processes + 1, tag, gc_young)
    try:
        async def all_running() -> bool:
            return int(await _value(db,
                "SELECT count(*) FROM wal_tasks WHERE tenant = $1 AND task_id = ANY($2)"
                " AND status = 'RUNNING'", TENANT, ids)) == running

        await _until(all_running, timeout_s, "all loop tasks running")
        await asyncio.sleep(min(2.0, window_s / 2))  # Past the first steps' warm-up.

        async def events() -> int:
            return int(await _value(db,
                "SELECT sum(last.seq) FROM unnest($2::text[]) AS t(task_id)"
                " CROSS JOIN LATERAL (SELECT seq FROM wal_events e WHERE e.tenant = $1"
                " AND e.task_id = t.task_id ORDER BY seq DESC LIMIT 1) AS last", TENANT, ids))

        first, cpu0, started = await events(), workers.cpu_s(), time.monotonic()
        sched0 = workers.sched_s()
        await asyncio.sleep(window_s)
        last, cpu1, elapsed = await events(), workers.cpu_s(), time.monotonic() - started
        sched1 = workers.sched_s()
        rss = workers.rss_mib()
    finally:
        workers.stop()
    for start in range(0, len(ids), 100):
        await asyncio.gather(*(side.engine.cancel(t, reason="benchmark over")
                               for t in ids[start:start + 100]))
    steps = (last - first) / 2
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    return {"processes": processes, "running": running, "gc_young": gc_young or None,
            "window_s": round(elapsed, 1),
            "steps_per_s": round(steps / elapsed), "appends_per_s": round(2 * steps / elapsed),
            "rss_mib": rss, "cpu_s": [round(c, 2) for c in cpu],
            "cpu_us_per_step": round(sum(cpu) / max(1.0, steps) * 1e6),
            "cpu_utilisation": round(sum(cpu) / elapsed, 2),
            # The event-loop thread of each process: share of the window on a CPU, and
            # waiting for one (runnable; on 2 shared cores, the machine's load).
            "loop_on_cpu": [round((b[0] - a[0]) / elapsed, 2) for a, b in zip(sched0, sched1,
                                                                              strict=True)],
            "loop_waiting_for_cpu": [round((b[1] - a[1]) / elapsed, 2)
                                     for a, b in zip(sched0, sched1, strict=True)]}


# ----------------------------------------------------------------------------- main


async def new_database(admin_dsn: str, name: str) -> str:
    """A new, empty database ``name`` (dropped first); its DSN."""
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return with_database(admin_dsn, name)


async def create_database(admin_dsn: str, name: str) -> str:
    """A new database ``name`` (dropped first) with the schema applied; its DSN."""
    dsn = await new_database(admin_dsn, name)
    connection = await asyncpg.connect(dsn)
    try:
        await apply_schema(connection)
    finally:
        await connection.close()
    return dsn


async def settle(admin_dsn: str, databases: list[str], timeout_s: float) -> float:
    """CHECKPOINT, then wait (up to ``timeout_s``) until no autovacuum worker runs in
    ``databases``: a fill of gigabytes leaves a checkpoint and autovacuums behind, and a
    latency measured while they run on 2 cores measures them (at 200,000 tasks heartbeats
    read 5x slower during them and flat after). Returns the seconds waited."""
    started = time.monotonic()
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute("CHECKPOINT")
        while time.monotonic() - started < timeout_s:
            busy = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
                " AND datname = ANY($1::text[])", databases)
            if not busy:
                break
            await asyncio.sleep(1.0)
    finally:
        await admin.close()
    return round(time.monotonic() - started, 1)


async def run(args: argparse.Namespace, admin_dsn: str) -> dict[str, Any]:
    """Fill both databases, measure both, return the document."""
    print(f"filling: empty fixture {args.empty_tasks:,} tasks / {args.empty_events:,} events;"
          f" filled {args.tasks:,} tasks / {args.events:,} events", flush=True)
    empty_dsn = await create_database(admin_dsn, f"{args.database_prefix}_empty")
    filled_dsn = await create_database(admin_dsn, f"{args.database_prefix}_filled")
    claims = args.rounds * (args.ops + 2) + 10
    fills = {"empty": await fill(empty_dsn, args.empty_tasks, args.empty_events,
                                 queued=claims),
             "filled": await fill(filled_dsn, args.tasks, args.events,
                                  queued=max(claims, min(100_000, args.tasks // 10)))}
    for label, figures in fills.items():
        print(f"  {label}: {figures['task_rows']:,} tasks, {figures['event_rows']:,} events"
              f" (queued {figures['queued']:,}, waiting {figures['waiting']:,}), COPY"
              f" {figures['copy_s']} s, with VACUUM ANALYZE {figures['fill_s']} s; database"
              f" {figures['database_bytes'] / 2**20:,.0f} MiB (events"
              f" {figures['events_bytes'] / 2**20:,.0f} MiB, tasks"
              f" {figures['tasks_bytes'] / 2**20:,.0f} MiB)", flush=True)
    machine = await harness.describe_machine(filled_dsn)
    engines = [await connect(empty_dsn, migrate=False, development=True),
               await connect(filled_dsn, migrate=False, development=True)]
    document: dict[str, Any] = {"benchmark": NAME, "machine": machine,
                                "settings": {k: v for k, v in vars(args).items()
                                             if not k.startswith("_")},
                                "fill": fills}
    try:
        sides = [Side("empty", empty_dsn, engines[0]), Side("filled", filled_dsn, engines[1])]
        for engine in engines:
            register(engine)
        for side in sides:
            await side.prepare()
        document["settle_s"] = await settle(
            admin_dsn, [f"{args.database_prefix}_{label}" for label in ("empty", "filled")],
            args.timeout)
        print(f"settled (checkpoint, no autovacuum running) in {document['settle_s']} s",
              flush=True)
        print(f"latencies ({args.rounds} rounds, {args.ops} ops per round and side):",
              flush=True)
        document["latencies"] = await latencies(sides, args.rounds, args.ops)
        if args.timers:
            document["timers"] = {}
            for side in sides:
                figures = await timers(side, args.timers, args.timeout)
                document["timers"][side.label] = figures
                print(f"  timers {side.label}: {figures}", flush=True)
        if args.running:
            document["workers"] = {}
            for side in sides:
                rows = []
                limit = await ceiling(side, min(5.0, args.window))
                for processes in args.processes:
                    for gc_young in sorted({0, args.gc_young}):
                        figures = await throughput(side, args.running, processes,
                                                   args.window, args.timeout, gc_young)
                        figures["ceiling_rows_per_s"] = round(limit)
                        figures["vs_ceiling"] = round(figures["appends_per_s"] / limit, 3)
                        rows.append(figures)
                        print(f"  workers {side.label}: {figures}", flush=True)
                document["workers"][side.label] = rows
        if args.cpu_steps:
            document["cpu_step"] = {}
            for side in sides:
                figures = await cpu_step.measure(args.cpu_steps, args.cpu_rounds, side.dsn)
                figures["target_met"] = figures["ratio_median"] <= 1.5
                document["cpu_step"][side.label] = figures
                print(f"  cpu_step {side.label}: wal {figures['wal_cpu_us_median']:.0f} µs,"
                      f" raw {figures['raw_cpu_us_median']:.0f} µs, ratio"
                      f" {figures['ratio_median']:.2f}x", flush=True)
    finally:
        for engine in engines:
            await engine.close()
    return document


def report(document: dict[str, Any]) -> str:
    """The measures as a Markdown table (empty vs filled p50/p99 and ratio)."""
    fill_ = document["fill"]["filled"]
    lines = [f"## benchmarks.scale: {fill_['task_rows']:,} tasks, {fill_['event_rows']:,} events",
             "", harness.format_machine(document["machine"]), "",
             "| measure | empty p50 µs | empty p99 µs | filled p50 µs | filled p99 µs"
             " | p50 ratio | target (<= 1.25x) |", "|---|--:|--:|--:|--:|--:|---|"]
    for name, figure in document.get("latencies", {}).items():
        e, f = figure["empty"], figure["filled"]
        lines.append(f"| {name} | {e['p50_us']:,.0f} | {e['p99_us']:,.0f} | {f['p50_us']:,.0f}"
                     f" | {f['p99_us']:,.0f} | {figure['p50_ratio']:.2f}x"
                     f" | {'met' if figure['target_met'] else 'missed'} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--empty-tasks", type=int, default=1000,
                        help="tasks of the 'empty' fixture (default 1000)")
    parser.add_argument("--empty-events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=100, help="timed ops per round and side")
    parser.add_argument("--timers", type=int, default=10_000, help="0 skips the timers")
    parser.add_argument("--running", type=int, default=1000, help="0 skips the workers")
    parser.add_argument("--processes", type=lambda t: [int(p) for p in t.split(",")],
                        default=[1, 2, 4])
    parser.add_argument("--window", type=float, default=10.0, help="throughput window, s")
    parser.add_argument("--gc-young", type=int, default=0,
                        help="workers: also measure each process count with the collector's "
                             "first threshold at this many allocations (older ones at 20); "
                             "0: only the interpreter's default")
    parser.add_argument("--cpu-steps", type=int, default=10_000, help="0 skips cpu_step")
    parser.add_argument("--cpu-rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--data-dir", type=Path,
                        help="parent of the embedded server's data (default: a temporary"
                             " directory on disk, removed after)")
    parser.add_argument("--keep", action="store_true", help="leave the server's data")
    parser.add_argument("--fsync", action="store_true", help="run the server with fsync on")
    parser.add_argument("--admin-dsn", help="use this server instead of starting one")
    parser.add_argument("--database-prefix", default="scale",
                        help="the databases are <prefix>_empty and <prefix>_filled")
    parser.add_argument("--json", type=Path, dest="json_path")
    parser.add_argument("--no-json", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("DSN", "ID", "CONCURRENCY"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    if args.admin_dsn:
        try:
            document = await run(args, args.admin_dsn)
        finally:
            if not args.keep:
                admin = await asyncpg.connect(args.admin_dsn)
                try:
                    for side in ("empty", "filled"):
                        await admin.execute(f'DROP DATABASE IF EXISTS'
                                            f' "{args.database_prefix}_{side}" WITH (FORCE)')
                finally:
                    await admin.close()
    else:
        root = Path(tempfile.mkdtemp(prefix="wal-scale-", dir=args.data_dir or "/var/tmp"))
        server = EmbeddedPostgres(root / "pgdata", fsync=args.fsync)
        try:
            admin_dsn = await asyncio.to_thread(server.ensure_running)
            document = await run(args, admin_dsn)
        finally:
            server.stop("fast")
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    print(report(document))
    if not args.no_json:
        target = args.json_path or harness.RESULTS_DIR / f"scale_{args.tasks}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    arguments = parse()
    if arguments.worker:
        dsn, worker_id, concurrency = arguments.worker
        asyncio.run(run_worker(dsn, worker_id, int(concurrency), arguments.gc_young))
    else:
        harness.run_main(lambda: main(arguments))
