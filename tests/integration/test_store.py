"""The store against real PostgreSQL: fenced appends, bad input, append-only, verify."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import asyncpg
import pytest

from tests.helpers import claim, claimed_task, head_args, log_snapshot
from wal_engine import events as ev
from wal_engine import limits
from wal_engine.chain import GENESIS_HASH, event_hash
from wal_engine.errors import (
    AppendOnlyViolation,
    ConcurrencyConflict,
    IllegalTransition,
    InvalidInput,
    InvalidPayload,
    InvalidTaskId,
    LeaseLost,
    PayloadTooLarge,
    SchemaMismatch,
    TaskAlreadyExists,
    UnknownTask,
)
from wal_engine.state_machine import TRANSITIONS, Status
from wal_engine.store import Database, PendingAppend, Store, queries
from wal_engine.store.connection import SCHEMA_VERSION, apply_schema


def message(text: str = "hello") -> ev.MessageAppended:
    """A small observation event."""
    return ev.MessageAppended(role="user", content=text)


async def test_submit_creates_queued_task_with_first_event(store: Store) -> None:
    """A new task is QUEUED with task_submitted at seq 1 and a verifiable chain."""
    head, created = await store.create_task("t-1", "agent", input={"q": 1})
    assert created and head.status is Status.QUEUED and head.head_seq == 1
    history = await store.history("t-1")
    assert [r.type for r in history] == ["task_submitted"]
    assert history[0].decode() == ev.TaskSubmitted(agent="agent", input={"q": 1})
    assert (await store.verify_task("t-1")).ok


async def test_submit_is_idempotent_on_task_id(store: Store) -> None:
    """The same submission twice gives one task; a different one under the id is refused."""
    await store.create_task("t-1", "agent", input={"q": 1})
    _, created = await store.create_task("t-1", "agent", input={"q": 1})
    assert not created
    with pytest.raises(TaskAlreadyExists):
        await store.create_task("t-1", "agent", input={"q": 2})
    assert len(await store.history("t-1")) == 1


async def test_concurrent_duplicate_submissions_make_one_task(store: Store) -> None:
    """Ten concurrent submissions of one id create one task and one stream (L2)."""
    results = await asyncio.gather(
        *(store.create_task("dup", "agent", input={"n": 1}) for _ in range(10))
    )
    assert sum(created for _, created in results) == 1
    assert len(await store.history("dup")) == 1


async def test_append_batch_is_one_commit_and_chains(store: Store) -> None:
    """A batch lands whole, seqs follow the head, and the chain verifies."""
    head = await claimed_task(store)
    result = await store.append_events("task-1", [message("a"), message("b")],
                                       **head_args(head, 1))
    assert (result.first_seq, result.head_seq) == (3, 4)
    after = await store.read_head("task-1")
    assert after.head_seq == 4 and after.head_hash == result.head_hash
    assert [r.seq for r in await store.history("task-1")] == [1, 2, 3, 4]
    assert (await store.verify_task("task-1")).ok


async def test_stale_epoch_is_fenced_and_writes_nothing(store: Store) -> None:
    """An append from an older epoch raises LeaseLost and leaves the log as it was."""
    head = await claimed_task(store)
    before = await log_snapshot(store.database)
    with pytest.raises(LeaseLost) as caught:
        await store.append_events("task-1", [message()], **head_args(head, 0))
    assert caught.value.current_epoch == 1
    assert await log_snapshot(store.database) == before


async def test_gap_or_duplicate_seq_is_a_conflict(store: Store) -> None:
    """An append whose first seq is not head+1 raises ConcurrencyConflict and writes nothing."""
    head = await claimed_task(store)
    before = await log_snapshot(store.database)
    for expected in (head.head_seq - 1, head.head_seq + 1):
        with pytest.raises(ConcurrencyConflict) as caught:
            await store.append_events("task-1", [message()], epoch=1, expected_seq=expected,
                                      prev_hash=head.head_hash)
        assert caught.value.actual_seq == head.head_seq
    assert await log_snapshot(store.database) == before


async def test_wrong_prev_hash_is_a_conflict(store: Store) -> None:
    """A caller whose view of the head hash is wrong cannot fork the chain."""
    head = await claimed_task(store)
    with pytest.raises(ConcurrencyConflict):
        await store.append_events("task-1", [message()], epoch=1, expected_seq=head.head_seq,
                                  prev_hash=GENESIS_HASH)


async def test_append_to_unknown_task(store: Store) -> None:
    """An append to a task that does not exist raises UnknownTask."""
    with pytest.raises(UnknownTask):
        await store.append_events("nope", [message()], epoch=0, expected_seq=0,
                                  prev_hash=GENESIS_HASH)


async def test_eight_racing_writers_one_winner_per_seq(pg_server: Any, database_dsn: str) -> None:
    """Eight writers on separate connections racing on one task keep seqs contiguous."""
    databases = [await Database.open(database_dsn, migrate=False, max_size=1) for _ in range(8)]
    stores = [Store(db) for db in databases]
    head = await claimed_task(stores[0])
    outcomes: list[str] = []

    async def writer(index: int) -> None:
        current = await stores[index].read_head("task-1")
        for _ in range(20):
            try:
                current_result = await stores[index].append_events(
                    "task-1", [message(f"w{index}")], **head_args(current, 1))
                outcomes.append("ok")
                current = await stores[index].read_head("task-1")
                assert current.head_seq == current_result.head_seq or current.head_seq > 0
            except ConcurrencyConflict:
                outcomes.append("conflict")
                current = await stores[index].read_head("task-1")

    try:
        await asyncio.gather(*(writer(i) for i in range(8)))
        seqs = [r.seq for r in await stores[0].history("task-1")]
        assert seqs == list(range(1, head.head_seq + outcomes.count("ok") + 1))
        assert outcomes.count("ok") + outcomes.count("conflict") == 160
        assert (await stores[0].verify_task("task-1")).ok
    finally:
        for db in databases:
            await db.close()


async def test_same_seq_race_exactly_one_wins(store: Store) -> None:
    """Two appends prepared on the same head: exactly one wins, the other conflicts."""
    head = await claimed_task(store)
    results = await asyncio.gather(
        *(store.append_events("task-1", [message(str(i))], **head_args(head, 1))
          for i in range(2)),
        return_exceptions=True,
    )
    assert sum(isinstance(r, ConcurrencyConflict) for r in results) == 1
    assert (await store.read_head("task-1")).head_seq == head.head_seq + 1


async def test_illegal_transition_rejected_in_python_and_sql(store: Store) -> None:
    """QUEUED -> COMPLETED fails before sending, and in SQL when Python is bypassed."""
    await store.create_task("t-1", "agent")
    head = await store.read_head("t-1")
    before = await log_snapshot(store.database)
    with pytest.raises(IllegalTransition):
        await store.append_events("t-1", [ev.TaskCompleted()], **head_args(head, 0),
                                  status=Status.QUEUED)
    with pytest.raises(IllegalTransition) as caught:
        await store.append_events("t-1", [ev.TaskCompleted()], **head_args(head, 0))
    assert (caught.value.from_status, caught.value.to_status) == ("QUEUED", "COMPLETED")
    with pytest.raises(IllegalTransition):
        await store.database.fetch("UPDATE wal_tasks SET status = 'WAITING' WHERE task_id='t-1'")
    assert await log_snapshot(store.database) == before


async def test_nothing_follows_a_terminal_status(store: Store) -> None:
    """After COMPLETED, the database refuses any further append."""
    head = await claimed_task(store)
    done = await store.append_events("task-1", [ev.TaskCompleted(output=1)], **head_args(head, 1))
    with pytest.raises(IllegalTransition):
        await store.append_events("task-1", [message()], **head_args(done, 1))


@pytest.mark.parametrize("wait", [
    ev.SignalAwaited(name="approve"),
    ev.TimerStarted(timer_id="t", wake_at_ms=0, duration_ms=60_000),
    ev.TaskReleased(reason="shutdown"),
], ids=lambda e: type(e).__name__)
async def test_no_observation_after_the_lease_is_dropped(store: Store, wait: ev.Event) -> None:
    """A run that began to wait (or handed the task back) no longer owns it: an observation
    from the same epoch, alone, batched or group-committed, is LeaseLost and writes nothing;
    a status move from that epoch (the run's own wake-up) is still accepted."""
    head = await claimed_task(store)
    waiting = await store.append_events("task-1", [wait], **head_args(head, 1))
    before = await log_snapshot(store.database)
    for events in ([message()], [message("a"), message("b")]):
        with pytest.raises(LeaseLost):
            await store.append_events("task-1", events, **head_args(waiting, 1))
    results = await store.append_many([PendingAppend(
        task_id="task-1", epoch=1, expected_seq=waiting.head_seq, prev_hash=waiting.head_hash,
        events=[message()])])
    assert isinstance(results["task-1"], LeaseLost)
    assert await log_snapshot(store.database) == before
    if isinstance(wait, ev.SignalAwaited):
        woken = await store.append_events("task-1", [ev.TaskWoken(reason="signal")],
                                          **head_args(waiting, 1))
        assert woken.head_seq == waiting.head_seq + 1
    assert (await store.verify_task("task-1")).ok


async def test_events_table_is_append_only(store: Store) -> None:
    """UPDATE, DELETE and TRUNCATE on wal_events are refused by triggers."""
    await store.create_task("t-1", "agent")
    before = await log_snapshot(store.database)
    for statement in ("UPDATE wal_events SET epoch = 5", "DELETE FROM wal_events",
                      "TRUNCATE wal_events"):
        with pytest.raises(AppendOnlyViolation):
            await store.database.fetch(statement)
    assert await log_snapshot(store.database) == before


BAD_PAYLOADS: list[tuple[str, Any, type[Exception]]] = [
    ("nan", math.nan, InvalidPayload),
    ("infinity", {"x": math.inf}, InvalidPayload),
    ("lone surrogate", "\udc80", InvalidPayload),
    ("nul", "a\x00b", InvalidPayload),
    ("not json", {"when": object()}, InvalidPayload),
    ("set", {1, 2}, InvalidPayload),
    ("too large", "x" * (limits.payload_bytes_max + 1), PayloadTooLarge),
]


@pytest.mark.parametrize(("case", "value", "error"), BAD_PAYLOADS, ids=[c[0] for c in BAD_PAYLOADS])
async def test_bad_payload_is_refused_and_log_unchanged(
    store: Store, case: str, value: Any, error: type[Exception]
) -> None:
    """An unstorable payload raises its typed error on append and on submit; nothing lands."""
    head = await claimed_task(store)
    before = await log_snapshot(store.database)
    with pytest.raises(error):
        await store.append_events("task-1", [message(value)], **head_args(head, 1))
    with pytest.raises(error):
        await store.create_task("other", "agent", input=value)
    assert await log_snapshot(store.database) == before


@pytest.mark.parametrize(
    "task_id",
    ["", "x" * 129, "x'); drop table wal_events; --", "$1", "%s", "a b", "tab\t", "é", "a\nb",
     "\x1b[31mred"],
)
async def test_bad_task_ids_are_refused(store: Store, task_id: str) -> None:
    """Empty, too long, and injection-shaped ids raise InvalidTaskId; nothing lands."""
    before = await log_snapshot(store.database)
    with pytest.raises(InvalidTaskId):
        await store.create_task(task_id, "agent")
    assert await log_snapshot(store.database) == before


async def test_empty_batch_is_invalid(store: Store) -> None:
    """An append of no events is bad input."""
    head = await claimed_task(store)
    with pytest.raises(InvalidInput):
        await store.append_events("task-1", [], **head_args(head, 1))


async def test_sql_hash_equals_python_hash(store: Store) -> None:
    """The SQL chain function and chain.event_hash agree byte for byte."""
    payload = '{"a":"é","b":[1,2.5]}'.encode()
    sql_hash = await store.database.fetch(
        "SELECT wal_event_hash($1, 'task-1', 7, 'message_appended', 1, 3, $2) AS h",
        GENESIS_HASH, payload,
    )
    assert sql_hash[0]["h"] == event_hash(GENESIS_HASH, "task-1", 7, "message_appended", 1, 3,
                                          payload)


async def test_transition_tables_agree(database: Database) -> None:
    """The database's wal_transitions equals state_machine.TRANSITIONS."""
    rows = await database.fetch("SELECT from_status, to_status FROM wal_transitions")
    assert {(Status(r["from_status"]), Status(r["to_status"])) for r in rows} == TRANSITIONS


async def test_schema_is_idempotent_and_versioned(database_dsn: str) -> None:
    """Applying the schema twice is harmless; a missing schema is a SchemaMismatch."""
    connection = await asyncpg.connect(database_dsn)
    try:
        await apply_schema(connection)
        rows = await connection.fetch("SELECT version FROM wal_schema_version ORDER BY 1")
        await apply_schema(connection, force=True)
        assert await connection.fetch("SELECT version FROM wal_schema_version ORDER BY 1") \
            == rows
        assert max(row["version"] for row in rows) == SCHEMA_VERSION
        await connection.execute("DROP TABLE wal_schema_version")
    finally:
        await connection.close()
    with pytest.raises(SchemaMismatch, match="no wal-engine schema"):
        await Database.open(database_dsn, migrate=False)


async def test_history_streams_in_pages(store: Store) -> None:
    """A long history is read back whole and in order through bounded pages."""
    head = await claimed_task(store)
    result = await store.append_events("task-1", [message(str(i)) for i in range(250)],
                                       **head_args(head, 1))
    pages = [r.seq async for r in store.stream_events("task-1", page_events=64)]
    assert pages == list(range(1, result.head_seq + 1))
    tail = await store.read_events("task-1", from_seq=200)
    assert tail[0].seq == 200 and tail[-1].seq == result.head_seq


async def test_group_commit_fences_each_task_separately(store: Store) -> None:
    """One statement appends for many tasks; a stale one is rejected, the others land."""
    for n in range(3):
        await store.create_task(f"g-{n}", "agent")
    await claim(store.database)
    heads = [await store.read_head(f"g-{n}") for n in range(3)]
    appends = [
        PendingAppend(task_id=h.task_id, epoch=h.lease_epoch if i != 1 else 0,
                      expected_seq=h.head_seq, prev_hash=h.head_hash,
                      events=[message("a"), ev.StepCheckpointed(step=1)])
        for i, h in enumerate(heads)
    ]
    results = await store.append_many(appends)
    assert isinstance(results["g-1"], LeaseLost)
    for task_id in ("g-0", "g-2"):
        head = await store.read_head(task_id)
        assert head.head_seq == 4 and head.status is Status.CHECKPOINTED
        assert (await store.verify_task(task_id)).ok
    assert (await store.read_head("g-1")).head_seq == 2


async def test_a_wake_up_that_lost_its_race_refuses_only_its_own_task(store: Store) -> None:
    """A run that saw a signal after its wait committed appends its own wake-up, while the
    signal's sender wakes the task too (seen in the rolling-deploy test). The sender's
    task_woken takes the seq first; the run's append is then a lost race
    (ConcurrencyConflict), alone or group-committed, and never an IllegalTransition that
    would void the other tasks' appends sharing its statement."""
    for n in range(3):
        await store.create_task(f"g-{n}", "agent")
    await claim(store.database)
    heads = {n: await store.read_head(f"g-{n}") for n in range(3)}
    waiting = await store.append_events("g-1", [ev.SignalAwaited(name="go")],
                                        **head_args(heads[1], 1))
    await store.database.fetch(queries.SEND_SIGNAL, "g-1", "go", b'{"by":"sender"}', None)
    assert (await store.read_head("g-1")).status is Status.RESUMING
    woken = [ev.TaskWoken(reason="signal")]
    before = await log_snapshot(store.database)
    with pytest.raises(ConcurrencyConflict):
        await store.append_events("g-1", woken, **head_args(waiting, 1))
    assert await log_snapshot(store.database) == before
    appends = [PendingAppend(task_id=f"g-{n}", epoch=1, expected_seq=head.head_seq,
                             prev_hash=head.head_hash, events=[message(f"m{n}")])
               for n, head in heads.items() if n != 1]
    appends.insert(1, PendingAppend(task_id="g-1", epoch=1, expected_seq=waiting.head_seq,
                                    prev_hash=waiting.head_hash, events=woken))
    results = await store.append_many(appends)
    assert isinstance(results["g-1"], ConcurrencyConflict), results
    for task_id in ("g-0", "g-2"):
        assert not isinstance(results[task_id], Exception), results
        assert (await store.read_head(task_id)).head_seq == heads[0].head_seq + 1
        assert (await store.verify_task(task_id)).ok
    assert (await store.verify_task("g-1")).ok


async def test_claim_records_the_claim_and_bumps_epoch(store: Store) -> None:
    """A claim moves QUEUED to RUNNING, bumps the epoch and logs task_claimed."""
    await store.create_task("t-1", "agent")
    rows = await claim(store.database, "worker-a")
    assert [(r["task_id"], r["lease_epoch"]) for r in rows] == [("t-1", 1)]
    history = await store.history("t-1")
    assert history[-1].decode() == ev.TaskClaimed(worker_id="worker-a", attempt=1)
    assert history[-1].epoch == 1
    assert await claim(store.database, "worker-b") == []


async def test_a_listing_runs_its_page_on_the_generic_plan_and_leaves_nothing_behind(
        database_dsn: str) -> None:
    """list_tasks runs in a read-only transaction of its own with generic plans (at a
    million tasks, re-planning each page cost more than the page); the setting ends with
    the transaction, on the one connection of the pool, also when the page fails."""
    database = await Database.open(database_dsn, migrate=False, min_size=1, max_size=1)
    try:
        store = Store(database)
        for number in range(3):
            await store.create_task(f"list-{number}", "agent")
        assert [head.task_id for head in await store.list_tasks(status="QUEUED")] == [
            "list-0", "list-1", "list-2"]
        async with database.acquire() as connection:
            assert await connection.fetchval("SHOW plan_cache_mode") == "auto"
            assert not connection.is_in_transaction()
        with pytest.raises(InvalidInput):
            await store.list_tasks(agent="bad\x00agent")
        async with database.acquire() as connection:
            assert await connection.fetchval("SHOW plan_cache_mode") == "auto"
            assert not connection.is_in_transaction()
        assert len(await store.list_tasks(after_task_id="list-0")) == 2
    finally:
        await database.close()
