"""Queues (issue 24) on real PostgreSQL: limits, priorities, partitions, dedup ids, audit."""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import asyncpg
import pytest

from tests.queue_ledger import read_ledger
from wal_engine.engine import Engine
from wal_engine.errors import DuplicateDedupId, InvalidInput, UnknownQueue
from wal_engine.observability import metrics
from wal_engine.runtime.context import AgentContext
from wal_engine.state_machine import Status
from wal_engine.store import queries

FAST: dict[str, Any] = {"lease_ttl_ms": 600, "heartbeat_ms": 150, "poll_ms": 20, "sweep_ms": 100}


async def claim(engine: Engine, worker: str, n: int, running: dict[str, int] | None = None
                ) -> list[str]:
    """One claim statement as worker ``worker`` (running tasks by queue), task ids claimed."""
    counts = running or {}
    rows = await engine.database.fetch(queries.CLAIM_TASKS_BY_QUEUE, worker, n, 60_000, None,
                                       None, list(counts), list(counts.values()))
    return [row["task_id"] for row in rows]


async def finish(engine: Engine, task_id: str) -> None:
    """End a claimed task as its worker would (a fenced append of task_completed)."""
    from wal_engine import events as ev

    head = await engine.store.read_head(task_id)
    history = await engine.store.read_events(task_id)
    last = history[-1]
    await engine.store.append_events(task_id, [ev.TaskCompleted(output=None)],
                                     epoch=head.lease_epoch, expected_seq=last.seq,
                                     prev_hash=last.hash)


async def counts(engine: Engine) -> tuple[int, int, int]:
    """Rows of tasks, events and queue changes (what a refused call must leave as it was)."""
    row = await engine.database.fetchrow(
        "SELECT (SELECT count(*) FROM wal_tasks) AS t, (SELECT count(*) FROM wal_events) AS e,"
        " (SELECT count(*) FROM wal_queue_changes) AS c")
    return row["t"], row["e"], row["c"]


async def test_bad_input_is_refused_at_the_call_and_writes_nothing(engine: Engine) -> None:
    """Zero, negative or non-int limits, bad names, an unknown queue: typed errors, no rows."""
    await engine.set_queue("q", concurrency_max=2)
    before = await counts(engine)
    for limit in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidInput):
            await engine.set_queue("q", concurrency_max=limit)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            await engine.set_queue("q2", worker_concurrency_max=limit)  # type: ignore[arg-type]
    for name in ("", "a b", "x" * 65, "é", None):
        with pytest.raises(InvalidInput):
            await engine.set_queue(name, concurrency_max=1)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            await engine.submit("a", queue=name)  # type: ignore[arg-type]
    with pytest.raises(UnknownQueue) as unknown:
        await engine.submit("a", queue="nowhere")
    assert unknown.value.queue == "nowhere"
    for bad in ({"priority": 1.5}, {"priority": 10**7}, {"partition_key": ""},
                {"partition_key": "k\x00"}, {"dedup_id": "d" * 257}, {"dedup_id": 3}):
        with pytest.raises(InvalidInput):
            await engine.submit("a", queue="q", **bad)
    assert await counts(engine) == before
    # The database refuses a bad limit too (a caller that goes around the module).
    with pytest.raises(InvalidInput):
        await engine.database.fetch(queries.SET_QUEUE, "q", 0, None, [], None)
    assert await counts(engine) == before


async def test_limit_changes_are_audited(engine: Engine) -> None:
    """Each change records who, when, before and after; a call changing nothing records nothing."""
    created = await engine.set_queue("mail", concurrency_max=3, requested_by="ops")
    assert created.created and created.changed and created.concurrency_max == 3
    same = await engine.set_queue("mail", concurrency_max=3)
    assert not same.changed
    await engine.set_queue("mail", worker_concurrency_max=1, requested_by="ops")
    cleared = await engine.set_queue("mail", concurrency_max=None, requested_by="ops")
    assert cleared.concurrency_max is None and cleared.worker_concurrency_max == 1
    changes = await engine.queue_changes("mail")
    assert [(c.before, c.after) for c in changes] == [
        ({"concurrency_max": 3, "worker_concurrency_max": 1},
         {"concurrency_max": None, "worker_concurrency_max": 1}),
        ({"concurrency_max": 3, "worker_concurrency_max": None},
         {"concurrency_max": 3, "worker_concurrency_max": 1}),
        (None, {"concurrency_max": 3, "worker_concurrency_max": None}),
    ]
    assert all(c.requested_by == "ops" and c.changed_by for c in changes)
    with pytest.raises(Exception, match="append-only"):
        await engine.database.fetch("DELETE FROM wal_queue_changes")


