"""RELIABILITY.md S13: the runtime role as the attacker, forging history.

Every forgery is written the way the issue's probe wrote it: as the application role of
security.sql (a non-superuser), through plain SQL, with correctly computed hashes (chain
version 2, which covers recorded_at and the idempotency key). Each must be refused at
append or named by ``verify`` (the store's and ``verify --anchor``'s), with its seq.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import asyncpg
import pytest

from tests.helpers import claim, log_snapshot
from wal_engine import events as ev
from wal_engine.audit.anchor import create_anchor, verify_anchor
from wal_engine.chain import event_hash_v2
from wal_engine.engine import Engine
from wal_engine.store import Database, Store

FORGE: str = """
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                        hash, recorded_at, chain_version)
VALUES ($1, $2, $3, 1, $4, $5, $6, $7, $8, 2)
"""

LAST: str = """
SELECT seq, hash, epoch FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
 ORDER BY seq DESC LIMIT 1
"""


async def forge(database: Database, task_id: str, event_type: str, payload: bytes, *,
                epoch: int | None = None, seq: int | None = None, key: str | None = None,
                recorded_at: dt.datetime | None = None) -> int:
    """Append one correctly hashed event after the log's last one, as the attacker: plain
    SQL on one of the app role's own connections (raw driver errors, as an attacker sees)."""
    async with database.pool.acquire() as connection:
        return await _forge(connection, task_id, event_type, payload, epoch=epoch, seq=seq,
                            key=key, recorded_at=recorded_at)


async def _forge(connection: asyncpg.Connection, task_id: str, event_type: str,
                 payload: bytes, *, epoch: int | None, seq: int | None, key: str | None,
                 recorded_at: dt.datetime | None) -> int:
    last = await connection.fetchrow(LAST, task_id)
    previous = bytes(32) if last is None else bytes(last["hash"])
    seq = (0 if last is None else int(last["seq"])) + 1 if seq is None else seq
    epoch = (0 if last is None else int(last["epoch"])) if epoch is None else epoch
    stamp = recorded_at or dt.datetime.now(dt.UTC)
    digest = event_hash_v2(previous, task_id, seq, event_type, 1, epoch, stamp, key, payload)
    await connection.execute(FORGE, task_id, seq, event_type, epoch, payload, key, digest,
                             stamp)
    return seq


async def running_task(engine: Engine, task_id: str) -> int:
    """A submitted and claimed task (RUNNING, epoch 1) with one message; its head seq."""
    store = engine.store
    await store.create_task(task_id, "agent", input={"iban": "PT50 0002 0123 1234 5678 9015 4"})
    await claim(store.database)
    head = await store.read_head(task_id)
    result = await store.append_events(
        task_id, [ev.MessageAppended(role="user", content="pay the invoice")],
        epoch=head.lease_epoch, expected_seq=head.head_seq, prev_hash=head.head_hash)
    return result.head_seq


async def _violation(store: Store, task_id: str) -> tuple[int, str]:
    report = await store.verify_task(task_id)
    assert report.violation is not None, report
    return report.violation.seq, report.violation.kind


async def test_s13_forged_resume_approval_and_completion_are_named(app_engine: Engine) -> None:
    """The probe's forgery (task_resumed by "attacker", an approving signal_received, a
    task_completed naming the attacker's IBAN, the task row walked to COMPLETED) passes the
    chain but not verify, nor verify --anchor with an anchor taken before it."""
    store, database = app_engine.store, app_engine.database
    head_seq = await running_task(app_engine, "victim")
    anchor = await create_anchor(database)
    first = await forge(database, "victim", "task_resumed",
                        b'{"attempt":2,"worker_id":"attacker"}', epoch=2)
    await forge(database, "victim", "signal_received",
                b'{"name":"approved","payload":{"approved":true},"signal_id":1}')
    last = await forge(database, "victim", "task_completed",
                       b'{"output":{"iban":"ATTACKER"}}')
    await database.fetch(
        "UPDATE wal_tasks SET status = 'COMPLETED', status_path = ARRAY['COMPLETED'],"
        " head_seq = $2, head_hash = (SELECT hash FROM wal_events WHERE task_id = $1"
        " AND seq = $2) WHERE task_id = $1", "victim", last)
    assert first == head_seq + 1
    # A resume of a task that is RUNNING (and at an epoch the task row, which the app role
    # cannot raise, never granted).
    assert await _violation(store, "victim") == (first, "transition")
    checked = await verify_anchor(database, anchor)
    assert [(f.task_id, f.seq, f.kind) for f in checked.findings] == [
        ("victim", first, "chain")]


