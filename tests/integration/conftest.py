"""Fixtures of the integration tests: tenants' login roles (tests/integration/tenant_roles.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.integration.tenant_roles import TenantRoles, secure


@pytest_asyncio.fixture
async def tenant_roles(database_dsn: str) -> AsyncIterator[TenantRoles]:
    """The test database with security.sql applied, and its tenants' roles on demand."""
    await secure(database_dsn)
    roles = TenantRoles(database_dsn)
    yield roles
    await roles.close()
