"""Properties of the log on real PostgreSQL: invariants 1-5 hold, tampering is found."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import head_args
from tests.property.event_strategies import json_values
from wal_engine import events as ev
from wal_engine.errors import ConcurrencyConflict, LeaseLost
from wal_engine.state_machine import Status
from wal_engine.store import Store

_task_numbers = itertools.count()

operations = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.lists(json_values, min_size=1, max_size=4)),
        st.tuples(st.just("checkpoint"), st.none()),
        st.tuples(st.just("stale_epoch"), st.none()),
        st.tuples(st.just("wrong_seq"), st.integers(-2, 3).filter(lambda n: n != 0)),
        st.tuples(st.just("lease_broken"), st.none()),
    ),
    max_size=12,
)


async def _claim_one(store: Store, task_id: str) -> int:
    rows = await store.database.fetch("SELECT * FROM wal_claim_tasks('w', 50, 60000)")
    epochs = {row["task_id"]: row["lease_epoch"] for row in rows}
    return int(epochs[task_id])


async def _expire_and_orphan(store: Store, task_id: str) -> None:
    await store.database.fetch(
        "UPDATE wal_tasks SET lease_expires_at = now() - interval '1 second' WHERE task_id = $1",
        task_id,
    )
    await store.database.fetch("SELECT * FROM wal_break_leases(50)")


async def _apply(store: Store, task_id: str, epoch: int, op: tuple[str, Any]) -> int:
    """Run one operation; return the epoch the writer holds afterwards."""
    kind, arg = op
    head = await store.read_head(task_id)
    if kind == "observe":
        batch = [ev.MessageAppended(role="tool", content=value) for value in arg]
        await store.append_events(task_id, batch, **head_args(head, epoch))
    elif kind == "checkpoint":
        await store.append_events(
            task_id, [ev.StepCheckpointed(step=head.head_seq), ev.StepStarted(step=head.head_seq)],
            **head_args(head, epoch), status=head.status)
    elif kind == "stale_epoch":
        try:
            await store.append_events(task_id, [ev.MessageAppended(role="x")],
                                      **head_args(head, epoch - 1))
            raise AssertionError("a stale epoch was accepted")
        except LeaseLost:
            pass
    elif kind == "wrong_seq":
        try:
            await store.append_events(task_id, [ev.MessageAppended(role="x")], epoch=epoch,
                                      expected_seq=head.head_seq + arg, prev_hash=head.head_hash)
            raise AssertionError("an append off the head was accepted")
        except ConcurrencyConflict:
            pass
    elif kind == "lease_broken":
        await _expire_and_orphan(store, task_id)
        return await _claim_one(store, task_id)
    return epoch


async def _check_invariants(store: Store, task_id: str) -> None:
    rows = await store.database.fetch(
        "SELECT seq, epoch FROM wal_events WHERE task_id = $1 ORDER BY seq", task_id
    )
    head = await store.read_head(task_id)
    assert [r["seq"] for r in rows] == list(range(1, head.head_seq + 1))  # invariant 1
    epochs = [r["epoch"] for r in rows]
    assert epochs == sorted(epochs)  # I3: epochs never decrease along seq
    report = await store.verify_task(task_id)  # invariants 4 and 5 (legal moves)
    assert report.ok, report.violation
    assert head.status in (Status.RUNNING, Status.CHECKPOINTED)


@settings(max_examples=25)
@given(ops=operations)
async def test_random_appends_keep_the_invariants(store: Store, ops: list[tuple[str, Any]]) -> None:
    """Any sequence of valid and invalid appends keeps seqs, epochs, chain and moves valid."""
    task_id = f"prop-{next(_task_numbers)}"
    await store.create_task(task_id, "agent")
    epoch = await _claim_one(store, task_id)
    for op in ops:
        epoch = await _apply(store, task_id, epoch, op)
    await _check_invariants(store, task_id)


@settings(max_examples=25)
@given(
    n_events=st.integers(1, 8),
    data=st.data(),
)
async def test_any_tampered_byte_is_found_at_its_seq(
    store: Store, n_events: int, data: st.DataObject
) -> None:
    """Flipping one byte of a stored payload or hash is reported at that seq (a row holds no
    previous hash since schema version 5: the previous row's hash is the link)."""
    task_id = f"tamper-{next(_task_numbers)}"
    await store.create_task(task_id, "agent")
    epoch = await _claim_one(store, task_id)
    head = await store.read_head(task_id)
    batch = [ev.MessageAppended(role="user", content=f"m{i}") for i in range(n_events)]
    await store.append_events(task_id, batch, **head_args(head, epoch))
    last = head.head_seq + n_events
    seq = data.draw(st.integers(1, last), label="seq")
    column = data.draw(st.sampled_from(["payload", "hash"]), label="column")
    row = await store.database.fetch(
        f"SELECT {column} AS value FROM wal_events WHERE task_id = $1 AND seq = $2", task_id, seq
    )
    original: bytes = row[0]["value"]
    offset = data.draw(st.integers(0, len(original) - 1), label="offset")
    tampered = bytearray(original)
    tampered[offset] ^= data.draw(st.integers(1, 255), label="xor")
    await _superuser_update(store, task_id, seq, column, bytes(tampered))
    report = await store.verify_task(task_id)
    assert not report.ok
    assert report.violation is not None and report.violation.seq == seq


async def _superuser_update(
    store: Store, task_id: str, seq: int, column: str, value: bytes
) -> None:
    """Rewrite one stored value with the append-only trigger disabled, as a superuser can."""
    async with store.database.pool.acquire() as connection, connection.transaction():
        await connection.execute("ALTER TABLE wal_events DISABLE TRIGGER wal_events_append_only")
        await connection.execute(
            f"UPDATE wal_events SET {column} = $3 WHERE task_id = $1 AND seq = $2",
            task_id, seq, value,
        )
        await connection.execute("ALTER TABLE wal_events ENABLE TRIGGER wal_events_append_only")
