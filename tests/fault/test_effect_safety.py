"""Issue 15 regressions with worker processes: a sync tool blocking past the lease (case 2),
agent code blocking the event loop (RELIABILITY.md W10), a worker stopped inside a
non-idempotent tool (case 4), and a worker killed after the intent of a non-idempotent call
(case 5). Every effect is counted by the side-effect ledger, in the database."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault import effect_agents
from tests.fault.support import REPO
from tests.helpers import escalations
from wal_engine.engine import Engine
from wal_engine.errors import ReconcileRefused
from wal_engine.testing.ledger import EffectLedger, EffectRow, check_effects
from wal_engine.testing.processes import WorkerPool, wait_until

LEASE_MS = 1500
HEARTBEAT_MS = 300
OPERATOR_ACTED = """
UPDATE wal_test_effects SET deliveries = deliveries + 1, applied = applied + 1
 WHERE key = $1
"""


@pytest.fixture
def pool(database_dsn: str, tmp_path: Path) -> Iterator[WorkerPool]:
    """Worker processes with the effect agents, lease 1.5 s, heartbeat 0.3 s."""
    workers = WorkerPool(database_dsn, effect_agents.REGISTER, tmp_path, cwd=REPO,
                         lease_ttl_ms=LEASE_MS, heartbeat_ms=HEARTBEAT_MS, poll_ms=50)
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture
async def ledgered(engine: Engine) -> Engine:
    """The test's engine with the effect agents registered (to submit and to read)."""
    await effect_agents.register(engine)
    return engine


async def _is(engine: Engine, task_id: str, status: str) -> bool:
    return str((await engine.head(task_id)).status) == status


async def _rows(engine: Engine, tool: str) -> list[EffectRow]:
    return [row for row in await EffectLedger.for_engine(engine).effects() if row.tool == tool]


async def _types(engine: Engine, task_id: str) -> list[str]:
    return [record.type for record in await engine.history(task_id)]


async def _no_violations(engine: Engine) -> None:
    assert await check_effects(engine.database) == []


@pytest.mark.timeout(120)
async def test_case2_sync_tool_blocking_past_the_lease_acts_once(ledgered: Engine,
                                                                 pool: WorkerPool) -> None:
    """A plain def tool blocking 4 s with time.sleep, two worker processes, lease 1.5 s:
    it acts once, the task completes, and no lease is lost (no task_orphaned)."""
    await pool.spawn("a")
    await pool.spawn("b")
    task_id = await ledgered.submit(effect_agents.BLOCKING, {"block_s": 4.0})
    await wait_until(lambda: _is(ledgered, task_id, "COMPLETED"),
                     "the blocking task to complete", 60, 0.1)
    rows = await _rows(ledgered, "blocking")
    assert [(r.attempts, r.deliveries, r.applied) for r in rows] == [(1, 1, 1)]
    types = await _types(ledgered, task_id)
    assert "task_orphaned" not in types
    assert types.count("task_claimed") == 1
    await _no_violations(ledgered)


@pytest.mark.timeout(120)
async def test_w10_agent_code_blocking_the_loop_keeps_its_lease(ledgered: Engine,
                                                                pool: WorkerPool) -> None:
    """Agent code busy on the event loop for 3 s (twice the lease) in a worker process: the
    keeper thread keeps the lease, the effect runs once, and the stall is logged with its
    cause."""
    first = await pool.spawn("hog")
    task_id = await ledgered.submit(effect_agents.LOOP_HOG, {"hog_s": 3.0})
    await pool.spawn("other")
    await wait_until(lambda: _is(ledgered, task_id, "COMPLETED"),
                     "the hogging task to complete", 60, 0.1)
    rows = await _rows(ledgered, "charge")
    assert [(r.deliveries, r.applied, r.owners) for r in rows] == [(1, 1, ["hog"])]
    assert "task_orphaned" not in await _types(ledgered, task_id)
    await wait_until(lambda: "event_loop_stall_ended" in first.output(),
                     "the stall's end in the log", 10)
    stalled = [line for line in first.output().splitlines() if "event_loop_stalled" in line]
    assert stalled, first.output()
    assert effect_agents.HOG_FUNCTION in stalled[0]
    await _no_violations(ledgered)


@pytest.mark.timeout(120)
async def test_case4_stopped_zombie_does_not_act_after_escalation(ledgered: Engine,
                                                                  pool: WorkerPool) -> None:
    """A worker SIGSTOPped inside a non-idempotent sync tool, before its ensure_lease()
    guard, past its lease: the other worker escalates the call; reconcile is refused during
    the grace period; the zombie, continued, does not act; after the grace the operator's
    reconcile completes the task; the effect happened exactly once, by the operator."""
    zombie = await pool.spawn("zombie")
    task_id = await ledgered.submit(effect_agents.ZOMBIE, {"block_s": 1.2})
    await wait_until(lambda: _attempts(ledgered, "blocking"), "the zombie inside the tool", 30,
                     0.01)
    zombie.pause()
    await pool.spawn("survivor")
    await wait_until(lambda: escalations(ledgered, task_id), "the call's escalation", 30, 0.05)
    escalation = (await escalations(ledgered, task_id))[0]
    assert escalation.reason == "interrupted" and escalation.not_before_ms is not None
    await wait_until(lambda: _is(ledgered, task_id, "WAITING"),
                     "the task to wait for reconciliation", 30, 0.05)
    with pytest.raises(ReconcileRefused) as refused:
        await ledgered.reconcile(task_id, escalation.call_id, result={"charged": "by hand"})
    assert refused.value.not_before_ms == escalation.not_before_ms
    zombie.resume()
    await wait_until(lambda: "task_run_fenced" in zombie.output()
                     or "lease_lost" in zombie.output(), "the zombie to give up", 30)
    [row] = await _rows(ledgered, "blocking")
    assert (row.deliveries, row.applied) == (0, 0), zombie.output()
    # The operator charges by hand once the grace period is over, then reconciles.
    await _wait_past(ledgered, escalation.not_before_ms)
    await ledgered.database.fetch(OPERATOR_ACTED, row.key)
    await ledgered.reconcile(task_id, escalation.call_id, result={"charged": "by hand"})
    await wait_until(lambda: _is(ledgered, task_id, "COMPLETED"),
                     "the reconciled task to complete", 30, 0.05)
    assert (await ledgered.state(task_id)).output == {"charged": "by hand"}
    [row] = await _rows(ledgered, "blocking")
    assert (row.deliveries, row.applied) == (1, 1)


