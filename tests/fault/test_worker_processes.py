"""Real worker processes killed (SIGKILL) and paused (SIGSTOP) at the worst moments."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import time

import pytest

from tests.fault.agents import ZOMBIE_WORKER, big_text
from tests.fault.conftest import FaultHarness, wait_for
from wal_engine.state_machine import TERMINAL, Status


async def _status(harness: FaultHarness, task_id: str) -> Status:
    return (await harness.engine.head(task_id)).status


@pytest.mark.parametrize(
    "point", ["after_intent_commit", "after_effect_before_result", "after_result_commit"]
)
async def test_w1_sigkill_in_each_window_then_another_worker_finishes(
    harness: FaultHarness, point: str
) -> None:
    """A worker SIGKILLed at a crash window: another worker completes, effects exactly once."""
    task_id = await harness.engine.submit("steps", {"tools": 3})
    doomed = await harness.spawn("doomed", failpoint=f"{point}:2:sigkill")
    await wait_for(lambda: doomed.process.poll() is not None, "the SIGKILL", 30)
    assert doomed.process.returncode == -signal.SIGKILL
    await harness.spawn("survivor")
    await wait_for(lambda: _terminal(harness, task_id), "completion", 30)
    state = await harness.engine.state(task_id)
    assert state.status is Status.COMPLETED and state.output == 6
    rows = await harness.assert_effects_once_and_intended()
    assert len(rows) == 3
    assert (await harness.engine.store.verify_task(task_id)).ok
    print(f"W1 {point}: 1 kill, {sum(r['deliveries'] for r in rows)} deliveries, "
          f"{sum(r['applied'] for r in rows)} applied, 0 violations")


async def _terminal(harness: FaultHarness, task_id: str) -> bool:
    return await _status(harness, task_id) in TERMINAL


async def test_w6_paused_zombie_is_fenced_and_acts_no_more(harness: FaultHarness) -> None:
    """A worker SIGSTOPped past its lease and resumed after a takeover writes and does nothing."""
    task_id = await harness.engine.submit("zombie_target")
    zombie = await harness.spawn(ZOMBIE_WORKER)
    await wait_for(lambda: harness.engine.database.fetch(
        "SELECT 1 FROM fault_flags WHERE name = 'zombie-inside'"), "the zombie inside its tool")
    zombie_epoch = (await harness.engine.head(task_id)).lease_epoch
    zombie.kill(signal.SIGSTOP)
    try:
        await harness.spawn("rescuer")
        await wait_for(lambda: _terminal(harness, task_id), "the rescuer to finish", 30)
        await harness.engine.database.fetch("INSERT INTO fault_flags VALUES ('release-zombie')")
    finally:
        zombie.kill(signal.SIGCONT)
    await wait_for(lambda: "task_run_fenced" in zombie.output(), "the zombie to be fenced", 30)
    state = await harness.engine.state(task_id)
    assert state.status is Status.COMPLETED and state.output == 6
    history = await harness.engine.history(task_id)
    takeover = min(r.seq for r in history if r.epoch > zombie_epoch)
    assert all(r.seq < takeover for r in history if r.epoch <= zombie_epoch)
    rows = await harness.assert_effects_once_and_intended()
    third = [r for r in rows if r["tool"] == "third"]
    assert len(third) == 1 and ZOMBIE_WORKER not in third[0]["owners"]
    assert (await harness.engine.store.verify_task(task_id)).ok


async def test_timers_and_signals_survive_worker_restarts(harness: FaultHarness) -> None:
    """A worker killed while its task sleeps, another killed while it waits: nothing lost."""
    task_id = await harness.engine.submit("sleepy", {"sleep_s": 0.5})
    first = await harness.spawn("first")
    await wait_for(lambda: _waiting(harness, task_id, None), "the durable sleep")
    first.kill()
    second = await harness.spawn("second")
    await wait_for(lambda: _waiting(harness, task_id, "go"), "the signal wait", 30)
    second.kill()
    await harness.engine.signal(task_id, "go", {"answer": 42})
    await harness.spawn("third")
    await wait_for(lambda: _terminal(harness, task_id), "completion", 30)
    state = await harness.engine.state(task_id)
    assert state.output == {"answer": 42}
    await harness.assert_effects_once_and_intended()


async def _waiting(harness: FaultHarness, task_id: str, signal_name: str | None) -> bool:
    head = await harness.engine.head(task_id)
    return head.status is Status.WAITING and head.waiting_signal == signal_name


async def test_l1_200_tasks_4_workers_random_sigkills(harness: FaultHarness) -> None:
    """200 tasks over 4 worker processes with random SIGKILLs: all complete, none twice."""
    seed = int(os.environ.get("FAULT_SEED", "1234"))
    rng = random.Random(seed)
    task_ids = [await harness.engine.submit("steps", {"tools": 3, "latency_ms": 40},
                                            task_id=f"bulk-{n}") for n in range(200)]
    workers = {slot: await harness.spawn(f"w{slot}-0", concurrency=4) for slot in range(4)}
    kills, generation = 0, 0
    deadline = time.monotonic() + 240
    while kills < 10 and not await _all_terminal(harness):
        await asyncio.sleep(rng.uniform(0.2, 0.5))
        slot = rng.randrange(4)
        workers[slot].kill()
        workers[slot].process.wait(timeout=10)
        kills, generation = kills + 1, generation + 1
        workers[slot] = await harness.spawn(f"w{slot}-{generation}", concurrency=4)
    await wait_for(lambda: _all_terminal(harness), "every task to finish",
                   max(1.0, deadline - time.monotonic()), interval_s=0.2)
    statuses = {r["status"] for r in await harness.engine.database.fetch(
        "SELECT DISTINCT status FROM wal_tasks")}
    assert statuses == {"COMPLETED"}
    rows = await harness.assert_effects_once_and_intended()
    assert len(rows) == 3 * len(task_ids)
    gaps = await harness.engine.database.fetch(
        "SELECT task_id FROM wal_events GROUP BY task_id HAVING max(seq) <> count(*)")
    assert gaps == []
    for task_id in task_ids:
        assert (await harness.engine.store.verify_task(task_id)).ok
    print(f"L1 seed={seed}: 200 tasks, 4 workers, {kills} SIGKILLs, {len(rows)} effects, "
          f"{sum(r['deliveries'] for r in rows)} deliveries, 0 violations")


async def _all_terminal(harness: FaultHarness) -> bool:
    rows = await harness.engine.database.fetch(
        "SELECT count(*) AS open FROM wal_tasks WHERE status NOT IN ('COMPLETED', 'FAILED')")
    return rows[0]["open"] == 0


async def test_sigterm_hands_the_task_back_and_exits_zero(harness: FaultHarness) -> None:
    """SIGTERM: the worker stops at the next durable point, the task is RESUMING, exit 0."""
    task_id = await harness.engine.submit("steps", {"tools": 6, "latency_ms": 200})
    leaving = await harness.spawn("leaving")
    await wait_for(lambda: _events(harness, task_id, "tool_call_completed"), "a first step")
    leaving.kill(signal.SIGTERM)
    await wait_for(lambda: leaving.process.poll() is not None, "the graceful exit", 30)
    assert leaving.process.returncode == 0, leaving.output()
    head = await harness.engine.head(task_id)
    history = await harness.engine.history(task_id)
    assert head.status is Status.RESUMING and history[-1].type == "task_released"
    assert head.lease_owner is None
    await harness.spawn("successor")
    await wait_for(lambda: _terminal(harness, task_id), "completion", 30)
    assert (await harness.engine.state(task_id)).output == 21
    await harness.assert_effects_once_and_intended()


async def _events(harness: FaultHarness, task_id: str, kind: str) -> bool:
    return any(r.type == kind for r in await harness.engine.history(task_id))


async def test_large_results_survive_a_worker_killed_after_storing_one(
        harness: FaultHarness) -> None:
    """A worker SIGKILLed right after it committed a 5 MiB tool result (in wal_blobs): the
    worker that takes the task over reads the value back from the log, the tool acts once,
    and the code sees the same bytes on both sides of the crash (decision 61)."""
    size = 5 * 1024 * 1024
    task_id = await harness.engine.submit("big_values", {"tools": 2, "bytes": size})
    # A lease of 4 s: redacting 5 MiB holds the GIL for up to a second on a loaded machine.
    timings = {"lease_ttl_ms": 4_000, "heartbeat_ms": 500}
    doomed = await harness.workers.spawn("doomed", failpoint="after_result_commit:1:sigkill",
                                         **timings)
    await wait_for(lambda: doomed.process.poll() is not None, "the SIGKILL", 60)
    assert doomed.process.returncode == -signal.SIGKILL
    await harness.workers.spawn("survivor", **timings)
    await wait_for(lambda: _terminal(harness, task_id), "completion", 90)
    state = await harness.engine.state(task_id)
    assert state.status is Status.COMPLETED, state.failure
    assert state.output == [hashlib.sha256(big_text(i, size).encode()).hexdigest()
                            for i in range(2)]
    rows = await harness.assert_effects_once_and_intended()
    assert len(rows) == 2
    assert (await harness.engine.store.verify_task(task_id)).ok
    chunks = await harness.engine.database.fetch(
        "SELECT count(*) AS n, count(DISTINCT digest) AS values FROM wal_blobs "
        "WHERE task_id = $1", task_id)
    assert chunks[0]["values"] == 2 and chunks[0]["n"] == 12