async def test_s13_same_epoch_forgeries_break_the_replay_rules(app_engine: Engine) -> None:
    """Forged at the lease's own epoch, a result for a call that was never intended is
    impossible where it stands: verify names it (the replayer's rules)."""
    store, database = app_engine.store, app_engine.database
    head_seq = await running_task(app_engine, "t1")
    seq = await forge(database, "t1", "tool_call_completed",
                      b'{"call_id":"pay-1","result":{"paid":true}}')
    assert seq == head_seq + 1
    assert await _violation(store, "t1") == (seq, "semantics")


async def test_s13_a_new_epoch_without_a_claim_is_named(app_engine: Engine) -> None:
    """A forged claim-like move to a new epoch (orphaning, then a resume at epoch 2) passes
    the chain's epoch rule but not the task row's lease epoch."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "t2")
    seq = await forge(database, "t2", "task_orphaned",
                      b'{"previous_epoch":1,"previous_owner":"w1"}', epoch=2)
    assert await _violation(store, "t2") == (seq, "epoch")


async def test_s13_event_after_a_terminal_event(app_engine: Engine) -> None:
    """An observation after task_completed is refused by the append path and, written around
    it, named by verify."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "done")
    head = await store.read_head("done")
    ended = await store.append_events("done", [ev.TaskCompleted(output="ok")],
                                      epoch=head.lease_epoch, expected_seq=head.head_seq,
                                      prev_hash=head.head_hash)
    assert (await store.verify_task("done")).ok
    seq = await forge(database, "done", "message_appended",
                      b'{"content":"later","role":"user"}')
    assert seq == ended.head_seq + 1
    assert await _violation(store, "done") == (seq, "after_terminal")


async def test_s13_undecodable_payload_is_named_and_audits_still_read(
        app_engine: Engine) -> None:
    """A non-UTF-8 payload with a correct hash is named by verify, and wal_events_json still
    answers for the whole tenant (the bad row's payload reads as NULL)."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "bytes")
    seq = await forge(database, "bytes", "message_appended", b'{"content":"\xff\xfe"}')
    assert await _violation(store, "bytes") == (seq, "semantics")
    rows = await database.fetch("SELECT task_id, seq, payload IS NULL AS unreadable"
                                " FROM wal_events_json ORDER BY task_id, seq LIMIT 100")
    assert [(r["seq"], r["unreadable"]) for r in rows][-1] == (seq, True)
    assert sum(r["unreadable"] for r in rows) == 1


@pytest.mark.parametrize(("seq", "epoch"), [(0, 1), (-5, 1), (None, 2**62), (None, -1)])
async def test_s13_absurd_seqs_and_epochs_are_refused_at_append(
        app_engine: Engine, seq: int | None, epoch: int) -> None:
    """Rows at seq 0 or -5, or at epoch 2^62 or -1, are refused by the log's CHECK (the
    database, whoever writes) and the log is unchanged."""
    database = app_engine.database
    await running_task(app_engine, "bounds")
    before = await log_snapshot(database)
    with pytest.raises(asyncpg.CheckViolationError) as refused:
        await forge(database, "bounds", "message_appended", b'{"content":"x","role":"user"}',
                    seq=seq, epoch=epoch)
    assert refused.value.constraint_name == "wal_events_bounds"
    assert await log_snapshot(database) == before


async def test_s13_epoch_beyond_the_lease_is_named(app_engine: Engine) -> None:
    """An observation at a plausible epoch the task was never given is named by verify."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "epoch")
    seq = await forge(database, "epoch", "message_appended", b'{"content":"x","role":"user"}',
                      epoch=1000)
    assert await _violation(store, "epoch") == (seq, "epoch")


async def test_s13_events_of_a_missing_task_are_named(app_engine: Engine) -> None:
    """Events of a task that has no row are found by verify --all's orphan scan."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "real")
    await forge(database, "ghost", "task_submitted", b'{"agent":"agent","input":null}')
    await forge(database, "ghost", "message_appended", b'{"content":"x","role":"user"}')
    orphans = await store.verify_orphans()
    assert [(r.task_id, r.events, r.violation and r.violation.kind) for r in orphans] == [
        ("ghost", 2, "orphan")]
    assert (await store.verify_task("real")).ok


async def test_s13_backdated_recorded_at_is_named(app_engine: Engine) -> None:
    """An event stamped 400 days before its predecessor (hash recomputed to match) is named."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "late")
    stamp = dt.datetime.now(dt.UTC) - dt.timedelta(days=400)
    seq = await forge(database, "late", "message_appended", b'{"content":"x","role":"user"}',
                      recorded_at=stamp)
    assert await _violation(store, "late") == (seq, "time")