async def _attempts(engine: Engine, tool: str) -> bool:
    return any(row.attempts for row in await _rows(engine, tool))


async def _wait_past(engine: Engine, not_before_ms: int) -> None:
    """Wait (with a deadline) until the database clock is past ``not_before_ms``."""

    async def past() -> bool:
        row = await engine.database.fetchrow(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8 AS now_ms")
        return int(row["now_ms"]) >= not_before_ms

    await wait_until(past, "the grace period to end", 30, 0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("agent", "tool", "expected"), [
    (effect_agents.CHARGE, "charge", "FAILED"),
    (effect_agents.CHARGE_LOOKUP, "charge-lookup", "COMPLETED"),
], ids=["escalated", "looked-up"])
async def test_case5_kill_after_intent_of_a_non_idempotent_call(
        ledgered: Engine, pool: WorkerPool, agent: str, tool: str, expected: str) -> None:
    """A worker SIGKILLed right after the intent of a non-idempotent call: the survivor
    escalates it (interrupted; on_uncertain="fail" fails the task) as the README's crash
    table says, and never runs it; with a lookup it asks the lookup instead, which finds
    nothing, and makes the call: acted once."""
    doomed = await pool.spawn("doomed", failpoint="after_intent_commit:1:sigkill")
    task_id = await ledgered.submit(agent, {"n": 1})
    await doomed.exited()
    await pool.spawn("survivor")
    await wait_until(lambda: _is(ledgered, task_id, expected),
                     f"the task to be {expected}", 30, 0.05)
    rows = await _rows(ledgered, tool)
    types = await _types(ledgered, task_id)
    if expected == "FAILED":
        assert rows == []
        [escalation] = await escalations(ledgered, task_id)
        assert escalation.reason == "interrupted"
        state = await ledgered.state(task_id)
        assert state.failure is not None and state.failure.reason == "uncertain_side_effect"
    else:
        assert [(r.deliveries, r.applied) for r in rows] == [(1, 1)]
        assert "tool_call_uncertain" not in types
    await _no_violations(ledgered)



@pytest.mark.timeout(120)
async def test_worker_stopped_past_its_drain_waits_for_the_sync_calls_thread(
        ledgered: Engine, pool: WorkerPool) -> None:
    """A worker SIGTERMed while a non-idempotent def tool blocks its thread 3 s, with a
    drain timeout of 0.5 s and a second worker running: the stopping worker keeps the lease
    until the thread has ended (logging drain_waiting_on_thread with the call id), records
    the tool's result, then hands the task back; the other worker completes it from the
    log. The tool acted once, nothing was escalated (so no reconcile was ever offered) and
    no lease was broken. On the old code the task was handed back at 0.5 s while the thread
    ran, and the other worker escalated the call (the task failed; a tool without an
    ensure_lease() guard would then have acted after the escalation)."""
    stopping = await pool.spawn("stopping", drain_timeout_s=0.5)
    task_id = await ledgered.submit(effect_agents.BLOCKING, {"block_s": 3.0})
    await wait_until(lambda: _attempts(ledgered, "blocking"), "the tool's thread to start",
                     30, 0.01)
    other = pool.start("other")
    stopping.kill(signal.SIGTERM)
    [row] = await _rows(ledgered, "blocking")
    assert row.applied == 0  # The stop came while the tool's thread was still blocked.
    await other.ready()
    await wait_until(lambda: _ended(ledgered, task_id), "the task to end or wait", 30, 0.05)
    [row] = await _rows(ledgered, "blocking")
    assert (row.attempts, row.deliveries, row.applied, row.owners) == (1, 1, 1, ["stopping"])
    types = await _types(ledgered, task_id)
    assert "tool_call_uncertain" not in types and "task_orphaned" not in types, types
    # The result was recorded before the hand-back: the other worker never ran the tool.
    assert types.index("tool_call_completed") < types.index("task_released")
    assert await _is(ledgered, task_id, "COMPLETED")
    assert (await ledgered.state(task_id)).output == {"charged": True}
    assert await stopping.exited() == 0, stopping.output()
    [call_id] = (await ledgered.state(task_id)).calls
    waited = [line for line in stopping.output().splitlines()
              if "drain_waiting_on_thread" in line]
    assert waited and call_id in waited[0], stopping.output()
    await _no_violations(ledgered)


async def _ended(engine: Engine, task_id: str) -> bool:
    return str((await engine.head(task_id)).status) in ("COMPLETED", "FAILED", "WAITING")
