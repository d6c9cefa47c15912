"""Multi-tenancy on real PostgreSQL (RELIABILITY.md S4, S5; issues 9 and 16), as tenants'
own login roles (wal_engine.security.tenants), never as a superuser: a tenant sees and changes only
its own rows through every API and SQL function, a role mapped to no tenant sees nothing,
tenant ids are validated, the per-tenant caps hold, and a database of schema version 1 is
migrated. (tests/integration/test_security_isolation.py attacks with arbitrary SQL.)

Superuser connections (plain ``asyncpg.connect(database_dsn)``, no tenant) are used only to
take snapshots of every row of every tenant (superusers bypass row security).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import plan_nodes, sql_literal
from tests.integration.tenant_roles import TenantRoles
from tests.integration.tenant_roles import sqlstate as _sqlstate
from wal_engine import events as ev
from wal_engine.audit.anchor import AnchorInvalid, create_anchor, verify_anchor
from wal_engine.chain import event_hash
from wal_engine.effects.gateway import Claim
from wal_engine.engine import Engine, connect, wake_token
from wal_engine.errors import (
    ConfigurationError,
    InvalidInput,
    InvalidTenant,
    PayloadTooLarge,
    TaskQuotaExceeded,
    TenantRoleRefused,
    UnknownTask,
)
from wal_engine.ids import validate_tenant
from wal_engine.runtime.resume import resume, save_snapshot
from wal_engine.store import PendingAppend, queries
from wal_engine.store.connection import SCHEMA_VERSION, apply_schema

INSUFFICIENT_PRIVILEGE = "42501"
TENANT_A = "tenant-a"
TENANT_B = "tenant-b"
TENANT_TABLES = ("wal_tasks", "wal_events", "wal_snapshots", "wal_snapshot_segments",
                 "wal_idempotency", "wal_signals", "wal_tenants")
SCHEMA_V1 = Path(__file__).parent / "data" / "schema_v1.sql"

# Every row of every tenant table, in a fixed order (read as a superuser).
ALL_ROWS = {
    "wal_tasks": "SELECT tenant, task_id, agent, status, head_seq, head_hash, lease_owner,"
                 " lease_epoch, lease_expires_at, wake_at, waiting_signal, attempts"
                 " FROM wal_tasks ORDER BY tenant, task_id",
    "wal_events": "SELECT tenant, task_id, seq, type, epoch, payload, hash FROM wal_events"
                  " ORDER BY tenant, task_id, seq",
    "wal_snapshots": "SELECT tenant, task_id, seq, state FROM wal_snapshots"
                     " ORDER BY tenant, task_id, seq",
    "wal_idempotency": "SELECT tenant, key, state, owner, epoch, result FROM wal_idempotency"
                       " ORDER BY tenant, key",
    "wal_signals": "SELECT tenant, signal_id, task_id, name, payload, dedup_key"
                   " FROM wal_signals ORDER BY tenant, signal_id",
    "wal_tenants": "SELECT tenant, tasks, tasks_max FROM wal_tenants ORDER BY tenant",
}


async def _rows_of(database_dsn: str, tenant: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row ``tenant`` has in every table, read as a superuser (no row security)."""
    connection = await asyncpg.connect(database_dsn)
    try:
        return {table: [tuple(r) for r in await connection.fetch(sql) if r["tenant"] == tenant]
                for table, sql in ALL_ROWS.items()}
    finally:
        await connection.close()


async def _engine(roles: TenantRoles, tenant: str, **options: Any) -> Engine:
    """An engine logged in as ``tenant``'s own role (which names its tenant)."""
    engine = await connect(await roles.dsn(tenant), migrate=False, pool_size_max=4,
                           development=False, tenant=tenant, **options)

    @engine.agent("echo")
    async def echo(ctx: Any, task_input: Any) -> Any:
        return task_input

    return engine


@pytest_asyncio.fixture
async def engines(tenant_roles: TenantRoles) -> AsyncIterator[tuple[Engine, Engine]]:
    """Two engines, each as its tenant's role: tenant A and tenant B."""
    a = await _engine(tenant_roles, TENANT_A)
    b = await _engine(tenant_roles, TENANT_B)
    yield a, b
    await a.close()
    await b.close()


