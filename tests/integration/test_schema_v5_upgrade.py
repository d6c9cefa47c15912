"""Schema version 5 (decision 71): a database of version 4 holding events is upgraded in place
(its prev_hash column dropped, its rows kept as they are), still verifies, and takes new
appends, stored the version-5 way; derived keys read the same in Python and in SQL."""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest_asyncio

from wal_engine import blobs
from wal_engine import events as ev
from wal_engine.chain import GENESIS_HASH, event_hash_v2
from wal_engine.engine import Engine, connect
from wal_engine.ids import idempotency_key
from wal_engine.store import queries
from wal_engine.store.connection import SCHEMA_VERSION, apply_schema

SCHEMA_V4 = Path(__file__).parent / "data" / "schema_v4.sql"
TASK = "v4-task"
_numbers = itertools.count(1)

# Version 4's own statements: a submission and an observation with their prev_hash.
V4_SUBMIT = """
WITH task AS (
    INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash)
    VALUES ($1, 'agent', 'QUEUED', 1, $4) RETURNING task_id
)
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, prev_hash, hash,
                        recorded_at, chain_version)
SELECT task_id, 1, 'task_submitted', 1, 0, $2, $3, $4, $5, 2 FROM task
"""
V4_OBSERVE = """
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                        prev_hash, hash, recorded_at, chain_version)
VALUES ($1, $2, $3, 1, $4, $5, $6, $7, $8, $9, 2)
"""


@pytest_asyncio.fixture
async def v4_dsn(pg_server: Any) -> AsyncIterator[str]:
    """A new database holding schema version 4 only (no engine has connected)."""
    name = f"walt_v4_{next(_numbers)}"
    admin = await asyncpg.connect(pg_server.admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = pg_server.dsn(name)
    connection = await asyncpg.connect(dsn, server_settings={"wal.tenant": "default"})
    try:
        await connection.execute(SCHEMA_V4.read_text())
        await connection.execute("UPDATE wal_schema_version SET checksum = 'v4'")
    finally:
        await connection.close()
    yield dsn
    admin = await asyncpg.connect(pg_server.admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def _write_v4_history(connection: asyncpg.Connection) -> bytes:
    """A task as version 4 wrote it: submitted, claimed (by the database), a tool call's
    intent (its key in the column) and result. Returns the head hash."""
    stamp = await connection.fetchval("SELECT now() - interval '1 minute'")
    kind, version, payload = ev.encode_event(ev.TaskSubmitted(agent="agent"))
    digest = event_hash_v2(GENESIS_HASH, TASK, 1, kind, version, 0, stamp, None, payload)
    await connection.execute(V4_SUBMIT, TASK, payload, GENESIS_HASH, digest, stamp)
    claimed = await connection.fetch(queries.CLAIM_TASKS, "worker-4", 10, 60_000, None, None)
    assert [r["task_id"] for r in claimed] == [TASK]
    previous, stamp = await connection.fetchrow(
        "SELECT hash, recorded_at FROM wal_events WHERE task_id = $1 AND seq = 2", TASK)
    key = idempotency_key(TASK, 3)
    for seq, event in ((3, ev.ToolCallIntended(call_id="c1", tool="t", args={"q": "x" * 400},
                                               args_hash="h", idempotency_key=key)),
                       (4, ev.ToolCallCompleted(call_id="c1", result={"r": "y" * 600}))):
        kind, version, payload = ev.encode_event(event)
        event_key = getattr(event, "idempotency_key", None)
        stamp += dt.timedelta(seconds=1)
        digest = event_hash_v2(previous, TASK, seq, kind, version, 1, stamp, event_key,
                               payload)
        await connection.execute(V4_OBSERVE, TASK, seq, kind, 1, payload, event_key, previous,
                                 digest, stamp)
        previous = digest
    return bytes(previous)


async def test_a_v4_database_with_events_is_upgraded_verifies_and_takes_appends(
        v4_dsn: str) -> None:
    """apply_schema upgrades version 4 to 5 in place: prev_hash is gone, the version-4 rows
    are untouched and verify, and new appends are stored compressed, keys derived."""
    connection = await asyncpg.connect(v4_dsn, server_settings={"wal.tenant": "default"})
    try:
        head_hash = await _write_v4_history(connection)
        before = await connection.fetch(
            "SELECT seq, type, payload, idempotency_key, hash, chain_version FROM wal_events"
            " ORDER BY seq")
        assert await apply_schema(connection) is True
        assert await connection.fetchval("SELECT max(version) FROM wal_schema_version") == \
            SCHEMA_VERSION == 5
        columns = {r["attname"] for r in await connection.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'wal_events'::regclass"
            " AND attnum > 0 AND NOT attisdropped")}
        assert "prev_hash" not in columns and "idempotency_key" in columns
        assert await connection.fetch(
            "SELECT seq, type, payload, idempotency_key, hash, chain_version FROM wal_events"
            " ORDER BY seq") == before
        assert "ARRAY[1, 2, 3]" in await connection.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conname = 'wal_events_bounds'")
        assert await apply_schema(connection, force=True) is True  # Again: nothing changes.
    finally:
        await connection.close()
    engine = await connect(v4_dsn, migrate=False)
    try:
        await _check_upgraded(engine, head_hash)
    finally:
        await engine.close()


async def _check_upgraded(engine: Engine, head_hash: bytes) -> None:
    store = engine.store
    assert (await store.verify_task(TASK)).ok
    head = await store.read_head(TASK)
    assert (head.head_seq, head.head_hash) == (4, head_hash)
    key = idempotency_key(TASK, 5)
    intent = ev.ToolCallIntended(call_id="c2", tool="t", args={"q": "z " * 300}, args_hash="h",
                                 idempotency_key=key)
    await store.append_events(TASK, [intent], epoch=head.lease_epoch, expected_seq=4,
                              prev_hash=head_hash)
    head = await store.read_head(TASK)
    await store.append_events(TASK, [ev.TaskCompleted(output={"ok": True})],
                              epoch=head.lease_epoch, expected_seq=5, prev_hash=head.head_hash)
    assert (await store.verify_task(TASK)).ok
    history = await store.history(TASK)
    assert [(r.seq, r.chain_version, r.idempotency_key) for r in history] == [
        (1, 2, None), (2, 2, None), (3, 2, idempotency_key(TASK, 3)), (4, 2, None),
        (5, 3, key), (6, 3, None)]
    rows = await engine.database.fetch(
        "SELECT seq, idempotency_key, payload FROM wal_events WHERE task_id = $1 AND seq >= 5"
        " ORDER BY seq", TASK)
    assert [r["idempotency_key"] for r in rows] == ["", ""]
    assert bytes(rows[0]["payload"]).startswith(blobs.ROW_MARK)
    audited = await engine.database.fetch(
        "SELECT seq, idempotency_key, payload, payload_compressed FROM wal_events_json"
        " WHERE task_id = $1 ORDER BY seq", TASK)
    assert [(r["seq"], r["idempotency_key"]) for r in audited] == [
        (r.seq, r.idempotency_key) for r in history]
    assert [r["payload_compressed"] for r in audited] == [False] * 4 + [True, False]
    assert [r["payload"] is None for r in audited] == [False] * 4 + [True, False]
