"""The gateway store suite on PostgreSQL (``wal_idempotency``)."""

from __future__ import annotations

import pytest_asyncio

from tests.integration.gateway_store_suite import GatewayStoreSuite
from wal_engine.effects.gateway import PostgresGatewayStore
from wal_engine.store import Database


class TestPostgresGatewayStore(GatewayStoreSuite):
    """Every store rule on the PostgreSQL store."""

    @pytest_asyncio.fixture
    async def gateway_store(self, database: Database) -> PostgresGatewayStore:
        """The PostgreSQL store on the test's fresh database."""
        return PostgresGatewayStore(database)
