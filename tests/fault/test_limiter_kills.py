"""Limiters under worker crashes: worker processes SIGKILLed while they hold limiter grants
(granted, intent not yet written; and in the middle of the call) never let the calls'
start times exceed the limit, checked against a ledger of every start the fake LLM saw."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from tests.fault.limiter_agents import AGENT, CALLS, LEDGER_ENV, LIMITER, REGISTER
from tests.fault.support import REPO, fault_seed, report
from wal_engine.engine import Engine, connect
from wal_engine.testing.invariants import Violation
from wal_engine.testing.processes import WorkerPool, WorkerProcess, wait_until

LIMIT = 4
PERIOD_S = 1.0
SLACK_S = 0.1
"""A grant precedes its call's start by one intent append: the ledger is checked on windows
of PERIOD_S - SLACK_S (starts in such a window were granted in a window of PERIOD_S)."""


def _starts(ledger: Path) -> list[tuple[float, int]]:
    if not ledger.exists():
        return []
    rows = [line.split() for line in ledger.read_text().splitlines() if line.strip()]
    return sorted((float(row[0]), int(row[1])) for row in rows)


def _violations(starts: list[float]) -> list[Violation]:
    problems = []
    for i in range(len(starts) - LIMIT):
        span = starts[i + LIMIT] - starts[i]
        if span < PERIOD_S - SLACK_S:
            problems.append(Violation(
                invariant="limit_exceeded",
                detail=f"{LIMIT + 1} starts within {span:.3f} s from {starts[i]:.3f}"))
    return problems


async def _all_done(engine: Engine, ids: list[str]) -> bool:
    for task_id in ids:
        if (await engine.head(task_id)).status.value not in ("COMPLETED", "FAILED"):
            return False
    return True


async def _run(engine: Engine, tmp_path: Path, *, tasks: int, kills: int) -> None:
    seed = fault_seed()
    chooser = random.Random(seed)
    ledger = tmp_path / "ledger.txt"
    await engine.limiter(LIMITER, requests_per_period=LIMIT, period_s=PERIOD_S)
    pool = WorkerPool(engine.database.dsn, REGISTER, tmp_path, cwd=REPO, lease_ttl_ms=1500,
                      heartbeat_ms=300, poll_ms=50, env={LEDGER_ENV: str(ledger)})
    ids = [await engine.submit(AGENT, n) for n in range(tasks)]
    killed_holding_grant = killed_mid_call = 0
    steady: list[WorkerProcess] = []
    try:
        # The doomed first, while there is work for them; the steady workers after.
        for round_ in range(kills):
            doomed = await pool.spawn(
                f"granted-{round_}",
                failpoint=f"after_limiter_grant:{chooser.randint(1, 3)}:sigkill")
            await wait_until(lambda d=doomed: d.returncode is not None,
                             f"granted-{round_} to die holding a grant", 60, 0.02)
            assert doomed.returncode == -signal.SIGKILL, doomed.output()
            killed_holding_grant += 1
            victim = await pool.spawn(f"mid-call-{round_}")
            if await _wait_for_start(ledger, victim.process.pid, 10):
                victim.kill(signal.SIGKILL)
                await victim.exited()
                killed_mid_call += 1
        steady = [pool.start(f"steady-{n}") for n in range(2)]
        for worker in steady:
            await worker.ready()
        await wait_until(lambda: _all_done(engine, ids), "every task to finish", 90, 0.1)
        for worker in steady:
            worker.kill(signal.SIGTERM)
    finally:
        pool.close()
    starts = _starts(ledger)
    outputs = [(await engine.state(task_id)).output for task_id in ids]
    violations = _violations([start for start, _ in starts])
    if outputs != list(range(tasks)):
        violations.append(Violation(invariant="task_not_completed", detail=repr(outputs)))
    if len(starts) < tasks * CALLS:
        violations.append(Violation(invariant="calls_missing", detail=f"{len(starts)} starts"))
    report("LIMIT", violations, tasks=tasks, calls_started=len(starts),
           sigkills_holding_grant=killed_holding_grant, sigkills_mid_call=killed_mid_call,
           limit=f"{LIMIT}/{PERIOD_S:g}s", seed=seed)


async def _wait_for_start(ledger: Path, pid: int, timeout_s: float) -> bool:
    """Whether the worker ``pid`` started a call within ``timeout_s`` (it may find no work)."""
    try:
        await wait_until(lambda: any(p == pid for _, p in _starts(ledger)),
                         f"pid {pid} to start a call", timeout_s, 0.01)
    except AssertionError:
        return False
    return True


@pytest.mark.timeout(150)
async def test_workers_killed_holding_grants_never_exceed_the_limit(
        database_dsn: str, tmp_path: Path) -> None:
    """Two steady workers; one worker SIGKILLed right after a grant (before its intent),
    one SIGKILLed in the middle of a call; every task completes and no window of the start
    ledger holds more than the limit."""
    engine = await connect(database_dsn, migrate=False)
    try:
        await _run(engine, tmp_path, tasks=10, kills=1)
    finally:
        await engine.close()


@pytest.mark.deep
@pytest.mark.timeout(600)
async def test_many_kills_holding_grants_never_exceed_the_limit(database_dsn: str,
                                                                 tmp_path: Path) -> None:
    """Deep: 40 tasks, eight rounds of both kinds of kill."""
    engine = await connect(database_dsn, migrate=False)
    try:
        await _run(engine, tmp_path, tasks=40, kills=8)
    finally:
        await engine.close()


