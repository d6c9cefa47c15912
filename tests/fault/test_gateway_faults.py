"""The gateway under crashes, all real processes: workers SIGKILLed between the upstream
acting and the result being recorded, the gateway SIGKILLed mid-request, Redis SIGKILLed.
In every run the upstream counts exactly one mutation per key."""

from __future__ import annotations

import asyncio
import random
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tests.gateway_support import REPO, GatewayProcess, Upstream, route
from tests.redis_support import fresh_tenant, require_redis
from wal_engine.engine import Engine, connect
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.testing.processes import WorkerPool, wait_until
from wal_engine.testing.redis_server import RedisServer


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Upstream]:
    """A counting upstream of the test's own."""
    server = Upstream(tmp_path)
    yield server
    server.close()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own (AOF, appendfsync always), which it may SIGKILL."""
    require_redis()
    server = RedisServer(persistence="aof", data_dir=tmp_path / "redis").start()
    yield server
    server.close()


@pytest_asyncio.fixture
async def engine(database_dsn: str) -> AsyncIterator[Engine]:
    """An engine on the test's database, to submit tasks and read their outcome."""
    opened = await connect(database_dsn, migrate=False)
    yield opened
    await opened.close()


def keyed(key: str, **headers: str) -> dict[str, str]:
    """Headers with ``key`` as the draft's quoted Idempotency-Key."""
    return {"idempotency-key": f'"{key}"', **headers}


async def finished(engine: Engine, task_ids: list[str], timeout_s: float = 60.0) -> None:
    """Wait until every task is terminal."""
    async def done() -> bool:
        heads = [await engine.head(task_id) for task_id in task_ids]
        return all(head.status in TERMINAL for head in heads)

    await wait_until(done, "the tasks to finish", timeout_s)


