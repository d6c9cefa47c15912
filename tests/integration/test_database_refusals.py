"""A statement PostgreSQL refuses for a reason the engine has no error of its own for (a
privilege an administrator revoked, here) reaches the caller of the public API as
:class:`~wal_engine.errors.DatabaseError` with its SQLSTATE, never as the driver's error,
and leaves the log as it was."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
from structlog.testing import capture_logs

from tests.integration.tenant_roles import TenantRoles
from wal_engine.engine import Engine, connect
from wal_engine.errors import DatabaseError, TenantRoleRefused, WalError
from wal_engine.runtime.leases import LeaseKeeper
from wal_engine.security.roles import APP_ROLE
from wal_engine.store.connection import session_settings
from wal_engine.testing.processes import wait_until


async def _as_admin(tenant_roles: TenantRoles, statement: str) -> None:
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        await admin.execute(statement)
    finally:
        await admin.close()


async def _scalar(tenant_roles: TenantRoles, query: str) -> Any:
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        return await admin.fetchval(query)
    finally:
        await admin.close()


async def test_a_revoked_privilege_is_a_typed_error(app_engine: Engine,
                                                    tenant_roles: TenantRoles) -> None:
    @app_engine.agent("refusable")
    async def refusable(ctx: Any, args: Any) -> Any:
        return await ctx.wait_for_signal("go")

    task_id = await app_engine.submit("refusable", {"n": 1})
    before = await app_engine.history(task_id)
    await _as_admin(tenant_roles,
                  f"REVOKE EXECUTE ON FUNCTION wal_send_signal FROM {APP_ROLE}, PUBLIC")
    try:
        await app_engine.signal(task_id, "go", {"by": "test"})
    except WalError as error:
        refused: WalError = error
    else:
        raise AssertionError("the signal was sent without the privilege")
    assert isinstance(refused, DatabaseError), repr(refused)
    assert refused.sqlstate == "42501" and "wal_send_signal" in str(refused)
    assert isinstance(refused.__cause__, asyncpg.PostgresError)
    assert await app_engine.history(task_id) == before


async def test_the_lease_keeper_waits_out_a_refused_session(tenant_roles: TenantRoles) -> None:
    """The lease keeper's own session refused by a SQLSTATE the engine has no error of its
    own for (CONNECT revoked: 42501, now DatabaseError, once the driver's error) is waited
    out like an outage: the keeper's thread lives on and renews once the privilege is back
    (a thread that died there would leave every lease to lapse)."""
    dsn = await tenant_roles.dsn("default")
    role = tenant_roles.credentials["default"].role
    database = '"{}"'.format(await _scalar(tenant_roles, "SELECT current_database()"))
    grantees = f'"{role}", {APP_ROLE}'
    await _as_admin(tenant_roles, f"REVOKE CONNECT ON DATABASE {database} FROM {grantees}, PUBLIC")
    lost: list[tuple[str, int]] = []
    with capture_logs() as logs:
        keeper = LeaseKeeper(dsn=dsn, session_settings=session_settings(
                                 "default", "wal-engine:refused:heartbeat"),
                             lease_ttl_ms=30_000, heartbeat_ms=100, stall_warn_ms=10_000,
                             stall_abandon_ms=20_000,
                             on_lost=lambda task_id, epoch: lost.append((task_id, epoch)),
                             worker_id="refused")
        keeper.hold("no-such-task", 1, time.monotonic())
        keeper.start()

        def alive() -> bool:
            return keeper._thread is not None and keeper._thread.is_alive()

        try:
            await wait_until(lambda: not alive() or any(
                entry["event"] == "worker_connect_failed" and "42501" in entry["error"]
                for entry in logs), "a refused reconnect")
            assert alive(), f"the keeper's thread ended on the refusal: {logs}"
            refusals = [entry["error"] for entry in logs
                        if entry["event"] == "worker_connect_failed"]
            assert all(error.startswith("DatabaseError(") for error in refusals), refusals
            await _as_admin(tenant_roles, f"GRANT CONNECT ON DATABASE {database} TO {grantees}")
            # The renewal reaches the database, which says the lease is not the worker's.
            await wait_until(lambda: bool(lost), "a renewal on the reopened session")
            assert alive()
        finally:
            keeper.stop()
    assert set(lost) == {("no-such-task", 1)}
    assert keeper.renewals >= 1


async def test_the_worker_waits_out_a_refused_claim(app_engine: Engine,
                                                    tenant_roles: TenantRoles) -> None:
    """The worker's claim statement refused (EXECUTE on wal_claim_tasks revoked: 42501,
    DatabaseError) is logged and left to the next poll: the worker lives on and claims
    the task once the privilege is back."""
    @app_engine.agent("claimable")
    async def claimable(ctx: Any, args: Any) -> Any:
        return {"done": args["n"]}

    task_id = await app_engine.submit("claimable", {"n": 1})
    claim = "wal_claim_tasks(text, integer, bigint, text[], text[], text[], integer[])"
    await _as_admin(tenant_roles, f"REVOKE EXECUTE ON FUNCTION {claim} FROM {APP_ROLE}, PUBLIC")
    with capture_logs() as logs:
        worker = app_engine.worker(concurrency=1, poll_ms=50)
        running = asyncio.create_task(worker.run())
        try:
            await wait_until(lambda: running.done() or any(
                entry["event"] == "worker_statement_failed" and "42501" in entry["error"]
                for entry in logs), "a refused claim", 20)
            assert not running.done(), running
            refusals = [entry["error"] for entry in logs
                        if entry["event"] == "worker_statement_failed"]
            assert all(error.startswith("DatabaseError(") for error in refusals), refusals
            assert str((await app_engine.head(task_id)).status) == "QUEUED"
            await _as_admin(tenant_roles, f"GRANT EXECUTE ON FUNCTION {claim} TO {APP_ROLE}")
            assert (await app_engine.wait(task_id, timeout_s=20)).output == {"done": 1}
        finally:
            worker.stop()
            await running


async def test_connect_refused_during_its_checks_is_a_typed_error(
        app_dsn: str, tenant_roles: TenantRoles) -> None:
    """``connect`` reads the schema version on its first session: refused there (SELECT on
    wal_schema_version revoked), it raises TenantRoleRefused naming the missing privilege
    and the command that grants it, not the driver's error."""
    await _as_admin(tenant_roles, f"REVOKE SELECT ON wal_schema_version FROM {APP_ROLE}, PUBLIC")
    try:
        engine = await connect(app_dsn, migrate=False, development=False)
    except WalError as error:
        refused: WalError = error
    else:
        await engine.close()
        raise AssertionError("connected without reading the schema version")
    assert isinstance(refused, TenantRoleRefused), repr(refused)
    assert "wal_schema_version" in str(refused) and "wal-engine setup" in str(refused)