async def _populate_a(a: Engine) -> dict[str, Any]:
    """Tenant A's data in every table: tasks (one claimed, with events, a signal, an
    idempotency key and a snapshot)."""
    await a.submit("echo", {"n": 1}, task_id="a-task")
    await a.submit("echo", {"n": 2}, task_id="shared")
    claimed = await a.database.fetch(queries.CLAIM_TASKS, "worker-a", 10, 60_000, None, None)
    assert {r["task_id"] for r in claimed} == {"a-task", "shared"}
    head = await a.head("a-task")
    appended = await a.store.append_events(
        "a-task", [ev.MessageAppended(role="user", content="secret of A")],
        epoch=head.lease_epoch, expected_seq=head.head_seq, prev_hash=head.head_hash)
    await a.signal("a-task", "ping", {"from": "A"}, dedup_key="d1")
    effect_runs: list[str] = []

    async def effect() -> dict[str, str]:
        effect_runs.append("A")
        return {"done": "by A"}

    await a.gateway.run_once(Claim(key="k1", owner="worker-a", epoch=head.lease_epoch,
                                   task_id="a-task"), effect)
    assert await save_snapshot(a.database, await resume(a.store, "a-task"))
    return {"head": await a.head("a-task"), "appended": appended}


async def _app_connection(roles: TenantRoles, tenant: str | None) -> asyncpg.Connection:
    """A raw session as ``tenant``'s role naming its tenant, or (None) as a role with the
    runtime's privileges that is mapped to no tenant and names none."""
    if tenant is None:
        return await asyncpg.connect(await roles.stray_dsn())
    return await asyncpg.connect(await roles.dsn(tenant),
                                 server_settings={"wal.tenant": tenant})


