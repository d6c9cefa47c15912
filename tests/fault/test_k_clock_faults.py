"""Clock faults K1, K2, K4 (RELIABILITY.md): workers whose wall clock is skewed by an hour or
jumps mid-run (libfaketime), and the lease arithmetic. Leases are decided by the database
clock, so a skewed worker neither breaks leases early nor keeps them late."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fault import ledger_agents
from tests.fault.support import (
    REPO,
    check_everything,
    expected_output,
    ledgered_engine,
    outcome_violations,
    report,
)
from wal_engine.engine import Engine
from wal_engine.events import ToolCallFailed
from wal_engine.retries import RetryPolicy, backoff_delay_s
from wal_engine.runtime.worker import WorkerConfig
from wal_engine.testing import ManualClock
from wal_engine.testing.crash import open_tasks
from wal_engine.testing.invariants import Violation
from wal_engine.testing.processes import WorkerPool, wait_until

LIBFAKETIME = next((path for path in (
    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
    Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
    Path("/usr/lib/faketime/libfaketime.so.1"),
) if path.exists()), None)
needs_faketime = pytest.mark.skipif(
    LIBFAKETIME is None, reason="libfaketime not installed (apt-get install -y faketime)")
FLAKY_REGISTER = "tests.fault.ledger_agents:register_flaky"


def faketime_env(offset: str | None = None, timestamp_file: Path | None = None
                 ) -> dict[str, str]:
    """Environment that runs a process under libfaketime, monotonic time left alone (P25)."""
    env = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    if offset is not None:
        env["FAKETIME"] = offset
    if timestamp_file is not None:
        env["FAKETIME_TIMESTAMP_FILE"] = str(timestamp_file)
        env["FAKETIME_NO_CACHE"] = "1"
    return env


@pytest.fixture
async def flaky_engine(database_dsn: str) -> Any:
    engine = await ledgered_engine(database_dsn)
    ledger_agents.register_flaky(engine)
    try:
        yield engine
    finally:
        await engine.close()


@pytest.fixture
def pool(database_dsn: str, tmp_path: Path) -> Any:
    workers = WorkerPool(database_dsn, FLAKY_REGISTER, tmp_path, cwd=REPO, lease_ttl_ms=1000,
                         heartbeat_ms=250, poll_ms=50)
    try:
        yield workers
    finally:
        workers.close()


async def _orphaned(engine: Engine) -> int:
    rows = await engine.database.fetch(
        "SELECT count(*) AS n FROM wal_events WHERE type = 'task_orphaned'")
    return int(rows[0]["n"])


async def _done(engine: Engine, task_ids: list[str]) -> bool:
    return not await open_tasks(engine, task_ids)


@needs_faketime
@pytest.mark.timeout(300)
async def test_k1_workers_an_hour_ahead_and_behind_share_leases_safely(
        flaky_engine: Engine, pool: WorkerPool) -> None:
    """Workers at +1 h and -1 h next to a true one, 10 rounds: no lease is broken while its
    owner lives (no premature reclaim, no double owner), every task finishes once."""
    expected: dict[str, Any] = {}
    workers = [await pool.spawn("ahead", env=faketime_env("+1h")),
               await pool.spawn("behind", env=faketime_env("-1h")),
               await pool.spawn("true")]
    for round_number in range(10):
        for n in range(6):
            task_id = await flaky_engine.submit(
                ledger_agents.AGENT, {"n": n + 1, "sleep_ms": 50, "wait": False},
                task_id=f"k1-{round_number}-{n}")
            expected[task_id] = expected_output(n + 1)
        await wait_until(lambda: _done(flaky_engine, list(expected)), "the round", 60, 0.05)
    orphaned = await _orphaned(flaky_engine)
    alive = sum(worker.returncode is None for worker in workers)
    violations, effects = await check_everything(flaky_engine)
    outcomes, escalated = await outcome_violations(flaky_engine, expected)
    if orphaned:
        violations.append(Violation(invariant="K1", detail=f"{orphaned} leases broken while "
                                                           f"every owner was alive"))
    report("K1", violations + outcomes, tasks=len(expected), effects=effects,
           skews="+1h, -1h, 0", workers_alive=alive, leases_broken=orphaned,
           escalated=escalated)


def _slow_retry_task_ids(count: int) -> list[str]:
    """Task ids whose first retry of the flaky call waits 1.2 s or more (the jitter is a
    hash of task, seq and attempt), so that a kill lands inside the backoff."""
    policy = RetryPolicy(max_attempts=3, initial_delay_s=2.0, max_delay_s=2.0)
    chosen, n = [], 0
    while len(chosen) < count:
        task_id = f"k-retry-{n}"
        if backoff_delay_s(policy, task_id, 3, 1) >= 1.2:
            chosen.append(task_id)
        n += 1
    return chosen


@needs_faketime
@pytest.mark.timeout(300)
@pytest.mark.parametrize("offset", ["+1h", "-1h"])
async def test_k1_retry_scheduled_by_a_skewed_worker_is_not_delayed_by_the_skew(
        flaky_engine: Engine, pool: WorkerPool, offset: str) -> None:
    """A worker an hour off fails a call, schedules the retry, and dies in the backoff; a
    true worker resumes the task: the retry waits at most the policy's delay, not an hour."""
    task_ids = _slow_retry_task_ids(3)
    violations: list[Violation] = []
    for task_id in task_ids:
        await flaky_engine.submit(ledger_agents.FLAKY, {"n": 1}, task_id=task_id)
        skewed = await pool.spawn(f"skewed-{task_id}", env=faketime_env(offset))
        await wait_until(lambda t=task_id: _failed_once(flaky_engine, t), "the failed call", 30)
        skewed.kill(signal.SIGKILL)
        await skewed.exited()
        rescuer = await pool.spawn(f"rescuer-{task_id}")
        try:
            await wait_until(lambda t=task_id: _done(flaky_engine, [t]), "the retry", 20, 0.05)
        except AssertionError:
            head = await flaky_engine.head(task_id)
            violations.append(Violation(
                invariant="K1", task_id=task_id,
                detail=f"retry not made within 20 s: {head.status}, wake at {head.wake_at}"))
        rescuer.kill(signal.SIGTERM)
        await rescuer.exited()
    more, effects = await check_everything(flaky_engine)
    report(f"K1 retry {offset}", violations + more, tasks=len(task_ids), effects=effects,
           skew=offset, kills_in_backoff=len(task_ids))


