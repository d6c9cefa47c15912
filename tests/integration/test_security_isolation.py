"""Tenants kept apart against whoever holds one tenant's runtime credential (issue 16;
RELIABILITY.md S4 redone, S11, S12), on real PostgreSQL.

Tenant B's own login role runs arbitrary SQL: it names tenant A by every means a session
has (SET, set_config, SET LOCAL, RESET, the startup packet, SET ROLE, its own role
defaults), calls every SQL function and writes every table for A, alters its own defaults,
signals A's backends, locks every engine table in every mode, takes advisory locks and
inserts rows into the log directly. Each test then asserts that A's rows are invisible to
B and unchanged (read as a superuser), that A's figures (task count, caps, LLM spend) are
untouched, and that A's engine still submits, runs to completion, shows and verifies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
import structlog
from click.testing import CliRunner, Result

from tests.integration.tenant_roles import TenantRoles, secure
from tests.integration.tenant_roles import sqlstate as _sqlstate
from tests.integration.test_cli_agents import lines, one_error_line
from wal_engine import events as ev
from wal_engine.cli import main
from wal_engine.dsn import with_database
from wal_engine.effects.gateway import Claim
from wal_engine.engine import Engine, connect
from wal_engine.errors import DatabaseUnavailable, InvalidInput, TenantRoleRefused
from wal_engine.observability import logs
from wal_engine.runtime.registry import record_worker
from wal_engine.runtime.resume import resume, save_snapshot
from wal_engine.security.roles import APP_ROLE, OWNER_ROLE, InsecureSetup
from wal_engine.security.tenants import (
    TenantExists,
    create_tenant,
    disable_tenant,
    enable_tenant,
    list_tenants,
    rotate_tenant,
    scram_verifier,
    tenant_role_name,
)
from wal_engine.store import queries
from wal_engine.testing.postgres import start_embedded_server

TENANT_A = "tenant-a"
TENANT_B = "tenant-b"
INSUFFICIENT_PRIVILEGE = "42501"
deadline_s = 30.0

TENANT_TABLES = ("wal_tasks", "wal_events", "wal_snapshots", "wal_snapshot_segments",
                 "wal_idempotency", "wal_signals", "wal_tenants", "wal_workers")
LOCK_MODES = ("ACCESS SHARE", "ROW SHARE", "ROW EXCLUSIVE", "SHARE UPDATE EXCLUSIVE", "SHARE",
              "SHARE ROW EXCLUSIVE", "EXCLUSIVE", "ACCESS EXCLUSIVE")
HARMLESS_LOCK_MODES = {"ACCESS SHARE", "ROW SHARE", "ROW EXCLUSIVE"}
"""The modes a runtime role may take: they conflict with no mode the runtime takes (reads
take ACCESS SHARE, writes ROW EXCLUSIVE, SELECT ... FOR UPDATE ROW SHARE), only with the
owner's DDL (SHARE and stronger)."""

# Everything tenant A has, read as a superuser (no row security), in a fixed order.
A_ROWS = {
    "wal_tasks": "SELECT * FROM wal_tasks WHERE tenant = $1 ORDER BY task_id",
    "wal_events": "SELECT * FROM wal_events WHERE tenant = $1 ORDER BY task_id, seq",
    "wal_snapshots": "SELECT * FROM wal_snapshots WHERE tenant = $1 ORDER BY task_id, seq",
    "wal_snapshot_segments": "SELECT * FROM wal_snapshot_segments WHERE tenant = $1"
                             " ORDER BY task_id, field, ordinal, digest",
    "wal_idempotency": "SELECT * FROM wal_idempotency WHERE tenant = $1 ORDER BY key",
    "wal_signals": "SELECT * FROM wal_signals WHERE tenant = $1 ORDER BY signal_id",
    "wal_tenants": "SELECT * FROM wal_tenants WHERE tenant = $1",
    "wal_workers": "SELECT * FROM wal_workers WHERE tenant = $1 ORDER BY worker_id",
    "wal_tenant_roles": "SELECT * FROM wal_tenant_roles WHERE tenant = $1",
}

# Ways a session names a tenant: each runs on a fresh session of B's role.
SWITCHES = {
    "SET": ["SET wal.tenant = 'tenant-a'"],
    "set_config": ["SELECT set_config('wal.tenant', 'tenant-a', false)"],
    "SET LOCAL": ["BEGIN", "SET LOCAL wal.tenant = 'tenant-a'"],
    "RESET": ["SET wal.tenant = 'tenant-a'", "RESET wal.tenant"],
    "RESET ALL": ["SET wal.tenant = 'tenant-a'", "RESET ALL"],
    "SET ROLE": ["SET ROLE engine_app", "SET wal.tenant = 'tenant-a'"],
    "SET SESSION AUTHORIZATION": ["SET wal.tenant = 'tenant-a'"],
}


