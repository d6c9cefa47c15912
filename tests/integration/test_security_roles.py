"""Least privilege on real PostgreSQL: the roles of security.sql (RELIABILITY.md S1-S3,
S8-S10 and the role limits), exercised as the application role, not as a superuser."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
import structlog

from tests.helpers import log_snapshot
from tests.integration.tenant_roles import TenantRoles
from wal_engine import events as ev
from wal_engine.engine import Engine, connect
from wal_engine.errors import (
    ConcurrencyConflict,
    DuplicateRow,
    IllegalTransition,
    InvalidInput,
    LeaseLost,
)
from wal_engine.security.roles import (
    APP_ROLE,
    OWNER_ROLE,
    InsecureSetup,
    check_runtime_role,
    dsn_for_role,
)
from wal_engine.security.tenants import create_tenant
from wal_engine.store import Database, Store
from wal_engine.store.setup import apply_security

ROOT = Path(__file__).resolve().parents[2]
INSUFFICIENT_PRIVILEGE = "42501"
APPEND_ONLY = "WE002"

FORBIDDEN_FOR_APP = [
    "UPDATE wal_events SET type = 'x'",
    "DELETE FROM wal_events",
    "TRUNCATE wal_events",
    "ALTER TABLE wal_events DISABLE TRIGGER wal_events_append_only",
    "ALTER TABLE wal_events DISABLE TRIGGER ALL",
    "ALTER TABLE wal_events ADD COLUMN evil text",
    "ALTER TABLE wal_events OWNER TO engine_app",
    "DROP TABLE wal_events",
    "UPDATE wal_signals SET name = 'x'",
    "DELETE FROM wal_signals",
    "TRUNCATE wal_signals",
    "INSERT INTO wal_signals (task_id, name, payload) VALUES ('t', 'n', '\\x00')",
    "UPDATE wal_tasks SET lease_epoch = lease_epoch + 1",
    "UPDATE wal_tasks SET attempts = 0",
    "UPDATE wal_tasks SET agent = 'x'",
    "UPDATE wal_tasks SET task_id = 'x'",
    "DELETE FROM wal_tasks",
    "TRUNCATE wal_tasks",
    "ALTER TABLE wal_tasks DISABLE TRIGGER wal_tasks_update_status",
    "TRUNCATE wal_idempotency",
    "UPDATE wal_idempotency SET key = 'x'",
    "TRUNCATE wal_snapshots",
    "UPDATE wal_snapshots SET seq = 1",
    "TRUNCATE wal_snapshot_segments",
    "UPDATE wal_snapshot_segments SET ordinal = 1",
    "INSERT INTO wal_transitions VALUES ('COMPLETED', 'RUNNING')",
    "DELETE FROM wal_transitions",
    "UPDATE wal_schema_version SET checksum = 'x'",
    "CREATE TABLE wal_evil (a int)",
    "CREATE TEMP TABLE wal_transitions (from_status text, to_status text)",
    "CREATE SCHEMA evil",
    "CREATE FUNCTION wal_evil() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "CREATE OR REPLACE FUNCTION wal_refuse_change() RETURNS trigger LANGUAGE plpgsql "
    "AS $$BEGIN RETURN NULL; END$$",
    "ALTER FUNCTION wal_claim_tasks(text, integer, bigint, text[], text[], text[], integer[])"
    " SECURITY INVOKER",
    "DROP FUNCTION wal_cancel_task(text, text, text)",
    "SELECT wal_emit('t', 'task_completed', '{}'::jsonb, 0, 'COMPLETED')",
    "SET ROLE engine_owner",
    "GRANT engine_owner TO engine_app",
    "ALTER ROLE engine_app BYPASSRLS",
    "ALTER SCHEMA public OWNER TO engine_app",
]


async def _secure(dsn: str, **options: Any) -> None:
    admin = await asyncpg.connect(dsn)
    try:
        await apply_security(admin, **options)
    finally:
        await admin.close()


@pytest_asyncio.fixture
async def app_engine(app_dsn: str) -> AsyncIterator[Engine]:
    """An engine connected as the application role (tests/integration/conftest.py's
    app_dsn), development checks off; it may migrate (what S9 checks it cannot)."""
    engine = await connect(app_dsn, migrate=True, pool_size_max=5, development=False)
    yield engine
    await engine.close()


async def _sqlstate(dsn: str, statement: str) -> str | None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(statement)
    except asyncpg.PostgresError as error:
        return str(error.sqlstate)
    finally:
        await connection.close()
    return None


async def test_s1_every_forbidden_statement_fails_with_42501(app_dsn: str,
                                                              database_dsn: str) -> None:
    """S1: each forbidden DML/DDL statement as the app role is refused with 42501."""
    admin = await Database.open(database_dsn, migrate=False)
    try:
        store = Store(admin)
        await store.create_task("s1-task", "agent", input={"x": 1})
        before = await log_snapshot(admin)
        outcomes = {sql: await _sqlstate(app_dsn, sql) for sql in FORBIDDEN_FOR_APP}
        assert {sql: code for sql, code in outcomes.items()
                if code != INSUFFICIENT_PRIVILEGE} == {}
        assert await log_snapshot(admin) == before
        # Control: what the runtime needs is allowed.
        for allowed in ("SELECT count(*) FROM wal_events", "SELECT count(*) FROM wal_signals",
                        "UPDATE wal_tasks SET lease_expires_at = lease_expires_at",
                        "SELECT * FROM wal_break_leases(1)"):
            assert await _sqlstate(app_dsn, allowed) is None, allowed
    finally:
        await admin.close()


async def test_s2_owner_truncate_update_delete_blocked_by_triggers(app_dsn: str,
                                                                    database_dsn: str) -> None:
    """S2: the owner role may alter its tables, but the triggers refuse changes to the log."""
    admin = await asyncpg.connect(database_dsn)
    try:
        engine = await connect(app_dsn, migrate=False, development=False)
        try:
            task_id = await engine.submit("agent", {"x": 1}, task_id="s2-task")
            await engine.signal(task_id, "ping", {"n": 1})
        finally:
            await engine.close()
        for statement in ("UPDATE wal_events SET type = 'x'", "DELETE FROM wal_events",
                          "TRUNCATE wal_events", "UPDATE wal_signals SET name = 'x'",
                          "DELETE FROM wal_signals", "TRUNCATE wal_signals"):
            async with admin.transaction():
                await admin.execute(f"SET LOCAL ROLE {OWNER_ROLE}")
                # Row security is forced on the owner too: name the tenant, so that the rows
                # are visible and the triggers are what refuses.
                await admin.execute("SET LOCAL wal.tenant = 'default'")
                with pytest.raises(asyncpg.PostgresError) as raised:
                    await admin.execute(statement)
                assert raised.value.sqlstate == APPEND_ONLY, statement
    finally:
        await admin.close()


async def test_s3_append_rejects_stale_epoch_gap_duplicate_illegal(app_dsn: str,
                                                                   database_dsn: str) -> None:
    """S3: as the app role, stale epoch, gap, duplicate and illegal transition are refused
    and nothing is written."""
    database = await Database.open(app_dsn, migrate=False, development=False)
    try:
        store = Store(database)
        await store.create_task("s3-task", "agent")
        await database.fetch("SELECT * FROM wal_claim_tasks('w1', 10, 30000)")
        head = await store.read_head("s3-task")
        step = ev.MessageAppended(role="user", content="hi")
        accepted = await store.append_events("s3-task", [step], epoch=head.lease_epoch,
                                             expected_seq=head.head_seq,
                                             prev_hash=head.head_hash)
        before = await log_snapshot(database)
        attempts: list[tuple[type[Exception], dict[str, Any], list[ev.Event]]] = [
            (LeaseLost, {"epoch": head.lease_epoch - 1, "expected_seq": accepted.head_seq,
                         "prev_hash": accepted.head_hash}, [step]),
            (ConcurrencyConflict, {"epoch": head.lease_epoch,
                                   "expected_seq": accepted.head_seq + 5,
                                   "prev_hash": accepted.head_hash}, [step]),
            (ConcurrencyConflict, {"epoch": head.lease_epoch, "expected_seq": head.head_seq,
                                   "prev_hash": head.head_hash}, [step]),
            (IllegalTransition, {"epoch": head.lease_epoch, "expected_seq": accepted.head_seq,
                                 "prev_hash": accepted.head_hash},
             [ev.TaskSubmitted(agent="agent")]),
        ]
        for error, fence, events in attempts:
            with pytest.raises(error):
                await store.append_events("s3-task", events, **fence)
        assert await log_snapshot(database) == before
        # A raw INSERT bypassing the fence is possible (INSERT is granted) but cannot take
        # a seq twice (the store's typed DuplicateRow), and a forged row is named by verify.
        with pytest.raises(DuplicateRow) as duplicate:
            await database.fetch(
                "INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, "
                "hash) VALUES ($1, $2, 'message_appended', 1, 1, '{}', $3)",
                "s3-task", accepted.head_seq, bytes(32))
        assert isinstance(duplicate.value.__cause__, asyncpg.UniqueViolationError)
        await database.fetch(
            "INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, hash)"
            " VALUES ($1, $2, 'message_appended', 1, $3, '{}', $4)",
            "s3-task", accepted.head_seq + 1, head.lease_epoch, bytes(32))
        report = await store.verify_task("s3-task")
        assert report.violation is not None and report.violation.seq == accepted.head_seq + 1
    finally:
        await database.close()


def _sql_code(path: Path) -> str:
    """The statements of a SQL file without its comments."""
    return "\n".join(line.split("--", 1)[0] for line in path.read_text().splitlines())


def test_s8_production_schema_holds_no_test_only_objects() -> None:
    """S8 (static): schema.sql and security.sql create no failpoint, sleep or test objects."""
    forbidden = re.compile(r"pg_sleep|failpoint|pg_signal_backend|wal_test|slow_|\btest",
                           re.IGNORECASE)
    for name in ("schema.sql", "security.sql"):
        found = forbidden.findall(_sql_code(ROOT / name))
        assert found == [], f"{name} holds test-only objects: {found}"


async def test_s8_applied_database_holds_no_test_only_objects(app_dsn: str,
                                                              database_dsn: str) -> None:
    """S8 (live): after the production migrations, no test-only function, trigger or grant."""
    admin = await asyncpg.connect(database_dsn)
    try:
        functions = await admin.fetch(
            "SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
            " AND proname ~* '(test|slow|failpoint|sleep)'")
        triggers = await admin.fetch(
            "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"
            " AND tgname ~* '(test|slow|failpoint|sleep)'")
        signal = await admin.fetchval(
            "SELECT pg_has_role($1, 'pg_signal_backend', 'MEMBER')", APP_ROLE)
        assert (functions, triggers, signal) == ([], [], False)
    finally:
        await admin.close()


async def test_s9_app_role_passes_the_self_test(app_dsn: str,
                                                tenant_roles: TenantRoles) -> None:
    """S9: a tenant's role is not superuser, not BYPASSRLS and owns nothing."""
    connection = await asyncpg.connect(app_dsn)
    try:
        report = await check_runtime_role(connection)
    finally:
        await connection.close()
    assert report.role == (await tenant_roles.create("default")).role
    assert (report.superuser, report.bypassrls, report.owned) == (False, False, [])
    assert report.problems() == []


