"""A statement PostgreSQL refuses for a reason the engine has no error of its own for (a
privilege an administrator revoked, here) reaches the caller of the public API as
:class:`~wal_engine.errors.DatabaseError` with its SQLSTATE, never as the driver's error,
and leaves the log as it was."""

from __future__ import annotations

from typing import Any

import asyncpg

from tests.integration.tenant_roles import TenantRoles
from wal_engine.engine import Engine
from wal_engine.errors import DatabaseError, WalError
from wal_engine.security.roles import APP_ROLE


async def _revoke(tenant_roles: TenantRoles, statement: str) -> None:
    admin = await asyncpg.connect(tenant_roles.admin_dsn)
    try:
        await admin.execute(statement)
    finally:
        await admin.close()


async def test_a_revoked_privilege_is_a_typed_error(app_engine: Engine,
                                                    tenant_roles: TenantRoles) -> None:
    @app_engine.agent("refusable")
    async def refusable(ctx: Any, args: Any) -> Any:
        return await ctx.wait_for_signal("go")

    task_id = await app_engine.submit("refusable", {"n": 1})
    before = await app_engine.history(task_id)
    await _revoke(tenant_roles,
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