async def test_s4_cross_tenant_reads_and_writes_see_and_change_nothing(
        engines: tuple[Engine, Engine], tenant_roles: TenantRoles, database_dsn: str) -> None:
    """S4: tenant A's tasks are invisible to tenant B through every API and SQL function,
    and nothing B does changes A's rows."""
    a, b = engines
    populated = await _populate_a(a)
    a_head = populated["head"]
    before = await _rows_of(database_dsn, TENANT_A)
    assert all(before[table] for table in ALL_ROWS), before  # A has rows everywhere.

    # Reads through the API: unknown, empty, nothing.
    for read in (b.head, b.history, b.state, b.store.verify_task):
        with pytest.raises(UnknownTask):
            await read("a-task")
    assert await b.store.list_tasks() == []
    assert await b.store.read_events("a-task") == []
    assert await b.gateway.lookup("k1") is None
    anchor = await create_anchor(b.database)
    assert (anchor.tenant, anchor.tasks, anchor.heads) == (TENANT_B, 0, [])
    a_anchor = await create_anchor(a.database)
    assert a_anchor.tasks == 2
    with pytest.raises(AnchorInvalid, match="tenant"):
        await verify_anchor(b.database, a_anchor)

    # Writes through the API: refused as unknown, nothing written.
    with pytest.raises(UnknownTask):
        await b.signal("a-task", "ping", {"from": "B"})
    with pytest.raises(UnknownTask):
        await b.cancel("a-task", reason="B tries")
    with pytest.raises(UnknownTask):
        await b.fork("a-task", 1)
    step = ev.MessageAppended(role="user", content="forged by B")
    fence = {"epoch": a_head.lease_epoch, "expected_seq": a_head.head_seq,
             "prev_hash": a_head.head_hash}
    with pytest.raises(UnknownTask):
        await b.store.append_events("a-task", [step], **fence)
    with pytest.raises(UnknownTask):  # A status move (TRANSITION) as well.
        await b.store.append_events("a-task", [ev.TaskCompleted(output=None)], **fence)
    outcome = await b.store.append_many([PendingAppend(task_id="a-task", events=[step],
                                                       **fence)])
    assert isinstance(outcome["a-task"], UnknownTask)
    # A B worker claims nothing of A's, breaks no A lease.
    assert await b.database.fetch(queries.CLAIM_TASKS, "worker-b", 10, 1000, None, None) == []
    admin = await asyncpg.connect(database_dsn)
    try:  # A's lease expired: only A's own sweep may break it.
        await admin.execute("UPDATE wal_tasks SET lease_expires_at = now() - interval '1 s'"
                            " WHERE tenant = $1", TENANT_A)
        before = await _rows_of(database_dsn, TENANT_A)
    finally:
        await admin.close()
    assert await b.database.fetch(queries.BREAK_LEASES, 100) == []
    assert await b.database.fetch(queries.RENEW_LEASES, ["a-task"], [a_head.lease_epoch],
                                  60_000) == []
    await b.worker(concurrency=1, poll_ms=20, sweep_ms=50, heartbeat_ms=100,
                   lease_ttl_ms=1000).run(until_idle=True)
    # The idempotency gateway: B's key "k1" is B's own; A's result is never returned.
    effect_runs: list[str] = []

    async def effect() -> dict[str, str]:
        effect_runs.append("B")
        return {"done": "by B"}

    assert await b.gateway.run_once(Claim(key="k1", owner="worker-b", epoch=1), effect) == \
        {"done": "by B"}
    assert effect_runs == ["B"]

    # The SQL functions and tables, called directly on B's session.
    connection = await _app_connection(tenant_roles, TENANT_B)
    try:
        assert await connection.fetch("SELECT * FROM wal_claim_tasks('w', 10, 1000)") == []
        assert await connection.fetch("SELECT * FROM wal_break_leases(10)") == []
        for function in ("SELECT wal_send_signal('a-task', 'ping', '\\x7b7d'::bytea, NULL)",
                         "SELECT wal_cancel_task('a-task', 'x', 'B')"):
            assert await _sqlstate(connection, function) == "WE004", function
        assert await connection.fetchval(
            "SELECT count(*) FROM wal_events_json WHERE task_id = 'a-task'") == 0
        for table in TENANT_TABLES:
            assert await connection.fetchval(
                f"SELECT count(*) FROM {table} WHERE tenant = $1", TENANT_A) == 0, table
        # Row security: writing A's rows is refused (42501) or reaches none.
        event_columns = ("(tenant, task_id, seq, type, version, epoch, payload, hash)"
                         " VALUES ($1, 'a-task', 99, 'message_appended', 1, 1, '\\x7b7d', $2)")
        refused = {
            "INSERT INTO wal_events " + event_columns: (TENANT_A, bytes(32)),
            "INSERT INTO wal_tasks (tenant, task_id, agent, status, head_seq, head_hash) "
            "VALUES ($1, 'evil', 'echo', 'QUEUED', 1, $2)": (TENANT_A, bytes(32)),
            "INSERT INTO wal_idempotency (tenant, key, state) VALUES ($1, 'k2', 'running')":
                (TENANT_A,),
            "INSERT INTO wal_snapshots (tenant, task_id, seq, state) "
            "VALUES ($1, 'a-task', 1, '\\x00')": (TENANT_A,),
            "INSERT INTO wal_signals (tenant, task_id, name, payload) "
            "VALUES ($1, 'a-task', 'n', '\\x00')": (TENANT_A,),
            "UPDATE wal_tasks SET tenant = $1 WHERE task_id = 'shared'": (TENANT_A,),
            # No runtime role deletes directly (issue 16: DELETE would allow LOCK TABLE in
            # every mode); the functions below delete, as the owner, within its tenant.
            "DELETE FROM wal_idempotency WHERE tenant <> 'tenant-b'": (),
            "DELETE FROM wal_snapshots WHERE task_id = 'a-task'": (),
        }
        for statement, args in refused.items():
            assert await _sqlstate(connection, statement, *args) == INSUFFICIENT_PRIVILEGE, \
                statement
        assert await connection.execute(
            "UPDATE wal_tasks SET lease_expires_at = now() WHERE task_id = 'a-task'") == \
            "UPDATE 0"
        for function in ("SELECT wal_delete_snapshots('a-task')",
                         "SELECT wal_release_key('k1', 'worker-a', 1)",
                         "SELECT * FROM wal_save_snapshot('a-task', 99, '\\x00', 4::int2, 1,"
                         " '{}', '{}', '{}', '{}', '{}')"):
            assert await _sqlstate(connection, function) is None, function
    finally:
        await connection.close()

    # The CLI, bound to B: no A task.
    listed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "wal_engine.cli", "--tenant", TENANT_B, "tasks", "--json",
         "--dsn", await tenant_roles.dsn(TENANT_B)],
        capture_output=True, text=True, timeout=60, check=False)
    assert listed.returncode == 0, listed.stderr
    assert "a-task" not in listed.stdout

    # The same task id in both tenants, independent: B's submission is new, not a
    # "different task under the same id", and each sees its own.
    assert await b.submit("echo", {"n": "B's own"}, task_id="shared") == "shared"
    assert [r.seq for r in await b.history("shared")] == [1]
    assert (await b.head("shared")).status.value == "QUEUED"
    assert (await a.head("shared")).status.value == "RUNNING"
    assert {t.task_id for t in await b.store.list_tasks()} == {"shared"}
    assert {t.task_id for t in await a.store.list_tasks()} == {"a-task", "shared"}

    assert await _rows_of(database_dsn, TENANT_A) == before
    assert (await a.store.verify_task("a-task")).ok