async def _failed_once(engine: Engine, task_id: str) -> bool:
    return any(r.type == "tool_call_failed" for r in await engine.history(task_id))


class _HeldClock(ManualClock):
    """A manual clock whose sleeps never end: a run stays inside its backoff until its
    worker is stopped."""

    async def sleep(self, seconds: float) -> None:
        await asyncio.Event().wait()


@pytest.mark.timeout(120)
async def test_k1_retry_scheduled_under_a_manual_clock_is_made_by_a_real_worker(
        flaky_engine: Engine, pool: WorkerPool) -> None:
    """A test's ManualClock starts weeks ahead of the real one: the retry due time it
    records is weeks away for a worker process on the real clock. The in-process worker is
    stopped inside the backoff; the process resumes the task and retries within the
    policy's delay (2 s), not weeks later."""
    clock = _HeldClock()
    flaky_engine.clock = clock
    task_id = _slow_retry_task_ids(1)[0]
    await flaky_engine.submit(ledger_agents.FLAKY, {"n": 1}, task_id=task_id)
    worker = flaky_engine.worker(concurrency=1, lease_ttl_ms=1000, heartbeat_ms=250,
                                 poll_ms=50, drain_timeout_s=0.5)
    running = asyncio.create_task(worker.run())
    try:
        await wait_until(lambda: _failed_once(flaky_engine, task_id), "the failed call", 30)
    finally:
        worker.stop()
        await running
    failed = [r.decode() for r in await flaky_engine.history(task_id)
              if r.type == "tool_call_failed"]
    assert len(failed) == 1 and isinstance(failed[0], ToolCallFailed)
    due_in_s = (failed[0].retry_at_ms or 0) / 1000 - time.time()
    assert due_in_s > 7 * 86_400, due_in_s  # The manual clock's due time: weeks away.
    rescuer = await pool.spawn("rescuer")
    started = time.monotonic()
    violations: list[Violation] = []
    try:
        await wait_until(lambda: _done(flaky_engine, [task_id]), "the retry", 20, 0.05)
    except AssertionError:
        head = await flaky_engine.head(task_id)
        violations.append(Violation(invariant="K1", task_id=task_id,
                                    detail=f"retry not made within 20 s: {head.status}"))
    retried_after_s = round(time.monotonic() - started, 2)
    rescuer.kill(signal.SIGTERM)
    await rescuer.exited()
    more, effects = await check_everything(flaky_engine)
    report("K1 manual clock", violations + more, tasks=1, effects=effects,
           recorded_due_in_days=round(due_in_s / 86_400, 1), retried_after_s=retried_after_s)


