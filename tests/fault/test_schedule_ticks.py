"""Schedules under worker crashes: every tick submits exactly one task, however many worker
processes fire them and whichever is SIGKILLed in the middle of a tick and restarted."""

from __future__ import annotations

import datetime as dt
import itertools
import random
import signal
from pathlib import Path

import pytest

from tests.fault.schedule_agents import AGENT, REGISTER
from tests.fault.support import REPO, fault_seed, report
from wal_engine.engine import Engine, connect
from wal_engine.testing.invariants import Violation
from wal_engine.testing.processes import WorkerPool, WorkerProcess, wait_until

NAME = "beat"
KILL_POINT = "schedule_tick_before_commit"


async def _tick_ids(engine: Engine) -> list[str]:
    rows = await engine.database.fetch(
        "SELECT task_id FROM wal_tasks WHERE tenant = current_setting('wal.tenant', true) "
        "AND task_id LIKE $1 ORDER BY task_id", f"sched:{NAME}:%")
    return [row["task_id"] for row in rows]


def _tick_time(task_id: str) -> dt.datetime:
    return dt.datetime.strptime(task_id.rsplit(":", 1)[1], "%Y%m%dT%H%M%SZ")


async def _violations(engine: Engine) -> tuple[list[Violation], int]:
    """Ticks from the first to the last one fired, one second apart, each exactly one task;
    the schedule counted as many firings as there are tasks (a tick fired twice would count
    twice, even though its task id could only be inserted once)."""
    ids = await _tick_ids(engine)
    problems: list[Violation] = []
    times = [_tick_time(task_id) for task_id in ids]
    gaps = [(a, b) for a, b in itertools.pairwise(times)
            if (b - a).total_seconds() != 1]
    if gaps:
        problems.append(Violation(invariant="tick_missing_or_doubled",
                                  detail=f"schedule {NAME}: gaps {gaps[:5]!r}"))
    fired = (await engine.schedule_info(NAME)).ticks_fired
    if fired != len(ids):
        problems.append(Violation(invariant="tick_fired_twice",
                                  detail=f"schedule {NAME}: ticks_fired {fired}, tasks "
                                         f"{len(ids)}"))
    return problems, len(ids)


async def _run(engine: Engine, tmp_path: Path, *, kills: int, workers: int,
               ticks_after: int) -> None:
    """Run ``workers`` worker processes on a one-second schedule; ``kills`` times, one of
    them is SIGKILLed inside a tick's transaction and a replacement is started; then run
    ``ticks_after`` more ticks and check every tick made exactly one task."""
    seed = fault_seed()
    chooser = random.Random(seed)
    await engine.schedule(NAME, AGENT, every_s=1, input={"seed": seed}, catch_up="all")
    pool = WorkerPool(engine.database.dsn, REGISTER, tmp_path, cwd=REPO,
                      lease_ttl_ms=2000, heartbeat_ms=500)
    running: list[WorkerProcess] = []
    killed = 0
    try:
        for n in range(workers):
            running.append(pool.start(f"steady-{n}"))
        for worker in running:
            await worker.ready()
        for round_ in range(kills):
            doomed = await pool.spawn(
                f"doomed-{round_}", failpoint=f"{KILL_POINT}:{chooser.randint(1, 3)}:sigkill")
            await wait_until(lambda d=doomed: d.returncode is not None,
                             f"doomed-{round_} to die mid-tick", 30, 0.05)
            assert doomed.returncode == -signal.SIGKILL, doomed.output()
            killed += 1
        # The restart: a fresh worker joins the survivors.
        running.append(await pool.spawn("restarted"))
        target = len(await _tick_ids(engine)) + ticks_after
        await wait_until(lambda: _at_least(engine, target), f"{ticks_after} more ticks", 30,
                         0.1)
        for worker in running:
            worker.kill(signal.SIGTERM)
        for worker in running:
            await worker.exited()
    finally:
        pool.close()
    violations, tasks = await _violations(engine)
    report("SCHED", violations, tasks=tasks, workers=workers + kills + 1,
           sigkills_mid_tick=killed, seed=seed)


async def _at_least(engine: Engine, count: int) -> bool:
    return len(await _tick_ids(engine)) >= count


@pytest.mark.timeout(120)
async def test_each_tick_makes_one_task_across_two_workers_a_kill_and_a_restart(
        database_dsn: str, tmp_path: Path) -> None:
    """Two worker processes fire a one-second schedule; a third is SIGKILLed inside a tick
    (task inserted, not committed) and a fresh worker restarts; every tick from the first
    to the last is exactly one task, and the schedule fired each tick once."""
    engine = await connect(database_dsn, migrate=False)
    try:
        await _run(engine, tmp_path, kills=1, workers=2, ticks_after=3)
    finally:
        await engine.close()


@pytest.mark.deep
@pytest.mark.timeout(600)
async def test_each_tick_makes_one_task_across_many_kills(database_dsn: str,
                                                          tmp_path: Path) -> None:
    """Deep: three workers, twenty SIGKILLs mid-tick at random firings, then a restart."""
    engine = await connect(database_dsn, migrate=False)
    try:
        await _run(engine, tmp_path, kills=20, workers=3, ticks_after=5)
    finally:
        await engine.close()