@pytest.mark.parametrize("kills", [2, pytest.param(12, id="deep", marks=pytest.mark.deep)])
@pytest.mark.parametrize("kind", ["redis", "postgres"])
async def test_worker_killed_after_the_upstream_acted_leaves_one_mutation(
        kind: str, kills: int, engine: Engine, database_dsn: str, upstream: Upstream,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A worker SIGKILLed after its HTTP tool reached the upstream but before the result was
    logged: the next worker retries under the same key and the gateway replays the response."""
    store = ({"kind": "redis", "url": request.getfixturevalue("redis").url,
              "tenant": fresh_tenant("w")} if kind == "redis"
             else {"kind": "postgres", "url": database_dsn, "development": True})
    gateway = GatewayProcess(store, [route("pay", upstream, missing_key="refuse")],
                             tmp_path).start()
    pool = WorkerPool(database_dsn, "tests.fault.gateway_agents:register", tmp_path, cwd=REPO,
                      lease_ttl_ms=1000, heartbeat_ms=250)
    try:
        task_ids = [await engine.submit("http_charges", {"url": f"{gateway.url}/pay/c",
                                                          "charges": 3}) for _ in range(kills)]
        for kill in range(kills):
            doomed = await pool.spawn(f"doomed{kill}", failpoint=(
                f"after_effect_before_result:{random.Random(kill).randint(1, 3)}:sigkill"))
            assert await doomed.exited() == -signal.SIGKILL
        await pool.spawn("survivor")
        await finished(engine, task_ids)
        for task_id in task_ids:
            state = await engine.state(task_id)
            assert state.status is Status.COMPLETED and state.output == [1, 1, 1], state
        counts = upstream.counters()["counts"]
        assert len(counts) == 3 * kills and set(counts.values()) == {1}, counts
        assert replayed(gateway) >= kills  # Each killed call's retry was a replay.
    finally:
        pool.close()
        gateway.close()


def replayed(gateway: GatewayProcess) -> float:
    """How many requests the gateway answered from its store."""
    metrics = httpx.get(f"{gateway.url}/_gateway/metrics", timeout=5).text
    line = 'wal_gateway_requests_total{outcome="replayed",route="pay"} '
    values = [float(row[len(line):]) for row in metrics.splitlines() if row.startswith(line)]
    return values[0] if values else 0.0


async def test_gateway_killed_mid_request_never_resends_it(
        redis: RedisServer, upstream: Upstream, tmp_path: Path) -> None:
    """The gateway SIGKILLed while the upstream works on a request: after its restart the
    retry is 409 inside the claim's lease, then in doubt (502) and never forwarded again."""
    gateway = GatewayProcess({"kind": "redis", "url": redis.url, "tenant": fresh_tenant("k")},
                             [route("pay", upstream, timeout_s=1.5, lease_s=2.0)],
                             tmp_path).start()
    key = str(uuid.uuid4())
    headers = keyed(key, **{"x-delay-ms": "600"})
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            lost = asyncio.create_task(http.post("/pay/c", content=b"x", headers=headers))
            await wait_until(lambda: upstream.counters()["received"].get(f'"{key}"'),
                             "the upstream to get the request")
            gateway.kill()
            with pytest.raises(httpx.HTTPError):
                await lost
        gateway.start()
        answers = await _retry_until_settled(gateway, headers)
        assert set(answers[:-1]) <= {409} and answers[-1] == 502, answers
        await wait_until(lambda: upstream.count(f'"{key}"') == 1, "the upstream to finish")
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            again = await http.post("/pay/c", content=b"x", headers=headers)
        assert again.status_code == 502 and "not sent again" in again.json()["detail"]
        assert upstream.counters()["received"][f'"{key}"'] == 1
    finally:
        gateway.close()


async def _retry_until_settled(gateway: GatewayProcess, headers: dict[str, str]) -> list[int]:
    """Retry the request until it is no longer 409; every status seen."""
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for _ in range(200):
            statuses.append((await http.post("/pay/c", content=b"x", headers=headers))
                            .status_code)
            if statuses[-1] != 409:
                return statuses
            await asyncio.sleep(0.05)
    raise AssertionError(f"still 409 after 200 retries: {statuses[-5:]}")


async def test_redis_killed_mid_run_loses_no_recorded_response(
        redis: RedisServer, upstream: Upstream, tmp_path: Path) -> None:
    """Redis (AOF, appendfsync always) SIGKILLed between requests and during one: while it
    is down nothing is forwarded (503); after its restart every stored response replays, and
    the request it died under is never resent."""
    gateway = GatewayProcess({"kind": "redis", "url": redis.url, "tenant": fresh_tenant("r")},
                             [route("pay", upstream, timeout_s=1.5, lease_s=2.0)],
                             tmp_path).start()
    keys = [str(uuid.uuid4()) for _ in range(20)]
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            first = {key: (await http.post("/pay/c", content=key.encode(),
                                           headers=keyed(key))).json() for key in keys}
            redis.kill()
            down = await http.post("/pay/c", content=b"d", headers=keyed("during-outage"))
            assert down.status_code == 503
            assert (await http.get("/_gateway/health")).status_code == 503
            redis.start()
            for key in keys:
                replay = await http.post("/pay/c", content=key.encode(), headers=keyed(key))
                assert replay.headers["idempotent-replayed"] == "true"
                assert replay.json() == first[key]
            await _redis_dies_under_a_request(http, redis, upstream)
        counts = upstream.counters()["counts"]
        assert "\"during-outage\"" not in counts
        assert set(counts.values()) == {1} and len(counts) == 21, counts
    finally:
        gateway.close()


async def _redis_dies_under_a_request(http: httpx.AsyncClient, redis: RedisServer,
                                      upstream: Upstream) -> None:
    """Redis killed while the upstream acts: the client still gets the upstream's answer;
    the key, claimed durably, is in doubt after Redis returns, never resent."""
    key = str(uuid.uuid4())
    headers = keyed(key, **{"x-delay-ms": "500"})
    pending = asyncio.create_task(http.post("/pay/c", content=b"m", headers=headers))
    await wait_until(lambda: upstream.counters()["received"].get(f'"{key}"'),
                     "the upstream to get the request")
    redis.kill()
    answered = await pending
    assert answered.status_code == 201 and answered.json()["mutation"] == 1
    redis.start()
    statuses: list[int] = []
    for _ in range(200):
        statuses.append((await http.post("/pay/c", content=b"m", headers=headers)).status_code)
        if statuses[-1] != 409:
            break
        await asyncio.sleep(0.05)
    assert statuses[-1] == 502, statuses
    assert upstream.counters()["received"][f'"{key}"'] == 1