async def test_dedup_id_refuses_a_second_live_task(engine: Engine) -> None:
    """A live task holding a dedup id refuses another; the same task id stays idempotent;
    once the first has ended the id is free again."""
    first = await engine.submit("a", {"x": 1}, task_id="t1", dedup_id="order-7")
    before = await counts(engine)
    with pytest.raises(DuplicateDedupId) as refused:
        await engine.submit("a", {"x": 2}, task_id="t2", dedup_id="order-7")
    assert refused.value.existing_task_id == first and refused.value.dedup_id == "order-7"
    assert await counts(engine) == before
    assert await engine.submit("a", {"x": 1}, task_id="t1", dedup_id="order-7") == first
    await engine.set_queue("other")
    await engine.submit("a", task_id="t3", queue="other", dedup_id="order-7")  # Per queue.
    assert await claim(engine, "w", 10) == ["t1", "t3"]
    await finish(engine, "t1")
    await engine.submit("a", task_id="t4", dedup_id="order-7")


async def test_priority_first_then_oldest(engine: Engine) -> None:
    """Higher priorities are claimed first; equal ones in submission order."""
    for task, priority in (("p0a", 0), ("p5a", 5), ("p0b", 0), ("p5b", 5), ("n1", -1)):
        await engine.submit("a", task_id=task, priority=priority)
    assert await claim(engine, "w", 2) == ["p5a", "p5b"]
    assert await claim(engine, "w", 10) == ["p0a", "p0b", "n1"]


async def test_global_and_worker_limits_hold_and_change_at_run_time(engine: Engine) -> None:
    """A full queue claims nothing more, another queue's tasks still go; a freed slot or a
    raised limit lets the next claim take more; the per-worker limit counts the caller's."""
    await engine.set_queue("llm", concurrency_max=2)
    for i in range(6):
        await engine.submit("a", task_id=f"l{i}", queue="llm")
    await engine.submit("a", task_id="d0")
    assert await claim(engine, "w1", 10) == ["l0", "l1", "d0"]
    assert await claim(engine, "w2", 10) == []
    await finish(engine, "l0")
    assert await claim(engine, "w2", 10) == ["l2"]
    await engine.set_queue("llm", concurrency_max=4, worker_concurrency_max=1)
    assert await claim(engine, "w2", 10, {"llm": 1}) == []
    assert await claim(engine, "w3", 10) == ["l3"]
    assert await claim(engine, "w4", 10, {}) == ["l4"]
    assert await claim(engine, "w5", 10, {}) == []  # 4 running: l1, l2, l3, l4.
    stats = {s.queue: s for s in await engine.queues()}
    assert (stats["llm"].running, stats["llm"].depth) == (4, 1)
    assert (stats["llm"].concurrency_max, stats["llm"].worker_concurrency_max) == (4, 1)
    assert stats["default"].running == 1 and not stats["default"].configured
    assert stats["llm"].oldest_wait_s is not None and stats["llm"].oldest_wait_s >= 0


async def test_partition_runs_one_at_a_time_in_submission_order(engine: Engine) -> None:
    """Tasks of one key run one at a time, oldest first; other keys are not held up."""
    for task, key in (("a1", "alice"), ("a2", "alice"), ("b1", "bob"), ("a3", "alice"),
                      ("n1", None)):
        await engine.submit("a", task_id=task, partition_key=key, priority=9 if task == "a3"
                            else 0)
    assert await claim(engine, "w", 10) == ["a1", "b1", "n1"]
    assert await claim(engine, "w", 10) == []
    await finish(engine, "a1")
    assert await claim(engine, "w", 10) == ["a2"]  # a3's priority does not jump its key.
    await finish(engine, "a2")
    assert await claim(engine, "w", 10) == ["a3"]


DEEP = pytest.mark.skipif(os.environ.get("RELIABILITY_DEEP") != "1",
                          reason="deep tier: set RELIABILITY_DEEP=1 to run it")


