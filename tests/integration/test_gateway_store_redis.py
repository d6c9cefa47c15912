"""The gateway store suite on a real Redis server, plus what only Redis has (the TTL)."""

from __future__ import annotations

import asyncio

import pytest_asyncio

from tests.integration.gateway_store_suite import GatewayStoreSuite, claim
from tests.redis_support import fresh_tenant, redis_server, redis_store
from wal_engine.effects.gateway import Acquired
from wal_engine.effects.redis_store import RedisGatewayStore
from wal_engine.testing.redis_server import RedisServer

__all__ = ["redis_server", "redis_store"]  # Fixtures used by this module's tests.


class TestRedisGatewayStore(GatewayStoreSuite):
    """Every store rule on the Redis store."""

    @pytest_asyncio.fixture
    async def gateway_store(self, redis_store: RedisGatewayStore) -> RedisGatewayStore:
        """The Redis store on a tenant of its own."""
        return redis_store


async def test_redis_forgets_a_settled_key_after_its_retention(
        redis_server: RedisServer) -> None:
    """A settled key carries a Redis TTL of the retention, so Redis drops it on its own."""
    store = RedisGatewayStore.from_url(redis_server.url, tenant=fresh_tenant(),
                                       retention_ms=200)
    try:
        await store.claim_key(claim("a"), 60_000)
        await store.complete_key(claim("a"), "completed", b"r", None)
        ttl_ms = await store.client.pttl(store.entry("idem:t:3"))
        assert 0 < ttl_ms <= 200
        for _ in range(200):
            if await store.read_key("idem:t:3") is None:
                break
            await asyncio.sleep(0.02)
        assert await store.read_key("idem:t:3") is None
        assert await store.claim_key(claim("b"), 60_000) is Acquired.NEW
    finally:
        await store.close()


async def test_tenants_do_not_see_each_others_keys(redis_server: RedisServer) -> None:
    """The same key under two tenants is two keys."""
    first = RedisGatewayStore.from_url(redis_server.url, tenant=fresh_tenant("a"))
    second = RedisGatewayStore.from_url(redis_server.url, tenant=fresh_tenant("b"))
    try:
        assert await first.claim_key(claim("a"), 60_000) is Acquired.NEW
        assert await second.claim_key(claim("a"), 60_000) is Acquired.NEW
        assert await second.read_key("idem:t:3") is not None
    finally:
        await first.close()
        await second.close()