async def test_s9_engine_refuses_superuser_owner_member_and_bypassrls(
        app_dsn: str, database_dsn: str) -> None:
    """S9: the start-up self-test refuses a superuser, a member of the owner role and a
    BYPASSRLS role unless told it is a development setup."""
    with pytest.raises(InsecureSetup) as superuser:
        await connect(database_dsn, migrate=False, development=False)
    assert "superuser" in str(superuser.value)
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.execute("DROP ROLE IF EXISTS engine_migrator")
        await admin.execute("DROP ROLE IF EXISTS engine_bypass")
        await admin.execute(f"CREATE ROLE engine_migrator LOGIN IN ROLE {OWNER_ROLE}")
        await admin.execute(f"CREATE ROLE engine_bypass LOGIN BYPASSRLS IN ROLE {APP_ROLE}")
        try:
            with pytest.raises(InsecureSetup) as member:
                await connect(dsn_for_role(database_dsn, "engine_migrator"), migrate=False,
                              development=False)
            assert "owner" in str(member.value)
            with pytest.raises(InsecureSetup) as bypass:
                await connect(dsn_for_role(database_dsn, "engine_bypass"), migrate=False,
                              development=False)
            assert "BYPASSRLS" in str(bypass.value)
            allowed = await connect(dsn_for_role(database_dsn, "engine_bypass"),
                                    migrate=False, development=True)
            await allowed.close()
        finally:
            await admin.execute("DROP ROLE engine_migrator")
            await admin.execute("DROP ROLE engine_bypass")
    finally:
        await admin.close()


