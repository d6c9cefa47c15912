"""Queues (issue 24) under worker crashes: real worker processes SIGKILLed while they hold
queue slots. The slots come back when the dead worker's lease is broken, and the ledger of
the log's own claim and release events never shows a queue past its limits."""

from __future__ import annotations

import asyncio
import os
import random
import time

from tests.fault.conftest import FaultHarness, wait_for
from tests.fault.support import FIGURES
from tests.queue_ledger import read_ledger

LIMIT = 3
WORKER_LIMIT = 2


async def _all_done(harness: FaultHarness) -> bool:
    rows = await harness.engine.database.fetch(
        "SELECT count(*) AS n FROM wal_tasks WHERE status <> 'COMPLETED'")
    return int(rows[0]["n"]) == 0


async def test_killed_workers_give_their_queue_slots_back(harness: FaultHarness) -> None:
    """Three worker processes on a queue of limit 3 (2 per worker), one SIGKILLed at random
    four times while holding slots: every task completes, each effect once, and the log's
    ledger never shows more than 3 (or 2 in a worker) running, nor a partition broken."""
    seed = int(os.environ.get("FAULT_SEED", "2424"))
    rng = random.Random(seed)
    engine = harness.engine
    await engine.set_queue("limited", concurrency_max=LIMIT, worker_concurrency_max=WORKER_LIMIT)
    for n in range(30):
        await engine.submit("steps", {"tools": 2, "latency_ms": 60}, task_id=f"q-{n:02d}",
                            queue="limited", partition_key=rng.choice([None, "c1", "c2"]),
                            priority=rng.choice([0, 1]))
    workers = {slot: await harness.spawn(f"w{slot}-0", concurrency=4) for slot in range(3)}
    kills = 0
    deadline = time.monotonic() + 120
    while kills < 4 and not await _all_done(harness):
        await asyncio.sleep(rng.uniform(0.3, 0.6))
        holding = {r["lease_owner"] for r in await engine.database.fetch(
            "SELECT lease_owner FROM wal_tasks WHERE status IN ('RUNNING', 'CHECKPOINTED')")}
        slot = next((s for s, w in workers.items() if w.worker_id in holding), None)
        if slot is None:
            continue  # Kill only a worker that holds a slot now.
        workers[slot].kill()
        workers[slot].process.wait(timeout=10)
        kills += 1
        workers[slot] = await harness.spawn(f"w{slot}-{kills}", concurrency=4)
    await wait_for(lambda: _all_done(harness), "every task to complete",
                   max(1.0, deadline - time.monotonic()), interval_s=0.2)
    await harness.assert_effects_once_and_intended()
    async with engine.database.acquire() as connection:
        ledger = await read_ledger(connection)
    orphaned = (await engine.database.fetchrow(
        "SELECT count(*) AS n FROM wal_events WHERE type = 'task_orphaned'"))["n"]
    peak, worker_peak = ledger.peak("limited"), ledger.peak("limited", by_worker=True)
    FIGURES.append(f"queue slots: seed {seed}, {kills} kills, {orphaned} leases broken, "
                   f"{len(ledger.slots)} slots held, peak {peak}/{LIMIT}, per worker "
                   f"{worker_peak}/{WORKER_LIMIT}")
    assert kills >= 1 and orphaned >= 1  # Slots were held by a dead worker, then given back.
    assert peak == LIMIT and worker_peak == WORKER_LIMIT
    assert ledger.partition_violations() == []