@pytest.mark.parametrize(("column", "value"), [
    ("recorded_at", dt.datetime(2020, 1, 1, tzinfo=dt.UTC)), ("idempotency_key", "idem:x:1")])
async def test_s13_rewritten_time_or_key_breaks_the_chain(
        app_engine: Engine, database_dsn: str, column: str, value: Any) -> None:
    """A superuser who rewrites an event's recorded_at or idempotency key (the triggers
    disabled) breaks its hash: chain version 3 covers both."""
    store = app_engine.store
    head_seq = await running_task(app_engine, "rewritten")
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.execute("ALTER TABLE wal_events DISABLE TRIGGER USER")
        await admin.execute(f"UPDATE wal_events SET {column} = $2 WHERE task_id = $1"
                            f" AND seq = $3", "rewritten", value, head_seq)
        await admin.execute("ALTER TABLE wal_events ENABLE TRIGGER USER")
    finally:
        await admin.close()
    assert await _violation(store, "rewritten") == (head_seq, "hash")


async def test_s13_every_engine_written_event_covers_time_and_key(app_engine: Engine) -> None:
    """Submissions, observations and status moves are of chain version 3 (decision 71),
    claims (written by the database) of version 2: both cover the time and the key; verify
    accepts the honest history."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "honest")
    head = await store.read_head("honest")
    await store.append_events("honest", [ev.StepCheckpointed(step=1), ev.StepStarted(step=2)],
                              epoch=head.lease_epoch, expected_seq=head.head_seq,
                              prev_hash=head.head_hash)
    versions = await database.fetch("SELECT type, chain_version FROM wal_events"
                                    " WHERE task_id = $1", "honest")
    assert {(r["type"] == "task_claimed", r["chain_version"]) for r in versions} == {
        (True, 2), (False, 3)}
    assert (await store.verify_task("honest")).ok


async def test_sql_v2_hash_equals_python_v2_hash(app_engine: Engine) -> None:
    """wal_event_hash_v2 (database-written events) and chain.event_hash_v2 agree byte for
    byte, with and without an idempotency key, on non-ASCII text."""
    payload = '{"a":"é","b":[1,2.5]}'.encode()
    stamp = dt.datetime(2026, 12, 1, 12, 0, 0, 654321, tzinfo=dt.UTC)
    for key in (None, "idem:tâsk:7"):
        row = await app_engine.database.fetchrow(
            "SELECT wal_event_hash_v2($1, 'tâsk-1', 7, 'message_appended', 1, 3, $2, $3, $4)"
            " AS h", bytes(32), stamp, key, payload)
        assert row["h"] == event_hash_v2(bytes(32), "tâsk-1", 7, "message_appended", 1, 3,
                                         stamp, key, payload)


@pytest.mark.parametrize(("event_type", "payload"), [
    ("signal_received", b'{"name":"approved","payload":{"approved":true},"signal_id":1}'),
    ("message_appended", b'{"content":"approved by ops","role":"user"}'),
])
async def test_s13_forgeries_while_no_one_holds_the_task_are_named(
        app_engine: Engine, event_type: str, payload: bytes) -> None:
    """Beyond the lease: the task handed its lease back to wait for an approval (WAITING,
    no worker holds it); the forger appends, at the wait's own epoch, an approving signal
    that was never sent, or a message. No writer could append there without claiming the
    task first: verify names the forged seq."""
    store, database = app_engine.store, app_engine.database
    await running_task(app_engine, "waits")
    head = await store.read_head("waits")
    await store.append_events("waits", [ev.SignalAwaited(name="approved")],
                              epoch=head.lease_epoch, expected_seq=head.head_seq,
                              prev_hash=head.head_hash)
    assert (await store.read_head("waits")).status.value == "WAITING"
    assert (await store.verify_task("waits")).ok
    seq = await forge(database, "waits", event_type, payload)
    assert await _violation(store, "waits") == (seq, "semantics")