async def test_app_role_carries_statement_and_idle_timeouts(database_dsn: str) -> None:
    """Limits: a tenant's role carries statement_timeout and
    idle_in_transaction_session_timeout as its own defaults (for sessions that are not an
    engine's: engines send theirs at connection start), and a statement over the limit is
    cancelled."""
    await _secure(database_dsn, owner_role="engine_owner_limits", app_role="engine_app_limits")
    admin = await asyncpg.connect(database_dsn)
    try:
        credentials = await create_tenant(admin, "limited", dsn=database_dsn,
                                          app_role="engine_app_limits",
                                          statement_timeout_ms=300,
                                          idle_in_transaction_timeout_ms=5000)
    finally:
        await admin.close()
    connection = await asyncpg.connect(credentials.dsn)
    try:
        assert await connection.fetchval("SHOW statement_timeout") == "300ms"
        assert await connection.fetchval("SHOW idle_in_transaction_session_timeout") == "5s"
        with pytest.raises(asyncpg.QueryCanceledError):
            await connection.execute("SELECT count(*) FROM generate_series(1, 1e9::bigint)")
    finally:
        await connection.close()
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.execute(f'DROP OWNED BY "{credentials.role}"')
        await admin.execute(f'DROP ROLE "{credentials.role}"')
    finally:
        await admin.close()