@pytest.mark.parametrize(("tasks", "engines_n", "seed"), [
    (36, 4, 24),
    pytest.param(600, 6, 2424, marks=[pytest.mark.deep, DEEP]),
])
async def test_workers_in_parallel_never_exceed_the_limits(
        engine: Engine, database_dsn: str, tasks: int, engines_n: int, seed: int) -> None:
    """Several engines' workers (their own pools, so concurrent claims in PostgreSQL) on
    one queue of limit 3, per-worker 2, and partitions: the log's ledger never shows more."""
    from wal_engine.engine import connect

    await engine.set_queue("tight", concurrency_max=3, worker_concurrency_max=2)
    engines = [engine] + [await connect(database_dsn, migrate=False, pool_size_max=4)
                          for _ in range(engines_n - 1)]
    rng = random.Random(seed)

    async def body(ctx: AgentContext, task_input: Any) -> Any:
        await asyncio.sleep(task_input["sleep_s"])
        return None

    for each in engines:
        each.register("q", body)
    ids = []
    for i in range(tasks):
        key = rng.choice([None, None, "k1", "k2"])
        ids.append(await engine.submit("q", {"sleep_s": rng.uniform(0.005, 0.04)},
                                       task_id=f"t{i:03d}", queue="tight", partition_key=key,
                                       priority=rng.choice([0, 0, 1])))
    workers = [each.worker(concurrency=3, **FAST) for each in engines]
    runs = [asyncio.create_task(w.run()) for w in workers]
    try:
        for task_id in ids:
            state = await engine.wait(task_id, timeout_s=120)
            assert state.status is Status.COMPLETED
    finally:
        for w in workers:
            w.stop()
        await asyncio.gather(*runs)
        for each in engines[1:]:
            await each.close()
    async with engine.database.acquire() as connection:
        ledger = await read_ledger(connection)
    if metrics.available():  # The workers' sweeps read the queues into the gauges.
        from prometheus_client import REGISTRY

        assert REGISTRY.get_sample_value("wal_engine_queue_concurrency_max",
                                         {"tenant": "default", "queue": "tight"}) == 3
    assert len(ledger.slots) >= tasks
    # Reached (the workload saturates them) and never passed.
    assert ledger.peak("tight") == 3
    assert ledger.peak("tight", by_worker=True) == 2
    assert ledger.partition_violations() == []


async def test_upgrade_from_a_database_without_queues(pg_server: Any, database_factory: Any
                                                      ) -> None:
    """A version-3 database with tasks (no queue columns) gets them in place; its tasks are
    in 'default' and are claimed as before."""
    from wal_engine.engine import connect
    from wal_engine.store.connection import apply_schema

    dsn = await database_factory.create()
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("SET wal.tenant = 'default'")
        # Take the database back to before this section: drop what it added.
        await connection.execute("""
            DROP TABLE wal_queues, wal_queue_changes;
            DROP FUNCTION wal_set_queue;
            ALTER TABLE wal_tasks DROP COLUMN queue, DROP COLUMN priority,
                DROP COLUMN partition_key, DROP COLUMN dedup_id;
            DROP FUNCTION wal_claim_tasks(text, integer, bigint, text[], text[], text[],
                                          integer[]);
            CREATE FUNCTION wal_claim_tasks(p_worker text, p_limit integer,
                    p_lease_ttl_ms bigint, p_agents text[] DEFAULT NULL,
                    p_versions text[] DEFAULT NULL)
                RETURNS TABLE (task_id text) LANGUAGE sql AS 'SELECT NULL::text';
            UPDATE wal_schema_version SET checksum = NULL""")
        assert await apply_schema(connection)
        # The version-3 claim (five parameters) is replaced, not left beside the new one.
        assert await connection.fetchval(
            "SELECT array_agg(oid::regprocedure::text) FROM pg_proc"
            " WHERE proname = 'wal_claim_tasks'") == [
            "wal_claim_tasks(text,integer,bigint,text[],text[],text[],integer[])"]
        columns = await connection.fetchval(
            "SELECT count(*) FROM information_schema.columns WHERE table_name = 'wal_tasks'"
            " AND column_name IN ('queue', 'priority', 'partition_key', 'dedup_id')")
        assert columns == 4
        assert not await apply_schema(connection)  # Idempotent: nothing to do again.
    finally:
        await connection.close()
    upgraded = await connect(dsn, migrate=False)
    try:
        task = await upgraded.submit("a")
        assert await claim(upgraded, "w", 1) == [task]
    finally:
        await upgraded.close()
        await database_factory.drop(dsn)