async def test_s4_notify_payloads_are_opaque_tenant_tokens(
        engines: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """NOTIFY is not filtered by row security: payloads carry the tenant's opaque wake
    token (the SQL twin of engine.wake_token), never a task id."""
    a, b = engines
    payloads: list[str] = []
    listener = await _app_connection(tenant_roles, TENANT_B)
    try:
        await listener.add_listener("wal_engine_wake",
                                    lambda *args: payloads.append(str(args[3])))
        await a.submit("echo", None, task_id="notified-task")
        await a.signal("notified-task", "ping", None)
        for _ in range(100):
            if payloads:
                break
            await asyncio.sleep(0.02)
        assert payloads == [a.wake_token]
        assert a.wake_token != b.wake_token and "notified" not in a.wake_token
        twin = await listener.fetchval("SELECT wal_wake_token()")
        assert twin == b.wake_token == wake_token(TENANT_B)
    finally:
        await listener.close()


async def test_s5_unset_tenant_sees_nothing_and_writes_nothing(
        engines: tuple[Engine, Engine], tenant_roles: TenantRoles, database_dsn: str) -> None:
    """S5: a session with the runtime's privileges whose role is mapped to no tenant sees
    zero rows in every table, view and function, and cannot insert, whatever tenant it
    names."""
    a, _ = engines
    await _populate_a(a)
    before = await _rows_of(database_dsn, TENANT_A)
    connection = await _app_connection(tenant_roles, None)
    try:
        assert await connection.fetchval("SELECT current_setting('wal.tenant', true)") is None
        for table in (*TENANT_TABLES, "wal_events_json"):
            assert await connection.fetchval(f"SELECT count(*) FROM {table}") == 0, table
        assert await connection.fetch(queries.READ_HEAD, "a-task") == []
        assert await connection.fetch(queries.READ_EVENTS, "a-task", 1, 100, 100) == []
        assert await connection.fetch("SELECT * FROM wal_claim_tasks('w', 10, 1000)") == []
        assert await connection.fetch("SELECT * FROM wal_break_leases(10)") == []
        assert await _sqlstate(connection, "SELECT wal_cancel_task('a-task', 'x', 'y')") == \
            "WE004"
        # The tenant column defaults to the setting: unset, an INSERT fails at once.
        assert await _sqlstate(
            connection, "INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash)"
                        " VALUES ('t', 'echo', 'QUEUED', 1, $1)", bytes(32)) == "42704"
        # Naming a tenant does not help: row security compares it with NULL.
        assert await _sqlstate(
            connection, "INSERT INTO wal_tasks (tenant, task_id, agent, status, head_seq,"
                        " head_hash) VALUES ($1, 't', 'echo', 'QUEUED', 1, $2)",
            TENANT_A, bytes(32)) == INSUFFICIENT_PRIVILEGE
        # Naming a tenant by the setting shows nothing either (row security keys on the
        # login role, issue 16), and a setting reset to empty is no tenant.
        async with connection.transaction():
            await connection.execute("SELECT set_config('wal.tenant', $1, true)", TENANT_A)
            assert await connection.fetchval("SELECT count(*) FROM wal_tasks") == 0
            assert await connection.fetch(queries.READ_HEAD, "a-task") == []
        assert await connection.fetchval("SELECT current_setting('wal.tenant', true)") == ""
        assert await connection.fetchval("SELECT count(*) FROM wal_tasks") == 0
    finally:
        await connection.close()
    assert await _rows_of(database_dsn, TENANT_A) == before


BAD_TENANTS = ["", " ", "a b", "x" * 65, "tenant;drop", "t\n", "tenant/", "é", "a'b", "\x00",
               "%", "*"]


@given(st.text(max_size=80).filter(lambda t: re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", t) is None))
def test_tenant_ids_outside_the_allow_list_are_refused(tenant: str) -> None:
    """Fuzzed tenant ids: anything but 1..64 of [A-Za-z0-9_.:-] is InvalidTenant."""
    with pytest.raises(InvalidTenant):
        validate_tenant(tenant)


@given(st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True))
def test_tenant_ids_inside_the_allow_list_are_accepted(tenant: str) -> None:
    assert validate_tenant(tenant) == tenant


async def test_connect_refuses_bad_tenants_before_connecting(
        database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """connect(tenant=...) and WAL_ENGINE_TENANT are checked before any connection; the
    database refuses a malformed tenant too (CHECK), should a session name one."""
    unreachable = "postgresql://nobody@127.0.0.1:1/none"
    for tenant in [*BAD_TENANTS, 7, None.__class__]:
        with pytest.raises(InvalidTenant):
            await connect(unreachable, tenant=tenant)  # type: ignore[arg-type]
    monkeypatch.setenv("WAL_ENGINE_TENANT", "bad tenant")
    with pytest.raises(InvalidTenant):
        await connect(unreachable)
    monkeypatch.delenv("WAL_ENGINE_TENANT")
    connection = await asyncpg.connect(database_dsn, server_settings={"wal.tenant": "a b"})
    try:
        with pytest.raises(asyncpg.CheckViolationError):
            await connection.execute(
                "INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash)"
                " VALUES ('t', 'echo', 'QUEUED', 1, $1)", bytes(32))
    finally:
        await connection.close()


async def test_default_tenant_and_environment(tenant_roles: TenantRoles, database_dsn: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's role serves its own tenant (WAL_ENGINE_TENANT may only repeat it); a
    superuser (development) serves WAL_ENGINE_TENANT, else "default"; Engine.tenant says
    which."""
    engine = await connect(await tenant_roles.dsn("from-role"), migrate=False,
                           development=False)
    try:
        assert engine.tenant == engine.database.tenant == "from-role"
        # The binding is the session's reset value: RESET ALL (asyncpg's default pool
        # reset, or a careless caller) keeps it.
        async with engine.database.pool.acquire() as connection:
            await connection.execute("RESET ALL")
            assert await connection.fetchval("SELECT current_setting('wal.tenant')") == \
                "from-role"
    finally:
        await engine.close()
    monkeypatch.setenv("WAL_ENGINE_TENANT", "from-env")
    with pytest.raises(TenantRoleRefused, match="from-role"):
        await connect(await tenant_roles.dsn("from-role"), migrate=False, development=False)
    engine = await connect(await tenant_roles.dsn("from-env"), migrate=False,
                           development=False)
    try:
        assert engine.tenant == "from-env"
        await engine.submit("echo", None, task_id="env-task")
        assert [t.task_id for t in await engine.store.list_tasks()] == ["env-task"]
    finally:
        await engine.close()
    engine = await connect(database_dsn, migrate=False, development=True)
    try:
        assert engine.tenant == "from-env"
        assert [t.task_id for t in await engine.store.list_tasks()] == ["env-task"]
    finally:
        await engine.close()
    monkeypatch.delenv("WAL_ENGINE_TENANT")
    engine = await connect(database_dsn, migrate=False, development=True)
    try:
        assert engine.tenant == "default"
        assert await engine.store.list_tasks() == []
    finally:
        await engine.close()


async def test_tenant_caps_tasks_events_and_payload_bytes(tenant_roles: TenantRoles,
                                                          database_dsn: str) -> None:
    """Per-tenant caps: tasks (in the database, engine's and administrator's), events per
    task and payload bytes (before anything is sent); each a typed error, nothing written."""
    capped = await _engine(tenant_roles, "capped", tasks_max=2, events_per_task_max=3,
                           payload_bytes_max=200)
    free = await _engine(tenant_roles, "free")
    try:
        await capped.submit("echo", None, task_id="c1")
        await capped.submit("echo", None, task_id="c2")
        assert await capped.submit("echo", None, task_id="c2") == "c2"  # Idempotent resubmit.
        with pytest.raises(TaskQuotaExceeded) as refused:
            await capped.submit("echo", None, task_id="c3")
        assert (refused.value.tenant, refused.value.tasks_max) == ("capped", 2)
        with pytest.raises(UnknownTask):
            await capped.head("c3")
        for index in range(3):  # Another tenant is not capped by it.
            await free.submit("echo", None, task_id=f"f{index}")
        with pytest.raises(PayloadTooLarge):
            await capped.submit("echo", {"text": "x" * 300}, task_id="c-big")
        await capped.database.fetch(queries.CLAIM_TASKS, "w", 10, 60_000, None, None)
        head = await capped.head("c1")
        message = ev.MessageAppended(role="user", content="m")
        grown = await capped.store.append_events(
            "c1", [message], epoch=head.lease_epoch, expected_seq=head.head_seq,
            prev_hash=head.head_hash)
        with pytest.raises(InvalidInput, match="more than 3 events"):
            await capped.store.append_events(
                "c1", [message], epoch=head.lease_epoch, expected_seq=grown.head_seq,
                prev_hash=grown.head_hash)
        # The administrator's cap (the owner's table) applies to an engine without one.
        admin = await asyncpg.connect(database_dsn)
        try:
            await admin.execute("UPDATE wal_tenants SET tasks_max = 3 WHERE tenant = 'free'")
            counts = await admin.fetch("SELECT tenant, tasks FROM wal_tenants ORDER BY 1")
        finally:
            await admin.close()
        assert [tuple(r) for r in counts] == [("capped", 2), ("free", 3)]
        with pytest.raises(TaskQuotaExceeded):
            await free.submit("echo", None, task_id="f3")
        with pytest.raises(TaskQuotaExceeded):  # A fork creates a task too.
            await free.fork("f0", 1)
        # The app role cannot raise its own cap.
        connection = await _app_connection(tenant_roles, "free")
        try:
            assert await _sqlstate(connection, "UPDATE wal_tenants SET tasks_max = NULL") == \
                INSUFFICIENT_PRIVILEGE
        finally:
            await connection.close()
    finally:
        await capped.close()
        await free.close()


async def test_hot_statements_probe_the_primary_keys(
        engines: tuple[Engine, Engine], tenant_roles: TenantRoles, database_dsn: str) -> None:
    """EXPLAIN of the generic plans (as prepared statements run them) of the hot
    statements, as the app role with row security: each probes its primary-key index
    with the tenant as the leading key."""
    a, _ = engines
    await _populate_a(a)
    admin = await asyncpg.connect(database_dsn)
    try:  # Many tasks of three tenants, so that the planner's choice means something.
        await admin.execute("ALTER TABLE wal_tasks DISABLE TRIGGER USER")
        await admin.execute("""
            INSERT INTO wal_tasks (tenant, task_id, agent, status, head_seq, head_hash)
            SELECT t, 'bulk-' || i, 'echo', 'COMPLETED', 3, decode(repeat('00', 32), 'hex')
              FROM unnest(ARRAY['tenant-a', 'tenant-b', 'tenant-c']) AS t,
                   generate_series(1, 3000) AS i""")
        await admin.execute("ALTER TABLE wal_tasks ENABLE TRIGGER USER")
        await admin.execute("""
            INSERT INTO wal_events (tenant, task_id, seq, type, version, epoch, payload, hash)
            SELECT t.tenant, t.task_id, s, 'message_appended', 1, 1, '{}'::bytea,
                   decode(repeat('00', 32), 'hex')
              FROM wal_tasks t, generate_series(1, 5) AS s WHERE t.task_id LIKE 'bulk-%'""")
        await admin.execute("ANALYZE")
        empty = {row["relname"] for row in await admin.fetch(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'wal_events'::regclass AND c.reltuples <= 0")}
    finally:
        await admin.close()
    connection = await _app_connection(tenant_roles, TENANT_A)
    try:
        await connection.execute("SET plan_cache_mode = force_generic_plan")
        args = ("a-task", 1, 2, bytes(32))
        arrays = (["message_appended"], [1], [b"{}"], [""], [bytes(32)])
        stamp = dt.datetime.now(dt.UTC)  # recorded_at: chain version 3 covers it
        plans = {
            "READ_HEAD": (queries.READ_HEAD, ("a-task",)),
            "READ_EVENTS": (queries.READ_EVENTS, ("a-task", 1, 10, 10)),
            "OBSERVE_ONE": (queries.OBSERVE_ONE, (*args, "message_appended", 1, b"{}", "",
                                                  bytes(32), stamp)),
            "OBSERVE_MANY": (queries.OBSERVE_MANY, (*args, *arrays, stamp)),
            "TRANSITION": (queries.TRANSITION, (*args, *arrays, "RUNNING", None, None, None,
                                                stamp)),
            "APPEND_MANY": (queries.APPEND_MANY, (
                ["a-task"], [1], [2], [bytes(32)], [bytes(32)], ["RUNNING"], [None], [0], [None],
                [1], [1], *arrays, [1], [stamp])),
        }
        for name, (statement, values) in plans.items():
            # The generic plan, as a prepared statement runs it after its first executions;
            # EXPLAIN without ANALYZE runs nothing.
            await connection.execute(f"PREPARE {name.lower()} AS {statement}")
            literals = ", ".join(sql_literal(value) for value in values)
            plan = orjson.loads(await connection.fetchval(
                f"EXPLAIN (FORMAT JSON) EXECUTE {name.lower()}({literals})"))
            text = orjson.dumps(plan).decode()
            assert "$1" in text, (name, "not a generic plan", text)
            # The policies' lookup of the session's tenant reads wal_tenant_roles and the
            # role catalog once per statement (an InitPlan): tiny tables, scanned whole.
            # So are the log's month partitions that hold no row yet (APPEND_MANY joins
            # its batch with every partition the batch's tasks may be in; an empty one
            # costs nothing to scan, decision 70).
            scanned = {node.get("Relation Name") for node in plan_nodes(plan)
                       if node.get("Node Type") == "Seq Scan"}
            assert scanned - empty <= {"wal_tenant_roles", "pg_authid"}, (name, scanned, text)
            for table in re.findall(r'"Relation Name":"(wal_\w+)"', text):
                if table in ("wal_events", "wal_tasks"):
                    # (The log's partitions have keys of their own: wal_events_default_pkey,
                    # wal_events_p202612_pkey, decision 70.)
                    assert re.search(rf"{table}(_default|_p[0-9]{{6}})?_pkey", text), (
                        name, table, text)
            assert "tenant" in text, name
    finally:
        await connection.close()


async def test_schema_version_1_database_is_migrated_in_place(database_factory: Any) -> None:
    """A database of schema version 1 (no tenants) gets the tenant column (its rows become
    tenant "default"), tenant-first keys and row security; applying again changes nothing;
    its tasks verify and continue under the default tenant."""
    dsn = await database_factory.create()
    admin = await asyncpg.connect(dsn)
    try:
        for table in ("wal_signals", "wal_idempotency", "wal_snapshots", "wal_events",
                      "wal_tasks", "wal_tenants", "wal_schema_version"):
            await admin.execute(f"DROP TABLE IF EXISTS {table} CASCADE")
        await admin.execute("DROP VIEW IF EXISTS wal_events_json")
        await admin.execute(SCHEMA_V1.read_text())
        await admin.execute("UPDATE wal_schema_version SET checksum = 'v1'")
        # A version-1 task, as version 1 wrote it.
        genesis = bytes(32)
        payload = b'{"agent":"echo","budget":{},"input":null,"parent_seq":null,' \
                  b'"parent_task_id":null}'
        digest = event_hash(genesis, "old-task", 1, "task_submitted", 1, 0, payload)
        await admin.execute(
            "INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash) "
            "VALUES ('old-task', 'echo', 'QUEUED', 1, $1)", digest)
        await admin.execute(
            "INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, prev_hash,"
            " hash) VALUES ('old-task', 1, 'task_submitted', 1, 0, $1, $2, $3)",
            payload, genesis, digest)
        await admin.execute("INSERT INTO wal_signals (task_id, name, payload, dedup_key) "
                            "VALUES ('old-task', 'ping', '\\x7b7d', 'd')")
        assert await apply_schema(admin) is True
        assert await admin.fetchval("SELECT max(version) FROM wal_schema_version") == \
            SCHEMA_VERSION == 5
        keys = {r["conname"]: r["definition"] for r in await admin.fetch(
            "SELECT conname, pg_get_constraintdef(oid) AS definition FROM pg_constraint"
            " WHERE contype IN ('p', 'u') AND conrelid::regclass::text LIKE 'wal\\_%'")}
        assert keys["wal_tasks_pkey"] == "PRIMARY KEY (tenant, task_id)"
        assert keys["wal_events_pkey"] == "PRIMARY KEY (tenant, task_id, seq)"
        assert keys["wal_signals_dedup"] == "UNIQUE (tenant, task_id, dedup_key)"
        assert "wal_signals_task_id_dedup_key_key" not in keys
        checks = {r["conname"]: r["definition"] for r in await admin.fetch(
            "SELECT conname, pg_get_constraintdef(oid) AS definition FROM pg_constraint"
            " WHERE contype = 'c' AND conname LIKE '%\\_tenant\\_format'")}
        # Eight tables of the log, wal_queues (issue 24), and retention's log and
        # tombstones (issue 23).
        assert "~" in checks["wal_tasks_tenant_format"] and len(checks) == 11, checks
        # The log table has one CHECK only, its bounds (decision 39); the ones decision 28
        # dropped are gone, old ones included.
        assert await admin.fetchval("SELECT array_agg(conname) FROM pg_constraint"
                                    " WHERE contype = 'c'"
                                    " AND conrelid = 'wal_events'::regclass") == [
            "wal_events_bounds"]
        secured = await admin.fetch(
            "SELECT relname FROM pg_class WHERE relrowsecurity AND relforcerowsecurity"
            " AND relname LIKE 'wal\\_%' ORDER BY 1")
        assert {r["relname"] for r in secured} >= set(TENANT_TABLES)
        assert await admin.fetchval("SELECT tenant FROM wal_events") == "default"
        assert await admin.fetchval("SELECT tasks FROM wal_tenants WHERE tenant = 'default'") \
            == 1
        before = await admin.fetch("SELECT * FROM wal_events")
        assert await apply_schema(admin, force=True) is True  # Again: nothing changes.
        assert await admin.fetch("SELECT * FROM wal_events") == before
    finally:
        await admin.close()
    engine = await connect(dsn, migrate=False)
    try:
        assert engine.tenant == "default"
        assert (await engine.store.verify_task("old-task")).ok
        assert await engine.signal("old-task", "ping", None, dedup_key="d") >= 1
        await engine.submit("echo", None, task_id="new-task")
        assert {t.task_id for t in await engine.store.list_tasks()} == {"old-task", "new-task"}
    finally:
        await engine.close()
        await database_factory.drop(dsn)



def test_wake_token_is_an_opaque_digest() -> None:
    """The Python twin of wal_wake_token(): 32 hex characters of sha256, per tenant."""
    assert wake_token("acme") == hashlib.sha256(b"wal-engine/wake/acme").hexdigest()[:32]
    assert wake_token("acme") != wake_token("acme2")


async def test_tenant_llm_spend_cap_spans_tasks(tenant_roles: TenantRoles,
                                                database_dsn: str) -> None:
    """The tenant's LLM spend is summed across its tasks as the app role: once it reaches
    the engine's cap, the next LLM call of any of its tasks fails that task with
    budget_exceeded (tenant_llm_spend_usd) before anything is called; another tenant spends
    on; an administrator's lower cap wins; bad caps are refused."""
    calls: list[str] = []

    def register(engine: Engine) -> None:
        @engine.agent("chat")
        async def chat(ctx: Any, task_input: Any) -> Any:
            answers = []
            for n in range(task_input["calls"]):
                def llm(request: Any, n: int = n) -> Any:
                    calls.append(f"{ctx.task_id}:{n}")
                    return {"content": f"answer {n}", "cost_usd": 0.02}
                answers.append(await ctx.llm("model", llm, {"n": n}))
            return answers

    capped = await _engine(tenant_roles, "spender", llm_spend_max_usd=0.05)
    free = await _engine(tenant_roles, "frugal")
    try:
        for engine in (capped, free):
            register(engine)
        first = await capped.submit("chat", {"calls": 5}, task_id="s1")
        other = await free.submit("chat", {"calls": 5}, task_id="s1")
        for engine in (capped, free):
            await engine.worker(concurrency=1, poll_ms=20).run(until_idle=True)
        state = await capped.state(first)
        assert state.status == "FAILED" and state.failure is not None
        assert state.failure.diagnostic["tripped"]["budget"] == "tenant_llm_spend_usd"
        assert state.usage.llm_calls == 3  # 0.02 + 0.02 + 0.02 reaches 0.05 after the third
        assert (await free.state(other)).status == "COMPLETED"
        # A second task of the capped tenant fails at its first LLM call: nothing called.
        before = len(calls)
        second = await capped.submit("chat", {"calls": 1}, task_id="s2")
        await capped.worker(concurrency=1, poll_ms=20).run(until_idle=True)
        assert (await capped.state(second)).status == "FAILED" and len(calls) == before
        admin = await asyncpg.connect(database_dsn)
        try:
            spent = {r["tenant"]: (float(r["llm_spend_usd"]), r["llm_spend_max_usd"])
                     for r in await admin.fetch("SELECT * FROM wal_tenants")}
            assert spent["spender"] == (pytest.approx(0.06), None)
            assert spent["frugal"][0] == pytest.approx(0.10)
            # The administrator's cap applies to an engine without one of its own.
            await admin.execute("UPDATE wal_tenants SET llm_spend_max_usd = 0.1"
                                " WHERE tenant = 'frugal'")
        finally:
            await admin.close()
        third = await free.submit("chat", {"calls": 1}, task_id="s3")
        await free.worker(concurrency=1, poll_ms=20).run(until_idle=True)
        assert (await free.state(third)).failure.diagnostic["tripped"]["limit"] == 0.1
        # The app role cannot raise its own cap or rewrite its spend.
        connection = await _app_connection(tenant_roles, "spender")
        try:
            assert await _sqlstate(connection, "UPDATE wal_tenants SET llm_spend_usd = 0") \
                == "42501"
            assert await _sqlstate(connection, "SELECT * FROM wal_add_llm_spend(-1)") == "22023"
        finally:
            await connection.close()
    finally:
        await capped.close()
        await free.close()
    with pytest.raises(ConfigurationError):
        await connect(await tenant_roles.dsn("x"), migrate=False, tenant="x",
                      llm_spend_max_usd=float("nan"))