async def _schema_fingerprint(dsn: str) -> list[tuple[Any, ...]]:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch("""
            SELECT 'rel', c.relname, c.relkind::text, md5(coalesce(string_agg(
                       a.attname || ':' || format_type(a.atttypid, a.atttypmod), ','
                       ORDER BY a.attnum), ''))
              FROM pg_class c LEFT JOIN pg_attribute a
                ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
             WHERE c.relnamespace = 'public'::regnamespace GROUP BY c.relname, c.relkind
            UNION ALL
            SELECT 'fn', p.oid::regprocedure::text, p.prosecdef::text,
                   md5(p.prosrc || coalesce(array_to_string(p.proconfig, ','), ''))
              FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
            UNION ALL
            SELECT 'tg', t.tgname, t.tgenabled::text, t.tgrelid::regclass::text
              FROM pg_trigger t WHERE NOT t.tgisinternal
            UNION ALL
            SELECT 'acl', c.relname, '', coalesce(c.relacl::text, '')
              FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace
            ORDER BY 1, 2""")
        return [tuple(row) for row in rows]
    finally:
        await connection.close()


INJECTIONS = [
    "x'; DROP TABLE wal_events; --",
    "'); TRUNCATE wal_tasks; --",
    "$$; ALTER TABLE wal_events DISABLE TRIGGER ALL; $$",
    "\\'; UPDATE wal_tasks SET lease_epoch = 0; --",
    "task\n2026-01-01 [info ] forged_line task_id=evil",
    "\u0000",
]