async def test_cli_sets_lists_and_audits_queues(engine: Engine) -> None:
    """`queue set`, `submit --queue ...`, `queues` and `queue history` through the CLI; a
    zero limit, a bad number and an unknown queue are one-line errors with exit code 2."""
    from tests.integration.test_cli_agents import cli, lines, one_error_line

    dsn = engine.database.dsn
    made = await cli("queue", "set", "llm", "--concurrency", "2", "--worker-concurrency", "1",
                     "--dsn", dsn, "--json")
    assert made.exit_code == 0, made.output
    assert lines(made.stdout) == [{"queue": "llm", "concurrency_max": 2,
                                   "worker_concurrency_max": 1, "created": True,
                                   "changed": True}]
    for bad in (["--concurrency", "0"], ["--concurrency", "-3"], ["--worker-concurrency", "x"]):
        refused = await cli("queue", "set", "llm", *bad, "--dsn", dsn)
        assert refused.exit_code == 2 and "error:" in one_error_line(refused)
    unknown = await cli("submit", "a", "--queue", "nope", "--dsn", dsn)
    assert unknown.exit_code == 2 and "not configured" in one_error_line(unknown)
    submitted = await cli("submit", "a", "--queue", "llm", "--priority", "3",
                          "--partition-key", "c1", "--dedup-id", "d1", "--dsn", dsn, "--json")
    assert submitted.exit_code == 0, submitted.output
    again = await cli("submit", "a", "--queue", "llm", "--dedup-id", "d1", "--dsn", dsn)
    assert again.exit_code == 3 and "dedup id" in one_error_line(again)
    listed = lines((await cli("queues", "--dsn", dsn, "--json")).stdout)
    assert [(q["queue"], q["depth"], q["running"], q["concurrency_max"]) for q in listed] == [
        ("llm", 1, 0, 2)]
    human = await cli("queues", "--dsn", dsn)
    assert human.exit_code == 0 and "llm" in human.stdout
    await cli("queue", "set", "llm", "--concurrency", "none", "--dsn", dsn)
    history = lines((await cli("queue", "history", "llm", "--dsn", dsn, "--json")).stdout)
    assert [h["after"]["concurrency_max"] for h in history] == [None, 2]
    assert history[0]["before"] == {"concurrency_max": 2, "worker_concurrency_max": 1}


async def test_tenant_roles_see_and_change_only_their_own_queues(tenant_roles: Any) -> None:
    """As tenants' own runtime roles (security.sql applied): each sets, audits and claims
    through its queues only; the runtime role cannot write the queue tables directly."""
    from wal_engine.engine import connect

    a = await connect(await tenant_roles.dsn("ta"), migrate=False, development=False)
    b = await connect(await tenant_roles.dsn("tb"), migrate=False, development=False)
    try:
        await a.set_queue("shared-name", concurrency_max=1, requested_by="a-ops")
        with pytest.raises(UnknownQueue):
            await b.submit("x", queue="shared-name")  # Another tenant's queue is not b's.
        await b.set_queue("shared-name", concurrency_max=5)
        for task in ("a1", "a2"):
            await a.submit("x", task_id=task, queue="shared-name")
        await b.submit("x", task_id="b1", queue="shared-name")
        assert await claim(a, "wa", 10) == ["a1"]  # a's limit of 1, through SECURITY DEFINER.
        assert await claim(b, "wb", 10) == ["b1"]
        assert [(q.queue, q.concurrency_max, q.running) for q in await a.queues()] == [
            ("shared-name", 1, 1)]
        changes = await a.queue_changes()
        assert [c.requested_by for c in changes] == ["a-ops"]
        assert changes[0].changed_by == (await tenant_roles.create("ta")).role
        for statement in ("UPDATE wal_queues SET concurrency_max = 100",
                          "INSERT INTO wal_queues (queue) VALUES ('sneaky')",
                          "DELETE FROM wal_queue_changes"):
            with pytest.raises(Exception, match=r"permission denied|append-only"):
                await a.database.fetch(statement)
    finally:
        await a.close()
        await b.close()


async def test_a_fork_waits_in_its_parents_queue(engine: Engine) -> None:
    """A fork of a task is placed in its parent's queue at its parent's priority (not under
    its partition key nor its dedup id)."""
    await engine.set_queue("llm", concurrency_max=1)
    parent = await engine.submit("a", task_id="parent", queue="llm", priority=5,
                                 partition_key="c1", dedup_id="d1")
    assert await claim(engine, "w", 1) == [parent]
    await finish(engine, parent)
    child = await engine.fork(parent, 2)
    row = await engine.database.fetchrow(
        "SELECT queue, priority, partition_key, dedup_id FROM wal_tasks WHERE task_id = $1",
        child)
    assert tuple(row) == ("llm", 5, None, None)