async def _rows_of_a(admin_dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    connection = await asyncpg.connect(admin_dsn)
    try:
        return {table: [tuple(row) for row in await connection.fetch(sql, TENANT_A)]
                for table, sql in A_ROWS.items()}
    finally:
        await connection.close()


async def _engine(roles: TenantRoles, tenant: str, *, migrate: bool = False) -> Engine:
    """An engine of ``tenant`` logged in as its role, with the agent "echo"."""
    engine = await connect(await roles.dsn(tenant), migrate=migrate, pool_size_max=4,
                           development=False)

    @engine.agent("echo")
    async def echo(ctx: Any, task_input: Any) -> Any:
        await ctx.message("assistant", f"echo {task_input}")
        return task_input

    return engine


@pytest_asyncio.fixture
async def tenants(tenant_roles: TenantRoles) -> AsyncIterator[tuple[Engine, Engine]]:
    """Engines of tenants A and B, each logged in as its own role; A has rows in every
    table and figures set by the administrator (caps) and by its engine (LLM spend)."""
    a = await _engine(tenant_roles, TENANT_A)
    b = await _engine(tenant_roles, TENANT_B)
    await _populate_a(a, tenant_roles.admin_dsn)
    yield a, b
    await a.close()
    await b.close()


async def _populate_a(a: Engine, admin_dsn: str) -> None:
    await a.submit("echo", {"n": 1}, task_id="a-task")
    await a.submit("echo", {"n": 2}, task_id="a-queued")
    await a.database.fetch(queries.CLAIM_TASKS, "worker-a", 1, 600_000, None, None)
    head = await a.head("a-task")
    await a.store.append_events(
        "a-task", [ev.MessageAppended(role="user", content="secret of A")],
        epoch=head.lease_epoch, expected_seq=head.head_seq, prev_hash=head.head_hash)
    await a.signal("a-task", "ping", {"from": "A"}, dedup_key="d1")

    async def effect() -> dict[str, str]:
        return {"done": "by A"}

    await a.gateway.run_once(Claim(key="k1", owner="worker-a", epoch=head.lease_epoch,
                                   task_id="a-task"), effect)
    assert await save_snapshot(a.database, await resume(a.store, "a-task"))
    await a.database.fetch("SELECT * FROM wal_add_llm_spend(0.25)")
    await record_worker(a.database, "worker-a", ["echo"])
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute("UPDATE wal_tenants SET tasks_max = 50, llm_spend_max_usd = 2"
                            " WHERE tenant = $1", TENANT_A)
        # A registration a week old, which only A's own registrations may prune.
        await admin.execute("INSERT INTO wal_workers (tenant, worker_id, agents, seen_at)"
                            " VALUES ($1, 'worker-a-gone', '{echo}', now() - interval '8 days')",
                            TENANT_A)
    finally:
        await admin.close()


async def _a_still_works(a: Engine) -> None:
    """A's engine submits, runs a task to completion, shows and verifies it, in time."""
    async def scenario() -> None:
        task_id = await a.submit("echo", {"after": "attack"})
        await a.worker(concurrency=1, poll_ms=20, sweep_ms=100).run(until_idle=True)
        state = await a.state(task_id)
        assert state.status == "COMPLETED" and state.output == {"after": "attack"}
        assert [e.type for e in await a.history(task_id)][-1] == "task_completed"
        assert (await a.store.verify_task(task_id)).ok
        assert (await a.store.verify_task("a-task")).ok

    await asyncio.wait_for(scenario(), deadline_s)


async def _attack_as_b(connection: asyncpg.Connection) -> dict[str, Any]:
    """Every read, function and write of A's data a session of B's role may try; what
    each returned (counts, SQLSTATEs)."""
    found: dict[str, Any] = {}
    for table in (*TENANT_TABLES, "wal_tenant_roles", "wal_events_json"):
        found[f"read {table}"] = await connection.fetchval(
            f"SELECT count(*) FROM {table} WHERE tenant = $1", TENANT_A)
    found["read heads"] = len(await connection.fetch(queries.READ_HEAD, "a-task"))
    found["claim"] = len(await connection.fetch(
        "SELECT * FROM wal_claim_tasks('evil', 10, 600000)"))
    found["break leases"] = len(await connection.fetch("SELECT * FROM wal_break_leases(10)"))
    for name, statement in {
        "signal": "SELECT wal_send_signal('a-task', 'approved', '\\x7b7d'::bytea, NULL)",
        "cancel": "SELECT wal_cancel_task('a-task', 'evil', 'evil')",
        "spend": "SELECT * FROM wal_add_llm_spend(1000)",
        "delete snapshots": "SELECT wal_delete_snapshots('a-task')",
        "release key": "SELECT wal_release_key('k1', 'worker-a', 1)",
        "prune workers": "SELECT wal_prune_workers()",
        "save snapshot": "SELECT * FROM wal_save_snapshot('a-task', 2, '\\x00', 4::int2, 1,"
                         " '{}', '{}', '{}', '{}', '{}')",
        "insert event": "INSERT INTO wal_events (tenant, task_id, seq, type, version, epoch,"
                        " payload, hash) VALUES ('tenant-a', 'a-task', 99,"
                        " 'task_completed', 1, 1, '\\x7b7d', '\\x00')",
        "insert event (default tenant)": "INSERT INTO wal_events (task_id, seq, type,"
                        " version, epoch, payload, hash) VALUES ('a-task', 99,"
                        " 'task_completed', 1, 1, '\\x7b7d', '\\x00')",
        "insert task": "INSERT INTO wal_tasks (tenant, task_id, agent, status, head_seq,"
                       " head_hash) VALUES ('tenant-a', 'evil', 'echo', 'QUEUED', 1,"
                       " decode(repeat('00', 32), 'hex'))",
        "update task": "UPDATE wal_tasks SET status = 'COMPLETED' WHERE task_id = 'a-task'",
        "update key": "UPDATE wal_idempotency SET state = 'failed' WHERE key = 'k1'",
        # Worker registrations: a forged one would silence `submit`'s warning for A.
        "insert worker": "INSERT INTO wal_workers (tenant, worker_id, agents)"
                         " VALUES ('tenant-a', 'evil', '{fake}')",
        "update worker": "UPDATE wal_workers SET agents = '{fake}' WHERE worker_id = 'worker-a'",
        "map to A": "INSERT INTO wal_tenant_roles (role_name, tenant)"
                    " VALUES ('evil', 'tenant-a')",
        "remap self": "UPDATE wal_tenant_roles SET tenant = 'tenant-a'",
        "spend as owner": "UPDATE wal_tenants SET llm_spend_usd = 'Infinity'",
        "cap as owner": "UPDATE wal_tenants SET tasks_max = 0",
    }.items():
        found[name] = await _sqlstate(connection, statement)
    return found


UNSET_TENANT = "42704"
UNIQUE_VIOLATION = "23505"
"""A session whose setting was reset names no tenant: the column default fails."""
REFUSED = {INSUFFICIENT_PRIVILEGE}
NOTHING_OR_REFUSED = {None, INSUFFICIENT_PRIVILEGE, UNSET_TENANT}
"""Ran without touching A's rows (they are invisible), or refused by row security (the
session names A) or by the unset setting (after RESET)."""


def _unexpected(found: dict[str, Any]) -> dict[str, Any]:
    """The outcomes of B's attack that are not what isolation allows."""
    allowed: dict[str, set[Any]] = {f"read {t}": {0} for t in (*TENANT_TABLES,
                                                               "wal_tenant_roles",
                                                               "wal_events_json")}
    allowed.update({"read heads": {0}, "claim": {0}, "break leases": {0},
                    "signal": {"WE004"}, "cancel": {"WE004"},
                    "update task": {None}, "update key": {None}, "update worker": {None}})
    for name in ("spend", "delete snapshots", "release key", "prune workers",
                 "save snapshot"):
        allowed[name] = NOTHING_OR_REFUSED
    # After RESET the role's own default names B itself (wal-engine tenant create sets it,
    # decision 66): the row goes to B's own log, the second time onto the same key there.
    allowed["insert event (default tenant)"] = NOTHING_OR_REFUSED | {UNIQUE_VIOLATION}
    for name in ("insert event", "insert task", "insert worker", "map to A", "remap self",
                 "spend as owner", "cap as owner"):
        allowed[name] = REFUSED
    return {name: value for name, value in found.items() if value not in allowed[name]}


async def test_s11_naming_another_tenant_shows_and_changes_nothing(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """S11: B's role names A by SET, set_config, SET LOCAL, RESET, RESET ALL, SET ROLE, the
    startup packet and its own role default, then reads, calls every function and writes
    every table: it sees no row of A, changes none, and A's engine keeps working."""
    a, _ = tenants
    admin_dsn = tenant_roles.admin_dsn
    before = await _rows_of_a(admin_dsn)
    assert all(rows for table, rows in before.items() if table != "wal_snapshot_segments"), before
    b_dsn = await tenant_roles.dsn(TENANT_B)
    outcomes: dict[str, dict[str, Any]] = {}
    for switch, statements in SWITCHES.items():
        connection = await asyncpg.connect(b_dsn)
        try:
            for statement in statements:
                if statement == "BEGIN":  # asyncpg's own, so that savepoints nest in it
                    await connection.transaction().start()
                else:
                    await connection.execute(statement)
            if switch == "SET SESSION AUTHORIZATION":
                assert await _sqlstate(connection, "SET SESSION AUTHORIZATION postgres") == \
                    INSUFFICIENT_PRIVILEGE
            outcomes[switch] = await _attack_as_b(connection)
        finally:
            await connection.close()
    connection = await asyncpg.connect(b_dsn, server_settings={"wal.tenant": TENANT_A})
    try:
        outcomes["startup packet"] = await _attack_as_b(connection)
        # PostgreSQL 15 and later refuse a role default for a placeholder setting to a
        # non-superuser; where it is accepted, the default is one more way to name A.
        role_default = await _sqlstate(
            connection, "ALTER ROLE CURRENT_USER SET wal.tenant = 'tenant-a'")
        assert role_default in (None, INSUFFICIENT_PRIVILEGE)
    finally:
        await connection.close()
    if role_default is None:
        connection = await asyncpg.connect(b_dsn)
        try:
            assert await connection.fetchval("SHOW wal.tenant") == TENANT_A
            outcomes["role default"] = await _attack_as_b(connection)
        finally:
            await connection.close()
    assert {switch: _unexpected(found) for switch, found in outcomes.items()} == \
        {switch: {} for switch in outcomes}
    assert await _rows_of_a(admin_dsn) == before
    await _a_still_works(a)


async def test_the_audit_view_shows_a_tenants_role_its_own_events(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """wal_events_json as documented: A's role auditing in psql (no setting) sees A's
    events; a superuser sees none until it names a tenant by SET wal.tenant."""
    connection = await asyncpg.connect(await tenant_roles.dsn(TENANT_A))
    try:
        # No setting sent: the role's own default, its tenant (decision 66).
        assert await connection.fetchval("SELECT current_setting('wal.tenant', true)") == \
            TENANT_A
        own = await connection.fetchval("SELECT count(*) FROM wal_events")
        assert own > 0
        assert await connection.fetchval("SELECT count(*) FROM wal_events_json") == own
        assert await connection.fetchval(
            "SELECT count(*) FROM wal_events_json WHERE tenant <> $1", TENANT_A) == 0
    finally:
        await connection.close()
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        assert await admin.fetchval("SELECT count(*) FROM wal_events_json") == 0
        await admin.execute(f"SET wal.tenant = '{TENANT_A}'")
        assert await admin.fetchval("SELECT count(*) FROM wal_events_json") == own
    finally:
        await admin.close()


async def test_s4_every_sql_function_keeps_to_the_callers_tenant(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """S4 with two tenants' roles: each SQL function granted to the runtime, called by B on
    its own session with A's task ids, acts on B's rows only; B's own calls work."""
    a, b = tenants
    before = await _rows_of_a(tenant_roles.admin_dsn)
    await b.submit("echo", {"n": "B"}, task_id="a-task")  # The same id, B's own task.
    connection = await asyncpg.connect(await tenant_roles.dsn(TENANT_B),
                                       server_settings={"wal.tenant": TENANT_B})
    try:
        claimed = await connection.fetch("SELECT * FROM wal_claim_tasks('evil', 10, 600000)")
        assert [r["task_id"] for r in claimed] == ["a-task"]
        assert await connection.fetchval(
            "SELECT wal_send_signal('a-task', 'ping', '\\x7b7d'::bytea, 'd1')") >= 1
        assert await connection.fetchval("SELECT wal_cancel_task('a-task', 'b', 'b')") is True
        assert await _sqlstate(connection, "SELECT wal_cancel_task('a-queued', 'b', 'b')") == \
            "WE004"
        spent = await connection.fetchrow("SELECT * FROM wal_add_llm_spend(0.5)")
        assert float(spent["llm_spend_usd"]) == 0.5 and spent["llm_spend_max_usd"] is None
        for function in ("SELECT wal_delete_snapshots('a-task')",
                         "SELECT wal_release_key('k1', 'worker-a', 1)"):
            await connection.execute(function)
        # B's registration prunes B's week-old row, never A's (checked below).
        admin = await asyncpg.connect(tenant_roles.admin_dsn)
        try:
            await admin.execute("INSERT INTO wal_workers (tenant, worker_id, agents, seen_at)"
                                " VALUES ($1, 'worker-b-gone', '{echo}',"
                                " now() - interval '8 days')", TENANT_B)
        finally:
            await admin.close()
        await record_worker(b.database, "worker-b", ["echo"])
        assert {r["worker_id"] for r in await connection.fetch(
            "SELECT worker_id FROM wal_workers")} == {"worker-b"}
        assert await _sqlstate(connection, "DELETE FROM wal_workers") == INSUFFICIENT_PRIVILEGE
        assert await connection.fetchval("SELECT wal_wake_token()") == b.wake_token
        assert await connection.fetchval("SELECT count(*) FROM wal_tenants") == 1
    finally:
        await connection.close()
    assert (await b.head("a-task")).status.value == "FAILED"
    assert await _rows_of_a(tenant_roles.admin_dsn) == before
    await _a_still_works(a)


WEAKENING_DEFAULTS = [
    "row_security = off",
    "default_transaction_read_only = on",
    "statement_timeout = 0",
    "statement_timeout = '1h'",
    "idle_in_transaction_session_timeout = 0",
    "synchronous_commit = off",
    "synchronous_commit = local",
    "default_transaction_isolation = 'serializable'",
]


@pytest.mark.parametrize("setting", WEAKENING_DEFAULTS)
async def test_s12_own_defaults_weaken_no_one_and_are_refused(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles, setting: str) -> None:
    """S12: B sets a weakening default on its own role (ALTER ROLE ... SET): A's engine is
    untouched, B's next engine refuses to start (InsecureSetup naming it), and after the
    owner rotates B's role, B starts again with the settings the engine sends."""
    a, _ = tenants
    before = await _rows_of_a(tenant_roles.admin_dsn)
    b_dsn = await tenant_roles.dsn(TENANT_B)
    connection = await asyncpg.connect(b_dsn)
    try:
        await connection.execute(f"ALTER ROLE CURRENT_USER SET {setting}")
        database = await connection.fetchval("SELECT current_database()")
        a_role = tenant_role_name(database, TENANT_A)
        for statement in (f'ALTER ROLE "{a_role}" SET {setting}',
                          f"ALTER ROLE {APP_ROLE} SET {setting}",
                          f"ALTER ROLE {OWNER_ROLE} SET {setting}",
                          f"ALTER ROLE ALL SET {setting}",
                          f'ALTER DATABASE "{database}" SET {setting}'):
            assert await _sqlstate(connection, statement) == INSUFFICIENT_PRIVILEGE, statement
    finally:
        await connection.close()
    with pytest.raises(InsecureSetup, match="its own defaults weaken"):
        await connect(b_dsn, migrate=False, development=False)
    assert await _rows_of_a(tenant_roles.admin_dsn) == before
    await _a_still_works(a)
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        rotated = await rotate_tenant(admin, TENANT_B, dsn=tenant_roles.admin_dsn)
    finally:
        await admin.close()
    engine = await connect(rotated.dsn, migrate=False, development=False)
    try:
        async with engine.database.pool.acquire() as pooled:
            shown = {r["name"]: r["setting"] for r in await pooled.fetch(
                "SELECT name, setting FROM pg_settings WHERE name = ANY ($1::text[])",
                list(engine.database.required))}
        assert shown == engine.database.required
        assert engine.tenant == TENANT_B
    finally:
        await engine.close()


async def test_s12_sabotaging_defaults_are_overridden_at_connection_start(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """S12: defaults that do not weaken but would break B's engine (a 1 ms statement
    timeout) are overridden by what the engine sends at connection start: it runs."""
    _, b = tenants
    connection = await asyncpg.connect(await tenant_roles.dsn(TENANT_B))
    try:
        await connection.execute("ALTER ROLE CURRENT_USER SET statement_timeout = '1ms'")
    finally:
        await connection.close()
    engine = await connect(await tenant_roles.dsn(TENANT_B), migrate=False, development=False)
    try:
        async with engine.database.pool.acquire() as pooled:
            assert await pooled.fetchval("SHOW statement_timeout") == "30s"
        await engine.submit("echo", None, task_id="b-after-sabotage")
        assert (await engine.head("b-after-sabotage")).head_seq == 1
    finally:
        await engine.close()
    assert b.tenant == TENANT_B


async def test_s12_other_tenants_backends_cannot_be_signalled(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """S12: B's role can neither terminate nor cancel A's backends (per-tenant roles; no
    membership in pg_signal_backend), and A's pooled sessions survive the attempts."""
    a, _ = tenants
    before = await _rows_of_a(tenant_roles.admin_dsn)
    a_role = (await tenant_roles.create(TENANT_A)).role
    connection = await asyncpg.connect(await tenant_roles.dsn(TENANT_B))
    try:
        pids = [r["pid"] for r in await connection.fetch(
            "SELECT pid FROM pg_stat_activity WHERE usename = $1", a_role)]
        assert pids, "A's engine holds sessions"
        for pid in pids:
            for function in ("pg_terminate_backend", "pg_cancel_backend"):
                assert await _sqlstate(connection, f"SELECT {function}($1)", pid) == \
                    INSUFFICIENT_PRIVILEGE, function
        assert await connection.fetchval(
            "SELECT pg_has_role(current_user, 'pg_signal_backend', 'USAGE')") is False
    finally:
        await connection.close()
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        alive = await admin.fetchval("SELECT count(*) FROM pg_stat_activity"
                                     " WHERE pid = ANY ($1::int[])", pids)
    finally:
        await admin.close()
    assert alive == len(pids)
    assert await _rows_of_a(tenant_roles.admin_dsn) == before
    await _a_still_works(a)


async def _engine_tables(connection: asyncpg.Connection) -> list[str]:
    rows = await connection.fetch(
        "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
        " AND relkind IN ('r', 'p') AND relname LIKE 'wal\\_%' ORDER BY 1 LIMIT 100")
    return [str(r["relname"]) for r in rows]


async def test_s12_a_role_granted_another_tenants_role_is_refused_until_rotated(
        tenant_roles: TenantRoles) -> None:
    """S12: if an administrator grants A's role to B's (B could then terminate A's
    sessions), B's engine refuses to start; rotating B's role revokes the membership."""
    a_role = (await tenant_roles.create(TENANT_A)).role
    b = await tenant_roles.create(TENANT_B)
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        await admin.execute(f'GRANT "{a_role}" TO "{b.role}"')
        with pytest.raises(InsecureSetup, match="member of the login role"):
            await connect(b.dsn, migrate=False, development=False)
        rotated = await rotate_tenant(admin, TENANT_B, dsn=tenant_roles.admin_dsn)
    finally:
        await admin.close()
    engine = await connect(rotated.dsn, migrate=False, development=False)
    await engine.close()


async def test_s12_table_locks_of_a_runtime_role_stall_no_other_tenant(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """S12: B's role may LOCK an engine table only in ACCESS SHARE, ROW SHARE or ROW
    EXCLUSIVE mode (every stronger mode is 42501 on every table); holding every lock it can
    get, on every table at once, it stalls nothing of A's engine."""
    a, _ = tenants
    before = await _rows_of_a(tenant_roles.admin_dsn)
    connection = await asyncpg.connect(await tenant_roles.dsn(TENANT_B))
    try:
        tables = await _engine_tables(connection)
        assert {"wal_events", "wal_tasks", "wal_snapshots", "wal_tenant_roles"} <= set(tables)
        granted: dict[str, list[str]] = {}
        for table in tables:
            for mode in LOCK_MODES:
                outcome = await _sqlstate(connection, f"LOCK TABLE {table} IN {mode} MODE NOWAIT")
                assert outcome in (None, INSUFFICIENT_PRIVILEGE), (table, mode, outcome)
                if outcome is None:
                    granted.setdefault(table, []).append(mode)
        assert {mode for modes in granted.values() for mode in modes} <= HARMLESS_LOCK_MODES
        assert "ROW EXCLUSIVE" in granted["wal_events"]  # Control: INSERT allows it.
        held = connection.transaction()
        await held.start()
        for table, modes in granted.items():
            await connection.execute(f"LOCK TABLE {table} IN {modes[-1]} MODE")
        await connection.execute("SELECT * FROM wal_tasks FOR UPDATE")  # B's own rows only.
        try:
            assert await _rows_of_a(tenant_roles.admin_dsn) == before
            await _a_still_works(a)
        finally:
            await held.rollback()
    finally:
        await connection.close()


ADVISORY_CALLS = [
    "SELECT pg_advisory_lock(hashtext('wal_engine.schema'))",
    "SELECT pg_advisory_xact_lock(hashtext('wal_engine.schema'))",
    "SELECT pg_try_advisory_lock(hashtext('wal_engine.schema'))",
    "SELECT pg_advisory_lock_shared(1)",
    "SELECT pg_advisory_lock(1, 2)",
    "SELECT pg_try_advisory_xact_lock_shared(1, 2)",
    "SELECT pg_advisory_unlock_all()",
]


async def test_s12_advisory_locks_are_the_owners_and_connect_takes_none(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """S12: B's role may take no advisory lock (the schema lock included): 42501. A
    tenant's connect(migrate=True) takes no schema lock either, so even the owner holding it
    delays no engine start."""
    connection = await asyncpg.connect(await tenant_roles.dsn(TENANT_B))
    try:
        for call in ADVISORY_CALLS:
            assert await _sqlstate(connection, call) == INSUFFICIENT_PRIVILEGE, call
    finally:
        await connection.close()
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        async with admin.transaction():
            await admin.execute(queries.SCHEMA_LOCK)
            engine = await asyncio.wait_for(_engine(tenant_roles, TENANT_A, migrate=True),
                                            deadline_s / 3)
            try:
                await _a_still_works(engine)
            finally:
                await engine.close()
    finally:
        await admin.close()


async def test_forged_rows_in_the_own_log_are_named_by_verify(
        tenants: tuple[Engine, Engine], tenant_roles: TenantRoles) -> None:
    """A direct INSERT into B's own log (INSERT is granted) reaches only B's tenant and is
    named by verify; nothing of A's changes."""
    a, b = tenants
    before = await _rows_of_a(tenant_roles.admin_dsn)
    await b.submit("echo", None, task_id="b-task")
    connection = await asyncpg.connect(await tenant_roles.dsn(TENANT_B),
                                       server_settings={"wal.tenant": TENANT_B})
    try:
        await connection.execute(
            "INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, hash)"
            " VALUES ('b-task', 2, 'task_completed', 1, 0, '\\x7b7d', '\\x00')")
    finally:
        await connection.close()
    report = await b.store.verify_task("b-task")
    assert report.violation is not None and report.violation.seq == 2
    assert await _rows_of_a(tenant_roles.admin_dsn) == before
    assert (await a.store.verify_task("a-task")).ok


async def test_roles_mapped_to_no_tenant_or_another_are_refused(
        tenant_roles: TenantRoles) -> None:
    """connect() as a runtime role mapped to no tenant, or as A's role asking for B, is
    refused with a clear error (TenantRoleRefused), before any pool is opened."""
    with pytest.raises(TenantRoleRefused, match="not the login role of a tenant"):
        await connect(await tenant_roles.stray_dsn(), migrate=False, development=False)
    with pytest.raises(TenantRoleRefused, match="tenant-a"):
        await connect(await tenant_roles.dsn(TENANT_A), migrate=False, development=False,
                      tenant=TENANT_B)


async def test_disable_enable_and_list_tenants(tenant_roles: TenantRoles) -> None:
    """Disabling a tenant ends its sessions and logins (an open session sees nothing from
    its next statement); enabling restores them; list shows roles, state and sessions;
    creating a tenant twice is refused."""
    a = await _engine(tenant_roles, TENANT_A)
    try:
        await a.submit("echo", None, task_id="kept")
    finally:
        await a.close()
    a_dsn = await tenant_roles.dsn(TENANT_A)
    survivor = await asyncpg.connect(a_dsn, server_settings={"wal.tenant": TENANT_A})
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        assert await survivor.fetchval("SELECT count(*) FROM wal_tasks") == 1
        with pytest.raises(TenantExists):
            await create_tenant(admin, TENANT_A, dsn=tenant_roles.admin_dsn)
        assert await disable_tenant(admin, TENANT_A) == 1
        listed = {t.tenant: t for t in await list_tenants(admin)}
        assert (listed[TENANT_A].enabled, listed[TENANT_A].can_login) == (False, False)
        with pytest.raises(DatabaseUnavailable):
            await connect(a_dsn, migrate=False, development=False)
        await enable_tenant(admin, TENANT_A)
        engine = await connect(a_dsn, migrate=False, development=False)
        try:
            assert [t.task_id for t in await engine.store.list_tasks()] == ["kept"]
        finally:
            await engine.close()
        with pytest.raises(InvalidInput):
            await create_tenant(admin, "short-password", dsn=tenant_roles.admin_dsn,
                                password="short")
    finally:
        await admin.close()
        if not survivor.is_closed():
            survivor.terminate()


def _require_scram(data_dir: Path) -> None:
    """The server's pg_hba.conf: the superuser by trust, every other role by SCRAM."""
    hba = data_dir / "pg_hba.conf"
    hba.write_text("local all all trust\n"
                   "host all postgres 127.0.0.1/32 trust\n"
                   "host all all 127.0.0.1/32 scram-sha-256\n")


async def test_tenant_passwords_are_scram_verifiers_that_log_in() -> None:
    """On a server requiring SCRAM: the role created with a generated password logs in with
    it and only it; the server stores a SCRAM verifier (never the password); rotating
    replaces it."""
    server = start_embedded_server()
    try:
        assert server.data_dir is not None
        _require_scram(server.data_dir)
        admin = await asyncpg.connect(server.admin_dsn)
        try:
            await admin.execute("SELECT pg_reload_conf()")
            await admin.execute("CREATE DATABASE scram_check")
        finally:
            await admin.close()
        dsn = server.dsn("scram_check")
        await secure(dsn)
        admin = await asyncpg.connect(dsn)
        try:
            credentials = await create_tenant(admin, "scram-tenant", dsn=dsn)
            stored = await admin.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = $1",
                                          credentials.role)
            assert stored.startswith("SCRAM-SHA-256$4096:")
            assert credentials.password not in stored
            engine = await connect(credentials.dsn, migrate=False, development=False)
            await engine.close()
            wrong = credentials.dsn.replace(credentials.password, "x" * 20)
            with pytest.raises(DatabaseUnavailable):
                await connect(wrong, migrate=False, development=False)
            rotated = await rotate_tenant(admin, "scram-tenant", dsn=dsn,
                                          password="a-given-password-1234")
            with pytest.raises(DatabaseUnavailable):
                await connect(credentials.dsn, migrate=False, development=False)
            engine = await connect(rotated.dsn, migrate=False, development=False)
            await engine.close()
        finally:
            await admin.close()
    finally:
        server.close()


def test_scram_verifier_matches_rfc_7677_shape() -> None:
    """The verifier is PostgreSQL's format: iterations, salt, StoredKey and ServerKey, each
    base64; the same salt and password give the same verifier."""
    verifier = scram_verifier("pencil-pencil-pencil", salt=b"0123456789abcdef")
    assert verifier == scram_verifier("pencil-pencil-pencil", salt=b"0123456789abcdef")
    method, rest = verifier.split("$", 1)
    assert method == "SCRAM-SHA-256" and rest.startswith("4096:MDEyMzQ1Njc4OWFiY2RlZg==$")
    assert verifier != scram_verifier("pencil-pencil-pencil")


def test_role_names_are_per_database_and_opaque() -> None:
    """The same tenant gets another role in another database; the name does not contain the
    tenant and fits PostgreSQL's 63-byte names."""
    first = tenant_role_name("db1", "acme")
    assert first != tenant_role_name("db2", "acme") != tenant_role_name("db1", "acme2")
    assert "acme" not in first and len(first) <= 63 and first.startswith("wal_")


async def _tenant_cli(*args: str, stdin: str | None = None) -> Result:
    """``wal-engine tenant ARGS`` through click's runner, in a thread (its own loop)."""
    saved = structlog.get_config()
    try:
        return await asyncio.to_thread(CliRunner().invoke, main, ["tenant", *args],
                                       input=stdin, catch_exceptions=False)
    finally:
        logs.reset_logging()
        structlog.configure(**saved)


async def test_tenant_cli_creates_lists_rotates_and_disables(tenant_roles: TenantRoles) -> None:
    """`wal-engine tenant create` prints a working DSN once (generated or given password),
    `list` shows the role, `rotate` gives a new one, `disable` and `enable` switch logins;
    a bad password or a second create is one error line (exit 2)."""
    dsn = tenant_roles.admin_dsn
    created = await _tenant_cli("create", "cli-tenant", "--dsn", dsn, "--json")
    assert created.exit_code == 0, created.output
    (credentials,) = lines(created.stdout)
    tenant_roles.extra_roles.append(credentials["role"])
    engine = await connect(credentials["dsn"], migrate=False, development=False)
    try:
        assert engine.tenant == "cli-tenant"
    finally:
        await engine.close()
    given = await _tenant_cli("create", "cli-given", "--dsn", dsn, "--password-stdin",
                              "--json", stdin="a-given-password-123\n")
    assert given.exit_code == 0, given.output
    tenant_roles.extra_roles.append(lines(given.stdout)[0]["role"])
    assert lines(given.stdout)[0]["password"] == "a-given-password-123"
    for refused in (await _tenant_cli("create", "cli-short", "--dsn", dsn, "--password-stdin",
                                      stdin="short\n"),
                    await _tenant_cli("create", "cli-tenant", "--dsn", dsn)):
        assert refused.exit_code == 2, refused.output
        assert one_error_line(refused)
    listed = {item["tenant"]: item for item in lines(
        (await _tenant_cli("list", "--dsn", dsn, "--json")).stdout)}
    assert listed["cli-tenant"]["role"] == credentials["role"]
    assert listed["cli-tenant"]["enabled"] is True
    rotated = await _tenant_cli("rotate", "cli-tenant", "--dsn", dsn, "--json")
    assert rotated.exit_code == 0, rotated.output
    assert lines(rotated.stdout)[0]["password"] != credentials["password"]
    disabled = await _tenant_cli("disable", "cli-tenant", "--dsn", dsn, "--json")
    assert lines(disabled.stdout)[0]["enabled"] is False
    with pytest.raises(DatabaseUnavailable):
        await connect(credentials["dsn"], migrate=False, development=False)
    assert (await _tenant_cli("enable", "cli-tenant", "--dsn", dsn)).exit_code == 0
    unknown = await _tenant_cli("disable", "nobody", "--dsn", dsn)
    assert unknown.exit_code == 2 and "no role" in one_error_line(unknown)


async def test_a_tenant_role_of_one_database_gets_nothing_in_another(
        tenant_roles: TenantRoles, database_factory: Any) -> None:
    """Two engine databases on one server with the same owner and application group names
    (the defaults, cluster-wide): tenant A of the first database has a role of its own
    there, tenant A of the second another. The first's role reaches the second database
    (the group's CONNECT lets it in) but is mapped to nothing there: every read, function
    and write of the attack finds or changes nothing of the second's tenant A, whatever
    tenant it names, its engine refuses to start, and the second's engine keeps working."""
    other_dsn = await database_factory.create()
    try:
        await secure(other_dsn)
        other = TenantRoles(other_dsn)
        a_other = await _engine(other, TENANT_A)
        try:
            await _populate_a(a_other, other_dsn)
            before = await _rows_of_a(other_dsn)
            first = await tenant_roles.create(TENANT_A)
            assert (await other.create(TENANT_A)).role != first.role
            other_database = other_dsn.rsplit("/", 1)[-1].split("?", 1)[0]
            intruder_dsn = with_database(first.dsn, other_database)
            with pytest.raises(TenantRoleRefused, match="not the login role of a tenant"):
                await connect(intruder_dsn, migrate=False, development=False)
            outcomes: dict[str, dict[str, Any]] = {}
            for named in (None, TENANT_A):
                settings = {} if named is None else {"wal.tenant": named}
                connection = await asyncpg.connect(intruder_dsn, server_settings=settings)
                try:
                    assert await connection.fetchval("SELECT current_database()") == \
                        other_database
                    outcomes[str(named)] = _unexpected(await _attack_as_b(connection))
                finally:
                    await connection.close()
            assert outcomes == {"None": {}, TENANT_A: {}}
            assert await _rows_of_a(other_dsn) == before
            await _a_still_works(a_other)
        finally:
            await a_other.close()
            await other.close()
    finally:
        await database_factory.drop(other_dsn)