async def test_s10_injection_shaped_ids_and_payloads_leave_schema_unchanged(
        app_dsn: str, app_engine: Engine) -> None:
    """S10: injection-shaped task ids, names and payloads are refused or stored as data;
    the schema is unchanged and every log line stays one structured record."""
    before = await _schema_fingerprint(app_dsn)
    engine = app_engine
    for text in INJECTIONS:
        with pytest.raises(InvalidInput):
            await engine.submit("agent", {"q": text}, task_id=text)

    @engine.agent("injected")
    async def injected(ctx: Any, task_input: Any) -> Any:
        await ctx.message("user", task_input)
        for text in INJECTIONS[:-1]:
            await ctx.tool(text[:50], lambda args: {"echo": args}, {"q": text})
        return task_input

    task_id = await engine.submit("injected", {"q": INJECTIONS[:-1]}, task_id="s10-task")
    for text in INJECTIONS[:-1]:
        await engine.signal(task_id, text[:100], {"sql": text})
    with pytest.raises(InvalidInput):
        await engine.signal(task_id, "nul", {"sql": INJECTIONS[-1]})
    with structlog.testing.capture_logs() as logs:
        worker = engine.worker(concurrency=2, lease_ttl_ms=2000, heartbeat_ms=300,
                               poll_ms=50, sweep_ms=200)
        running = asyncio.create_task(worker.run())
        try:
            state = await engine.wait(task_id, timeout_s=30)
        finally:
            worker.stop()
            await running
    assert state.output == {"q": INJECTIONS[:-1]}
    assert (await engine.store.verify_task(task_id)).ok
    assert await _schema_fingerprint(app_dsn) == before
    renderer = structlog.processors.JSONRenderer()
    for entry in logs:
        assert "\n" not in renderer(None, "info", dict(entry))
        assert not str(entry.get("event", "")).startswith("2026-01-01")


async def test_events_per_task_bound_refuses_growth_but_not_the_ending(app_dsn: str) -> None:
    """Limits: past its events bound a task takes no more events, except the one that ends
    it, so a runaway agent is failed instead of filling the log."""
    database = await Database.open(app_dsn, migrate=False, development=False)
    try:
        store = Store(database, events_per_task_max=4)
        await store.create_task("bounded", "agent")
        await database.fetch("SELECT * FROM wal_claim_tasks('w1', 10, 30000)")
        head = await store.read_head("bounded")
        fence = {"epoch": head.lease_epoch}
        grown = await store.append_events(
            "bounded", [ev.MessageAppended(role="user", content="a"),
                        ev.MessageAppended(role="user", content="b")],
            expected_seq=head.head_seq, prev_hash=head.head_hash, **fence)
        with pytest.raises(InvalidInput, match="more than 4 events"):
            await store.append_events("bounded", [ev.MessageAppended(role="user", content="c")],
                                      expected_seq=grown.head_seq, prev_hash=grown.head_hash,
                                      **fence)
        ended = await store.append_events(
            "bounded", [ev.TaskFailed(reason="events_bound")], expected_seq=grown.head_seq,
            prev_hash=grown.head_hash, **fence)
        assert ended.head_seq == 5
    finally:
        await database.close()


async def test_runaway_agent_is_failed_at_its_events_bound(app_engine: Engine) -> None:
    """Limits: an agent that appends without end is failed once its task hits the bound."""
    app_engine.store.events_per_task_max = 12

    @app_engine.agent("runaway")
    async def runaway(ctx: Any, task_input: Any) -> Any:
        for index in range(100):
            await ctx.message("assistant", f"message {index}")
        return "never"

    task_id = await app_engine.submit("runaway", None)
    worker = app_engine.worker(concurrency=1, lease_ttl_ms=2000, heartbeat_ms=300,
                               poll_ms=50, sweep_ms=200)
    running = asyncio.create_task(worker.run())
    try:
        state = await app_engine.wait(task_id, timeout_s=30)
    finally:
        worker.stop()
        await running
    assert state.status.value == "FAILED" and state.last_seq <= 13


async def test_apply_security_is_idempotent(app_dsn: str, database_dsn: str) -> None:
    """Applying security.sql again changes no ownership, grant or function attribute."""
    before = await _schema_fingerprint(database_dsn)
    await _secure(database_dsn)
    assert await _schema_fingerprint(database_dsn) == before
