"""Tenant login roles for the security tests: provisioned on demand on a test database
(security.sql applied), dropped when the test ends.

Roles are cluster-wide and outlive the test's database, so :meth:`TenantRoles.close` ends
their sessions, drops what they were granted here and drops them.
"""

from __future__ import annotations

from typing import Any, Final

import asyncpg

from wal_engine.security.roles import APP_ROLE, dsn_for_role
from wal_engine.security.tenants import TenantCredentials, create_tenant
from wal_engine.store.setup import apply_security

STRAY_SUFFIX: Final = "_stray"

DROP_ROLE: Final = """
SELECT format('DROP OWNED BY %I', $1::text) AS owned, format('DROP ROLE %I', $1::text) AS role
"""


class TenantRoles:
    """The tenants' login roles of one test database."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.credentials: dict[str, TenantCredentials] = {}
        self.extra_roles: list[str] = []

    async def create(self, tenant: str) -> TenantCredentials:
        """``tenant``'s credentials, provisioning its role the first time."""
        if tenant not in self.credentials:
            admin = await asyncpg.connect(self.admin_dsn)
            try:
                self.credentials[tenant] = await create_tenant(admin, tenant,
                                                               dsn=self.admin_dsn)
            finally:
                await admin.close()
        return self.credentials[tenant]

    async def dsn(self, tenant: str) -> str:
        """The DSN logging in as ``tenant``'s role."""
        return (await self.create(tenant)).dsn

    async def stray_dsn(self) -> str:
        """A login role with the runtime's privileges (a member of the application group)
        that is mapped to no tenant."""
        admin = await asyncpg.connect(self.admin_dsn)
        try:
            database = await admin.fetchval("SELECT current_database()")
            role = f"{database}{STRAY_SUFFIX}"
            if role not in self.extra_roles:
                await admin.execute(f'CREATE ROLE "{role}" LOGIN IN ROLE {APP_ROLE}')
                self.extra_roles.append(role)
        finally:
            await admin.close()
        return dsn_for_role(self.admin_dsn, role)

    async def close(self) -> None:
        """End the roles' sessions and drop them."""
        roles = [c.role for c in self.credentials.values()] + self.extra_roles
        if not roles:
            return
        admin = await asyncpg.connect(self.admin_dsn)
        try:
            await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                " WHERE usename = ANY ($1::text[])", roles)
            for role in roles:
                statements = await admin.fetchrow(DROP_ROLE, role)
                await admin.execute(statements["owned"])
                await admin.execute(statements["role"])
        finally:
            await admin.close()


async def secure(dsn: str) -> None:
    """Apply security.sql (and the schema) to the database of ``dsn``, as a superuser."""
    admin = await asyncpg.connect(dsn)
    try:
        await apply_security(admin)
    finally:
        await admin.close()


async def sqlstate(connection: asyncpg.Connection, statement: str, *args: Any) -> str | None:
    """Run ``statement`` in a savepoint; its SQLSTATE, or None when it succeeded."""
    try:
        async with connection.transaction():
            await connection.execute(statement, *args)
    except asyncpg.PostgresError as error:
        return str(error.sqlstate)
    return None
