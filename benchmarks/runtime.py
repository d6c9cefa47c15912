"""Runtime benchmark: tool-call steps through the real runtime vs raw asyncpg INSERTs.

Workloads (each step = a tool call: its intent appended and committed, the tool run, its
result appended and committed; about 500 bytes of arguments and a 1 KB result):

* ``step1``: one task, sequential steps, vs two sequential raw INSERT commits of rows of
  the same sizes (the reference).
* ``step64``: 64 tasks stepping at once in one worker process (their appends group-
  committed), vs 64 connections each making two raw INSERT commits (one row per commit).
  One operation is one step of every task.
* ``takeover`` (not interleaved): a worker process holding a task is SIGKILLed; another
  worker resumes the task. Reported: the time from the lease's expiry (database clock) to
  the ``task_resumed`` event, which the issue wants under 100 ms.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Final

import asyncpg

from benchmarks import harness
from benchmarks.runtime_agents import ARGS, RESULT, Driver, register
from wal_engine.engine import Engine, connect
from wal_engine.payloads import encode_payload

CONCURRENT_TASKS: Final = 64
TAKEOVER_LEASE_TTL_MS: Final = 1000
RAW_TABLE: Final = """
CREATE TABLE IF NOT EXISTS bench_raw_steps (
    task_id text NOT NULL, seq bigint NOT NULL, type text NOT NULL, payload bytea NOT NULL,
    hash bytea NOT NULL, PRIMARY KEY (task_id, seq)
)
"""
RAW_INSERT: Final = (
    "INSERT INTO bench_raw_steps (task_id, seq, type, payload, hash) VALUES ($1, $2, $3, $4, $5)"
)
REPO: Final = Path(__file__).resolve().parents[1]


class RawSteps:
    """Two raw INSERT commits per step, sized like an intent and a result."""

    def __init__(self, pool: asyncpg.Pool, connections: int) -> None:
        self.pool = pool
        self.connections = connections
        self.intent = encode_payload({"args": ARGS, "tool": "work"})
        self.result = encode_payload(RESULT)
        self.run_id = uuid.uuid4().hex[:8]
        self.seq = 0

    async def _step(self, connection: asyncpg.Connection, task: str) -> None:
        self.seq += 2
        await connection.execute(RAW_INSERT, task, self.seq, "intent", self.intent, bytes(32))
        await connection.execute(RAW_INSERT, task, self.seq + 1, "result", self.result,
                                 bytes(32))

    async def one(self) -> None:
        """One step on one connection."""
        async with self.pool.acquire() as connection:
            await self._step(connection, f"raw-{self.run_id}")

    async def many(self) -> None:
        """One step on each of ``connections`` connections at once."""
        async def step(index: int) -> None:
            async with self.pool.acquire() as connection:
                await self._step(connection, f"raw-{self.run_id}-{index}")

        await asyncio.gather(*(step(i) for i in range(self.connections)))


class EngineSteps:
    """Tasks of the ``driven`` agent stepping through a live in-process worker."""

    def __init__(self, engine: Engine, driver: Driver, task_ids: list[str]) -> None:
        self.engine, self.driver, self.task_ids = engine, driver, task_ids

    async def one(self) -> None:
        """One step of the first task."""
        await self.driver.step(self.task_ids[0])

    async def many(self) -> None:
        """One step of every task, all at once."""
        await asyncio.gather(*(self.driver.step(task_id) for task_id in self.task_ids))


async def _start_tasks(engine: Engine, driver: Driver, count: int) -> list[str]:
    task_ids = [f"bench-{uuid.uuid4().hex[:12]}" for _ in range(count)]
    for task_id in task_ids:
        driver.add(task_id)
        await engine.submit("driven", task_id=task_id)
    return task_ids


async def interleaved(dsn: str, settings: harness.RunSettings,
                      names: list[str]) -> list[harness.WorkloadResult]:
    """The step1 and step64 workloads, contenders interleaved in rounds."""
    engine = await connect(dsn)
    driver = Driver()
    register(engine, driver)
    pool = await asyncpg.create_pool(dsn, min_size=CONCURRENT_TASKS, max_size=CONCURRENT_TASKS,
                                     reset=harness.no_session_reset)
    assert pool is not None
    await pool.execute(RAW_TABLE)
    worker = engine.worker(concurrency=CONCURRENT_TASKS + 1, poll_ms=20)
    running = asyncio.create_task(worker.run())
    results = []
    try:
        task_ids = await _start_tasks(engine, driver, CONCURRENT_TASKS + 1)
        single = EngineSteps(engine, driver, task_ids[:1])
        many = EngineSteps(engine, driver, task_ids[1:])
        raw = RawSteps(pool, CONCURRENT_TASKS)
        workloads = {
            "step1": harness.Workload(
                name="step1", description="one tool step (intent + result commits), one task",
                ops_per_round=settings.ops, contenders=[
                    harness.Contender("raw 2 INSERT commits", raw.one, 1, reference=True),
                    harness.Contender("wal-engine tool step", single.one, 1),
                ]),
            "step64": harness.Workload(
                name="step64", description="one tool step of each of 64 tasks at once",
                ops_per_round=max(2, settings.ops // 8), contenders=[
                    harness.Contender("raw 64 conns x 2 INSERT commits", raw.many,
                                      CONCURRENT_TASKS, reference=True),
                    harness.Contender("wal-engine 64 tasks, group commit", many.many,
                                      CONCURRENT_TASKS),
                ]),
        }
        for name in names:
            if name in workloads:
                results.append(await harness.run_workload(workloads[name],
                                                          rounds=settings.rounds))
        for task_id in task_ids:
            await driver.stop(task_id)
        await engine.wait(task_ids[0], timeout_s=30)
        print(f"group commit: {engine.committer.appends} appends in "
              f"{engine.committer.flushes} flushes", file=sys.stderr)
    finally:
        worker.stop()
        await running
        await pool.close()
        await engine.close()
    return results


async def takeover(dsn: str, samples: int) -> dict[str, Any]:
    """Kill a worker holding a task; time lease expiry -> task_resumed by another worker."""
    engine = await connect(dsn)
    register(engine)
    excess_ms: list[float] = []
    try:
        for sample in range(samples):
            task_id = f"hold-{uuid.uuid4().hex[:12]}"
            await engine.submit("hold", task_id=task_id)
            victim = _spawn_holder(dsn, f"victim-{sample}")
            await _until(lambda t=task_id: _event(engine, t, "tool_call_completed"), 30)
            # The survivor starts only now, so that it cannot claim the task first; it is
            # idle (poll 1 s) and must be woken by its sweeper and the NOTIFY.
            survivor = engine.worker(concurrency=4, lease_ttl_ms=TAKEOVER_LEASE_TTL_MS,
                                     heartbeat_ms=TAKEOVER_LEASE_TTL_MS // 4, poll_ms=1000,
                                     sweep_ms=5000, drain_timeout_s=0.2)
            running = asyncio.create_task(survivor.run())
            expires = (await engine.head(task_id)).lease_expires_at
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)
            resumed = await _until(lambda t=task_id: _event(engine, t, "task_resumed"), 30)
            assert expires is not None and resumed.recorded_at is not None
            excess_ms.append((resumed.recorded_at - expires).total_seconds() * 1000)
            await engine.cancel(task_id)
            survivor.stop()
            await running
    finally:
        await engine.close()
    return {
        "lease_ttl_ms": TAKEOVER_LEASE_TTL_MS,
        "samples_ms": [round(value, 1) for value in excess_ms],
        "median_ms": round(statistics.median(excess_ms), 1),
        "max_ms": round(max(excess_ms), 1),
    }


def _spawn_holder(dsn: str, worker_id: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.runtime_agents", dsn, worker_id,
         str(TAKEOVER_LEASE_TTL_MS)],
        cwd=REPO, env={**os.environ}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return process


async def _event(engine: Engine, task_id: str, kind: str) -> Any:
    for record in reversed(await engine.history(task_id)):
        if record.type == kind:
            return record
    return None


async def _until(probe: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await probe()
        if found:
            return found
        await asyncio.sleep(0.005)
    raise TimeoutError("benchmark condition not reached")


async def main() -> int:
    """Run the runtime benchmark and print its report."""
    parser = harness.argument_parser("runtime", __doc__, rounds=20, ops=40)
    parser.add_argument("--takeover-samples", type=int, default=5)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=10)
    names = harness.selected(["step1", "step64", "takeover"], args)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    machine = await harness.describe_machine(dsn)
    results = []
    if {"step1", "step64"} & set(names):
        results = await interleaved(dsn, settings, names)
    extra: dict[str, Any] = {}
    report = harness.format_report("runtime", machine, results, settings)
    if "takeover" in names:
        samples = 2 if settings.quick else args.takeover_samples
        extra["takeover"] = await takeover(dsn, samples)
        figures = extra["takeover"]
        report += (f"\n- takeover: lease TTL {figures['lease_ttl_ms']} ms; lease expiry -> "
                   f"task_resumed by another worker: median {figures['median_ms']} ms, max "
                   f"{figures['max_ms']} ms over {len(figures['samples_ms'])} kills "
                   f"({figures['samples_ms']})\n")
    print(report)
    if not args.no_json:
        harness.write_json("runtime", machine, results, settings, path=args.json_path,
                           extra=extra)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
