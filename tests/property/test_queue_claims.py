"""Queues (issue 24), property: for random submissions (queues, priorities, partition keys),
claims by several workers, completions, worker crashes and limits changed at run time, no
task is claimed while its queue holds its global limit then in effect, no worker holds more
than its per-worker limit, and each partition runs one at a time in submission order, all
read from the log's own claim and release events; and once the workers stop crashing,
every task is claimed (the limits hold work back, they never lose it)."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.queue_ledger import LEDGER_SQL, ledger_of
from wal_engine import events as ev
from wal_engine.store import Store, queries
from wal_engine.store.queues import Placement, set_queue

_examples = itertools.count()
WORKERS = ("w0", "w1", "w2")

limits = st.tuples(st.integers(1, 3), st.one_of(st.none(), st.integers(1, 2)))
submits = st.tuples(st.just("submit"), st.integers(0, 1), st.integers(-1, 2),
                    st.sampled_from([None, 0, 0, 1]))
operations = st.lists(
    st.one_of(
        submits, submits,  # Twice as likely: enough tasks to hold the queues full.
        st.tuples(st.just("claim"), st.integers(0, 2), st.integers(1, 4)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("crash"), st.integers(0, 2)),
        st.tuples(st.just("limit"), st.integers(0, 1), st.integers(1, 3)),
    ),
    min_size=8, max_size=40,
)


class Model:
    """What each worker runs now (task -> queue), as the claims returned it."""

    def __init__(self, store: Store, queues: list[str]) -> None:
        self.store = store
        self.queues = queues
        self.running: dict[str, dict[str, str]] = {w: {} for w in WORKERS}
        self.submitted: list[str] = []

    async def claim(self, worker: str, n: int) -> list[str]:
        counts: dict[str, int] = {}
        for queue in self.running[worker].values():
            counts[queue] = counts.get(queue, 0) + 1
        rows = await self.store.database.fetch(
            queries.CLAIM_TASKS_BY_QUEUE, worker, n, 60_000, None, None, list(counts),
            list(counts.values()))
        for row in rows:
            self.running[worker][row["task_id"]] = row["queue"]
        return [row["task_id"] for row in rows]

    async def finish(self, pick: int) -> None:
        running = [(w, t) for w in WORKERS for t in sorted(self.running[w])]
        if not running:
            return
        worker, task_id = running[pick % len(running)]
        head = await self.store.read_head(task_id)
        last = (await self.store.read_events(task_id))[-1]
        await self.store.append_events(task_id, [ev.TaskCompleted(output=None)],
                                       epoch=head.lease_epoch, expected_seq=last.seq,
                                       prev_hash=last.hash)
        del self.running[worker][task_id]

    async def crash(self, worker: str) -> None:
        """The worker dies: its leases expire and a sweep breaks them (slots come back)."""
        if not self.running[worker]:
            return
        await self.store.database.fetch(
            "UPDATE wal_tasks SET lease_expires_at = now() - interval '1 second'"
            " WHERE task_id = ANY($1::text[])", list(self.running[worker]))
        await self.store.database.fetch("SELECT * FROM wal_break_leases(100)")
        self.running[worker] = {}


@settings(max_examples=40)
@given(first=limits, second=limits, ops=operations)
async def test_random_claims_never_pass_the_limits(store: Store, first: tuple[int, int | None],
                                                    second: tuple[int, int | None],
                                                    ops: list[tuple[Any, ...]]) -> None:
    """Random submissions, claims, completions, crashes and limit changes: the log's ledger
    shows no claim past the global limit then in effect (from the audit of changes), no
    worker past its limit, no partition broken; then every task runs."""
    n = next(_examples)
    queues = [f"p{n}a", f"p{n}b"]
    for queue, (limit, worker_limit) in zip(queues, (first, second), strict=True):
        await set_queue(store.database, queue, concurrency_max=limit,
                        worker_concurrency_max=worker_limit)
    model = Model(store, queues)
    for op in ops:
        if op[0] == "submit":
            _, queue, priority, key = op
            task_id = f"p{n}-{len(model.submitted)}"
            await store.create_task(task_id, "a", placement=Placement(
                queue=queues[queue], priority=priority,
                partition_key=None if key is None else f"k{key}"))
            model.submitted.append(task_id)
        elif op[0] == "claim":
            await model.claim(WORKERS[op[1]], op[2])
        elif op[0] == "finish":
            await model.finish(op[1])
        elif op[0] == "limit":  # Changed at run time, raised or lowered.
            await set_queue(store.database, queues[op[1]], concurrency_max=op[2])
        else:
            await model.crash(WORKERS[op[1]])
    # No more crashes: finish what runs and claim until nothing is left.
    for _ in range(4 * len(model.submitted) + 4):
        if not any(model.running.values()) and not await model.claim("w0", 4):
            break
        while any(model.running.values()):
            await model.finish(0)
    rows = [r for r in await store.database.fetch(LEDGER_SQL) if r["queue"] in queues]
    ledger = ledger_of(rows)
    changes = await store.database.fetch(
        "SELECT queue, changed_at, (after ->> 'concurrency_max')::int AS limit_"
        " FROM wal_queue_changes WHERE queue = ANY($1::text[]) ORDER BY change_id", queues)
    for queue, (_, worker_limit) in zip(queues, (first, second), strict=True):
        # The limits in effect over time, from the audit of their changes.
        in_effect = [(c["changed_at"], c["limit_"]) for c in changes if c["queue"] == queue]
        assert ledger.claims_past_limit(queue, in_effect) == []
        if worker_limit is not None:
            assert ledger.peak(queue, by_worker=True) <= worker_limit
    assert ledger.partition_violations() == []
    left = await store.database.fetch(
        "SELECT task_id, status FROM wal_tasks WHERE queue = ANY($1::text[])"
        " AND status <> 'COMPLETED'", queues)
    assert [tuple(r) for r in left] == []

