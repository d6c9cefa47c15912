"""Redis Sentinel failover (Debian's redis-server runs as a Sentinel with --sentinel): the
primary SIGKILLed, the replica promoted; outcomes acknowledged by a replica survive and
claims go on on the new primary."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway_support import GatewayProcess, Upstream, route
from tests.integration.gateway_store_suite import claim
from tests.redis_support import fresh_tenant, require_redis
from wal_engine.effects.gateway import Acquired, GatewayStoreUnavailable
from wal_engine.effects.redis_store import RedisGatewayStore
from wal_engine.testing.redis_server import (
    SENTINEL_MASTER,
    SentinelGroup,
    start_sentinel_group,
)

failover_timeout_s = 30.0


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    """A primary, its replica and a Sentinel, all of this test's own."""
    require_redis()
    started = start_sentinel_group(down_after_ms=500)
    yield started
    started.close()


async def _when_available(operation: object, timeout_s: float = failover_timeout_s) -> object:
    """Run ``operation()`` until the store answers (it is unavailable during the failover)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await operation()  # type: ignore[operator]
        except GatewayStoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _fill_and_fail_over(group: SentinelGroup, store: RedisGatewayStore,
                              relaxed: RedisGatewayStore) -> None:
    """Record 30 outcomes through ``store`` (replicas_min=1), SIGKILL the primary, and wait
    (through ``relaxed``, replicas_min=0) until the promoted replica takes claims."""
    for index in range(30):
        assert await store.claim_key(claim("a", key=f"k{index}"), 60_000) is Acquired.NEW
        assert await store.complete_key(claim("a", key=f"k{index}"), "completed",
                                        str(index).encode(), None)
    group.primary.kill()
    assert await _when_available(lambda: relaxed.claim_key(
        claim("b", key="after"), 60_000)) is Acquired.NEW


def _stores(group: SentinelGroup) -> tuple[RedisGatewayStore, RedisGatewayStore]:
    tenant = fresh_tenant("sentinel")
    return (RedisGatewayStore.from_sentinel(group.sentinels, SENTINEL_MASTER, tenant=tenant,
                                            replicas_min=1),
            RedisGatewayStore.from_sentinel(group.sentinels, SENTINEL_MASTER, tenant=tenant))


async def test_failover_keeps_replica_acknowledged_outcomes(group: SentinelGroup) -> None:
    """With replicas_min=1 every acknowledged outcome is on the replica, so after the
    primary is SIGKILLed and the replica promoted, all of them are read back and a settled
    key is not claimed again; with no replica left such a store refuses to confirm writes
    (fail closed)."""
    store, relaxed = _stores(group)
    try:
        await _fill_and_fail_over(group, store, relaxed)
        records = [await relaxed.read_key(f"k{index}") for index in range(30)]
        assert [r.result if r else None for r in records] == [str(i).encode()
                                                              for i in range(30)]
        assert await relaxed.claim_key(claim("b", 9, key="k0"), 60_000) is Acquired.HELD
        with pytest.raises(GatewayStoreUnavailable, match="replicas acknowledged"):
            await store.claim_key(claim("c", key="unconfirmed"), 60_000)
    finally:
        await store.close()
        await relaxed.close()


async def test_an_unconfirmed_new_claim_is_given_back(group: SentinelGroup) -> None:
    """With no replica to confirm it, a claim on a free key is refused and the key is
    freed again (it would otherwise look in doubt once its lease ends)."""
    store, relaxed = _stores(group)
    try:
        group.replica.kill()
        with pytest.raises(GatewayStoreUnavailable, match="replicas acknowledged"):
            await store.claim_key(claim("a", key="lonely"), 60_000)
        assert await relaxed.read_key("lonely") is None
    finally:
        await store.close()
        await relaxed.close()


async def test_gateway_on_sentinel_replays_every_response_after_failover(
        group: SentinelGroup, tmp_path: Path) -> None:
    """``wal-engine gateway`` on Sentinels (replicas_min = 1): 10 responses stored, the
    primary SIGKILLed; once the replica is promoted every repeat is replayed from it, and
    the upstream counts one mutation per key."""
    upstream = Upstream(tmp_path)
    gateway = GatewayProcess(
        {"kind": "redis", "sentinels": [f"{host}:{port}" for host, port in group.sentinels],
         "service_name": SENTINEL_MASTER, "replicas_min": 1,
         "tenant": fresh_tenant("gwsentinel")},
        [route("pay", upstream, missing_key="refuse")], tmp_path).start()
    keys = [str(uuid.uuid4()) for _ in range(10)]
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            first = {}
            for key in keys:
                answer = await http.post("/pay/c", content=key.encode(),
                                         headers={"idempotency-key": f'"{key}"'})
                assert answer.status_code == 201, answer.text
                first[key] = answer.json()
            group.primary.kill()
            deadline = time.monotonic() + failover_timeout_s
            for key in keys:
                while True:
                    replay = await http.post("/pay/c", content=key.encode(),
                                             headers={"idempotency-key": f'"{key}"'})
                    if replay.status_code != 503 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)  # Polls the failover, bounded by the deadline.
                assert replay.headers.get("idempotent-replayed") == "true", replay.text
                assert replay.json() == first[key]
        assert {upstream.count(f'"{key}"') for key in keys} == {1}
    finally:
        gateway.close()
        upstream.close()
