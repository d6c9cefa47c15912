"""Fixtures of the integration tests: tenants' login roles (tests/integration/tenant_roles.py)
and an engine logged in as one of them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.integration.tenant_roles import TenantRoles, secure
from wal_engine.engine import Engine, connect


@pytest_asyncio.fixture
async def tenant_roles(database_dsn: str) -> AsyncIterator[TenantRoles]:
    """The test database with security.sql applied, and its tenants' roles on demand."""
    await secure(database_dsn)
    roles = TenantRoles(database_dsn)
    yield roles
    await roles.close()


@pytest_asyncio.fixture
async def app_dsn(tenant_roles: TenantRoles) -> str:
    """A DSN logging in as the default tenant's own runtime role (the application group
    holds the grants; docs/architecture.md decision 35). Modules may define their own."""
    return await tenant_roles.dsn("default")


@pytest_asyncio.fixture
async def app_engine(app_dsn: str) -> AsyncIterator[Engine]:
    """An engine connected as that runtime role, development checks off."""
    engine = await connect(app_dsn, migrate=False, pool_size_max=5, development=False)
    yield engine
    await engine.close()
