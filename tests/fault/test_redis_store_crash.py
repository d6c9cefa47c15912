"""Redis as it is run: SIGKILLed and restarted with AOF (appendfsync always) and without
persistence, under the store alone and under worker processes running ``ctx.tool``."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.gateway_support import REPO
from tests.integration.gateway_store_suite import claim
from tests.redis_support import fresh_tenant, require_redis
from wal_engine.effects.gateway import Acquired
from wal_engine.effects.redis_store import RedisGatewayStore
from wal_engine.engine import Engine, connect
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.testing.processes import WorkerPool, wait_until
from wal_engine.testing.redis_server import RedisServer


@pytest_asyncio.fixture
async def engine(database_dsn: str) -> AsyncIterator[Engine]:
    """An engine on the test's database."""
    opened = await connect(database_dsn, migrate=False)
    yield opened
    await opened.close()


def redis_server(tmp_path: Path, persistence: str) -> RedisServer:
    """A started Redis of the test's own."""
    require_redis()
    return RedisServer(persistence=persistence, data_dir=tmp_path / "redis").start()


async def record_outcomes(store: RedisGatewayStore, count: int) -> None:
    """Claim and complete ``count`` keys, and leave one more claimed."""
    for index in range(count):
        assert await store.claim_key(claim("a", key=f"k{index}"), 60_000) is Acquired.NEW
        assert await store.complete_key(claim("a", key=f"k{index}"), "completed",
                                        str(index).encode(), None)
    await store.claim_key(claim("a", key="held"), 60_000)


@pytest.mark.parametrize("persistence", ["aof", "none"])
async def test_sigkill_keeps_every_acknowledged_outcome_with_aof_and_none_without(
        tmp_path: Path, persistence: str) -> None:
    """SIGKILL and restart: with AOF always every acknowledged outcome and claim survives;
    without persistence the window of loss is everything, and the test sees exactly that."""
    server = redis_server(tmp_path, persistence)
    tenant = fresh_tenant("crash")
    try:
        store = RedisGatewayStore.from_url(server.url, tenant=tenant)
        await record_outcomes(store, 50)
        await store.close()
        server.restart()
        store = RedisGatewayStore.from_url(server.url, tenant=tenant)
        records = [await store.read_key(f"k{index}") for index in range(50)]
        held = await store.read_key("held")
        await store.close()
    finally:
        server.close()
    if persistence == "aof":
        assert [r.result if r else None for r in records] == [str(i).encode()
                                                              for i in range(50)]
        assert held is not None and held.state == "running"
    else:
        assert records == [None] * 50 and held is None


async def _run_with_redis_loss(engine: Engine, dsn: str, tmp_path: Path,
                               failpoint: str) -> dict[str, int]:
    """One task of three Redis-deduplicated tools; its worker SIGKILLed at ``failpoint``;
    Redis (no persistence) SIGKILLed and restarted empty; another worker finishes. Returns
    the acts per key."""
    server = redis_server(tmp_path, "none")
    pool = WorkerPool(dsn, "tests.fault.gateway_agents:register", tmp_path, cwd=REPO,
                      lease_ttl_ms=1000, heartbeat_ms=250)
    try:
        task_id = await engine.submit("redis_effects", {
            "redis": server.url, "tenant": fresh_tenant("loss"), "tools": 3})
        doomed = await pool.spawn("doomed", failpoint=failpoint)
        assert await doomed.exited() == -signal.SIGKILL
        server.restart()  # No persistence: every key Redis held is gone.
        await pool.spawn("survivor")

        async def done() -> bool:
            return (await engine.head(task_id)).status in TERMINAL

        await wait_until(done, "the task to finish", 60)
        state = await engine.state(task_id)
        assert state.status is Status.COMPLETED and state.output == 6
        rows = await engine.database.fetch("SELECT key, acts FROM gateway_acts ORDER BY key")
        return {row["key"]: row["acts"] for row in rows}
    finally:
        pool.close()
        server.close()


async def test_logged_results_are_not_acted_again_when_redis_loses_its_keys(
        engine: Engine, database_dsn: str, tmp_path: Path) -> None:
    """Results already in the engine's log come from the log on resume, so a Redis that lost
    every key after the worker's crash cannot cause a second act for them."""
    acts = await _run_with_redis_loss(engine, database_dsn, tmp_path,
                                      "after_result_commit:2:sigkill")
    assert len(acts) == 3 and set(acts.values()) == {1}, acts


async def test_the_window_of_loss_is_the_call_in_doubt(
        engine: Engine, database_dsn: str, tmp_path: Path) -> None:
    """The one call that acted but whose result was not yet logged when the worker died is
    acted again once Redis has lost its key (the documented window); the others are not."""
    acts = await _run_with_redis_loss(engine, database_dsn, tmp_path,
                                      "after_effect_before_result:2:sigkill")
    assert sorted(acts.values()) == [1, 1, 2], acts
