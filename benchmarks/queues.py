"""What queue limits cost the claim (issue 24): the claim statement with limits on, against
the plain claim, in the same run.

Three contenders, each a tenant of its own on one database (a claim takes every queue of
its tenant, so the contenders must not see one another's tasks), each holding
``background_running`` tasks leased (the running set a global limit counts):

* ``plain``: tasks in ``default``, no queue configured (the claim as before issue 24);
* ``limits``: tasks in a queue with a global and a per-worker limit, set high enough never
  to refuse (the claim takes the queue's lock and counts its running tasks);
* ``limits + partitions``: the same, each task with a partition key (the claim also checks
  the key's older and started tasks, before and after the lock).

Workloads: ``claim1`` (one task per claim statement), ``claim8`` (eight, a worker with
eight free slots) and ``claim1x4`` (four claimers at once, one task each: the queue's lock
serialises them where the plain claim does not). Only the claim statement is timed; each
claimed task is completed untimed inside the operation, so the running set stays the same.
Before each round (untimed) ``wal_tasks`` is analysed, as autovacuum does on a live database.

Usage: ``python -m benchmarks.queues [--dsn DSN] [--quick] [--rounds N] [--ops N]``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Final

from benchmarks import harness
from wal_engine import events as vocabulary
from wal_engine.store import Database, PendingAppend, Store, queries
from wal_engine.store.queues import Placement, set_queue

NAME: Final = "queues"
QUEUE: Final = "bench-limited"
background_running: Final = 32
claimers: Final = 4


class Side:
    """One contender: its tenant's store, how its tasks are placed, and its counter."""

    def __init__(self, database: Database, name: str, *, limited: bool,
                 partitioned: bool) -> None:
        self.store = Store(database)
        self.name = name
        self.limited = limited
        self.partitioned = partitioned
        self.numbers = itertools.count()
        self.run_id = f"{time.strftime('%m%d%H%M%S')}-{os.getpid()}"

    async def prepare(self) -> None:
        """Untimed: the queue's limits (never reached) and the leased background tasks."""
        if self.limited:
            await set_queue(self.store.database, QUEUE, concurrency_max=100_000,
                            worker_concurrency_max=100_000)
        await self.queue(background_running)
        await self.claim("bench-background", background_running)

    async def queue(self, count: int) -> None:
        """Untimed: ``count`` tasks to claim."""
        for _ in range(count):
            number = next(self.numbers)
            placement = Placement(
                queue=QUEUE if self.limited else "default",
                partition_key=f"key-{number}" if self.partitioned else None)
            await self.store.create_task(f"bq-{self.run_id}-{number}", harness.BENCH_AGENT,
                                         placement=placement)

    async def claim(self, worker: str, count: int) -> list[PendingAppend]:
        """One claim statement (as a worker sends it); the completions of what it took."""
        running = [background_running] if self.limited else []
        rows = await self.store.database.fetch(
            queries.CLAIM_TASKS_BY_QUEUE, worker, count, harness.LEASE_TTL_MS,
            [harness.BENCH_AGENT], None, [QUEUE] if self.limited else [], running)
        if len(rows) != count:
            raise RuntimeError(f"{self.name}: claimed {len(rows)} tasks, expected {count}")
        return [PendingAppend(task_id=row["task_id"], epoch=row["lease_epoch"],
                              expected_seq=row["head_seq"], prev_hash=row["head_hash"],
                              events=[vocabulary.TaskCompleted()]) for row in rows]

    async def complete(self, done: list[PendingAppend]) -> None:
        """Untimed: end the claimed tasks, so the running set stays as it was."""
        outcome = await self.store.append_many(done)
        failed = [value for value in outcome.values() if isinstance(value, Exception)]
        if failed:
            raise failed[0]

    def operation(self, batch: int, parallel: int) -> Callable[[], Awaitable[int]]:
        """``parallel`` claim statements at once of ``batch`` tasks each; the claims timed."""
        async def run() -> int:
            start = time.perf_counter_ns()
            taken = await asyncio.gather(*(self.claim(f"bench-{n}", batch)
                                           for n in range(parallel)))
            elapsed = time.perf_counter_ns() - start
            await self.complete([item for items in taken for item in items])
            return elapsed

        return run

    def queuer(self, count: int) -> Callable[[int], Awaitable[None]]:
        async def before_round(_round: int) -> None:
            await self.queue(count)
            # Statistics as autovacuum keeps them on a live database. Without, the claim's
            # cached generic plans are the ones made when the tables were empty (sequential
            # scans), and a table grown in a minute makes them worse by the round (measured:
            # the partition check to 40x, the plain claim to 5x).
            await self.store.database.fetch("ANALYZE wal_tasks")

        return before_round


WORKLOADS: Final = {
    "claim1": (1, 1, "claim one task (one statement)"),
    "claim8": (8, 1, "claim eight tasks in one statement"),
    "claim1x4": (1, claimers, f"{claimers} claim statements at once, one task each"),
}


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=10, ops=50)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=8)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    run_tag = f"{time.strftime('%H%M%S')}-{os.getpid()}"
    opened: list[Database] = []
    sides: list[Side] = []
    for name, limited, partitioned in (("plain claim (default queue)", False, False),
                                       ("limits (global + per worker)", True, False),
                                       ("limits + partition keys", True, True)):
        database = await Database.open(dsn, migrate=True, development=True,
                                       tenant=f"bq{len(sides)}-{run_tag}", max_size=claimers + 2,
                                       application_name="bench:queues")
        opened.append(database)
        sides.append(Side(database, name, limited=limited, partitioned=partitioned))
    try:
        machine = await harness.describe_machine(dsn)
        for side in sides:
            await side.prepare()
        results = []
        for workload in harness.selected(list(WORKLOADS), args):
            batch, parallel, description = WORKLOADS[workload]
            per_round = (settings.ops + 2) * batch * parallel
            contenders = [harness.Contender(side.name, side.operation(batch, parallel),
                                            events_per_op=batch * parallel,
                                            reference=not side.limited,
                                            before_round=side.queuer(per_round))
                          for side in sides]
            results.append(await harness.run_workload(harness.Workload(
                name=workload, description=description, contenders=contenders,
                ops_per_round=settings.ops), rounds=settings.rounds))
    finally:
        for database in opened:
            await database.close()
    print(harness.format_report(NAME, machine, results, settings))
    if not args.no_json:
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path)
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