@needs_faketime
@pytest.mark.timeout(300)
async def test_k2_worker_clock_jumps_mid_run(flaky_engine: Engine, pool: WorkerPool,
                                             tmp_path: Path) -> None:
    """A worker whose clock jumps back 90 s and forward 2 h while it runs, 10 jumps: no
    premature reclaim, no double owner, every task finishes once."""
    clock = tmp_path / "faketime"
    clock.write_text("+0\n")
    jumper = await pool.spawn("jumper", env=faketime_env(timestamp_file=clock))
    await pool.spawn("steady")
    expected: dict[str, Any] = {}
    jumps = 0
    for round_number in range(10):
        for n in range(5):
            task_id = await flaky_engine.submit(
                ledger_agents.AGENT, {"n": n + 1, "sleep_ms": 50, "wait": False},
                task_id=f"k2-{round_number}-{n}")
            expected[task_id] = expected_output(n + 1)
        await asyncio.sleep(0.1)
        clock.write_text("-90s\n" if round_number % 2 == 0 else "+2h\n")
        jumps += 1
        await wait_until(lambda: _done(flaky_engine, list(expected)), "the round", 60, 0.05)
    orphaned = await _orphaned(flaky_engine)
    violations, effects = await check_everything(flaky_engine)
    outcomes, escalated = await outcome_violations(flaky_engine, expected)
    if orphaned:
        violations.append(Violation(invariant="K2", detail=f"{orphaned} leases broken while "
                                                           f"every owner was alive"))
    report("K2", violations + outcomes, tasks=len(expected), effects=effects, jumps=jumps,
           jumper_alive=jumper.returncode is None, leases_broken=orphaned,
           escalated=escalated)


@given(ttl_ms=st.integers(1, 600_000), heartbeat_ms=st.integers(1, 600_000))
def test_k4_lease_arithmetic_keeps_three_heartbeats_per_ttl(ttl_ms: int,
                                                            heartbeat_ms: int) -> None:
    """A worker configuration is accepted only when at least three heartbeats fit in a
    lease (RELIABILITY.md R6): a lease survives two lost heartbeats."""
    try:
        config = WorkerConfig(lease_ttl_ms=ttl_ms, heartbeat_ms=heartbeat_ms)
    except ValueError:
        assert heartbeat_ms * 3 > ttl_ms
        return
    assert config.heartbeat_ms * 3 <= config.lease_ttl_ms


@given(attempt=st.integers(1, 50), seq=st.integers(1, 10**6),
       initial=st.floats(0.001, 100), cap=st.floats(0.001, 3600))
def test_k4_backoff_never_exceeds_the_policy_cap(attempt: int, seq: int, initial: float,
                                                  cap: float) -> None:
    """Every backoff delay is within [0, max_delay_s]: what a retry may wait is bounded by
    the policy, whatever clock recorded it."""
    policy = RetryPolicy(max_attempts=100, initial_delay_s=initial, max_delay_s=cap)
    delay = backoff_delay_s(policy, "task", seq, attempt)
    assert 0 <= delay <= cap


@pytest.mark.timeout(60)
async def test_k4_lease_expiry_is_set_by_the_database_clock(flaky_engine: Engine) -> None:
    """A claim's lease ends TTL after the database's now(), whatever the worker's clock."""
    await flaky_engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": False},
                              task_id="k4")
    rows = await flaky_engine.database.fetch(
        "SELECT * FROM wal_claim_tasks('k4-worker', 1, 7000)")
    assert len(rows) == 1
    left = await flaky_engine.database.fetch(
        "SELECT extract(epoch FROM lease_expires_at - now()) AS s FROM wal_tasks "
        "WHERE task_id = 'k4'")
    assert 6.5 < float(left[0]["s"]) <= 7.0
    report("K4", [], tasks=1, ttl_ms=7000, expiry_from_database_clock_s=round(
        float(left[0]["s"]), 3))
