"""Redis fixtures: a real ``redis-server`` per session (AOF, ``appendfsync always``) on a
port of its own, and a store on a fresh tenant per test so tests never see each other's keys.

Import the fixtures into a test module (``from tests.redis_support import redis_server,
redis_store``); a module whose machine lacks ``redis-server`` is skipped, and says so.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from wal_engine.effects.redis_store import RedisGatewayStore
from wal_engine.testing.redis_server import RedisServer, RedisUnavailable, redis_binary

_tenants = itertools.count(1)


def require_redis() -> None:
    """Skip the calling test when Debian's ``redis-server`` is not installed."""
    try:
        redis_binary()
    except RedisUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's Redis: AOF with ``appendfsync always``, on a free port."""
    require_redis()
    server = RedisServer(persistence="aof").start()
    yield server
    server.close()


def fresh_tenant(prefix: str = "t") -> str:
    """A tenant name no other test of this session uses."""
    return f"{prefix}{next(_tenants)}"


@pytest_asyncio.fixture
async def redis_store(redis_server: RedisServer) -> AsyncIterator[RedisGatewayStore]:
    """A Redis gateway store on the session's server, on a tenant of its own."""
    store = RedisGatewayStore.from_url(redis_server.url, tenant=fresh_tenant())
    yield store
    await store.close()
