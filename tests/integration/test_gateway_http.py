"""``wal-engine gateway`` as a subprocess in front of a real counting upstream, on Redis and
on PostgreSQL: the Idempotency-Key draft's semantics, health, metrics, restart."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.gateway_support import GatewayProcess, Upstream, route
from tests.redis_support import fresh_tenant, redis_server, require_redis
from wal_engine.testing.postgres import DatabaseFactory
from wal_engine.testing.redis_server import RedisServer, free_port

__all__ = ["redis_server"]  # A fixture the gateway fixture uses.


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this module's processes write their output and configuration."""
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def upstream(log_dir: Path) -> Iterator[Upstream]:
    """The counting upstream API."""
    server = Upstream(log_dir)
    yield server
    server.close()


async def store_config(kind: str, request: pytest.FixtureRequest,
                       factory: DatabaseFactory) -> dict[str, Any]:
    """The ``[store]`` table for ``kind``: a fresh tenant on the session's Redis, or a fresh
    PostgreSQL database."""
    if kind == "redis":
        require_redis()
        server: RedisServer = request.getfixturevalue("redis_server")
        return {"kind": "redis", "url": server.url, "tenant": fresh_tenant("gw")}
    return {"kind": "postgres", "url": await factory.create(), "development": True}


@pytest_asyncio.fixture(scope="module", params=["redis", "postgres"])
async def gateway(request: pytest.FixtureRequest, upstream: Upstream, log_dir: Path,
                  database_factory: DatabaseFactory) -> AsyncIterator[GatewayProcess]:
    """One gateway per store kind, with a route of each policy."""
    store = await store_config(request.param, request, database_factory)
    routes = [
        route("pay", upstream, missing_key="refuse", timeout_s=5.0),
        route("wait", upstream, concurrent="wait", wait_s=10.0),
        route("open", upstream),
        route("scoped", upstream, scope_header="authorization"),
        route("slow", upstream, timeout_s=0.3),
        {"name": "dead", "prefix": "/dead", "upstream": f"http://127.0.0.1:{free_port()}"},
    ]
    process = GatewayProcess(store, routes, log_dir, key_chars_max=64).start()
    yield process
    process.close()


@pytest_asyncio.fixture
async def client(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on the gateway."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        yield http


def new_key() -> str:
    """A key no other test uses."""
    return str(uuid.uuid4())


def keyed(key: str, **headers: str) -> dict[str, str]:
    """Headers with ``key`` as the draft's quoted Idempotency-Key."""
    return {"idempotency-key": f'"{key}"', **headers}


async def test_repeat_replays_the_stored_response_without_reaching_upstream(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """Same key and body twice: one mutation, the second answer is the first's, replayed."""
    key = new_key()
    first = await client.post("/pay/charges", json={"amount": 5}, headers=keyed(key))
    second = await client.post("/pay/charges", json={"amount": 5}, headers=keyed(key))
    assert first.status_code == second.status_code == 201
    assert first.json() == second.json() and first.json()["mutation"] == 1
    assert second.headers["idempotent-replayed"] == "true"
    assert second.headers["x-upstream"] == "yes"
    assert "idempotent-replayed" not in first.headers
    assert upstream.count(f'"{key}"') == 1


async def test_same_key_with_another_body_is_422(client: httpx.AsyncClient,
                                                 upstream: Upstream) -> None:
    """Reusing a key for a different body is refused with 422 and does not reach upstream."""
    key = new_key()
    await client.post("/pay/charges", json={"amount": 5}, headers=keyed(key))
    other = await client.post("/pay/charges", json={"amount": 6}, headers=keyed(key))
    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert "different request" in other.json()["detail"]
    assert upstream.count(f'"{key}"') == 1


async def test_concurrent_repeat_is_409_and_another_body_in_flight_422(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """While the first request is in flight, its repeat gets 409 and a different body 422."""
    key = new_key()
    slow = {"x-delay-ms": "1500"}
    first = asyncio.create_task(client.post("/pay/c", json={"a": 1},
                                            headers=keyed(key, **slow)))
    await _until_received(upstream, f'"{key}"')
    repeat = await client.post("/pay/c", json={"a": 1}, headers=keyed(key, **slow))
    other = await client.post("/pay/c", json={"a": 2}, headers=keyed(key, **slow))
    assert (repeat.status_code, other.status_code) == (409, 422)
    assert repeat.headers["retry-after"] == "1"
    assert (await first).status_code == 201
    assert upstream.count(f'"{key}"') == 1


async def test_wait_route_holds_the_repeat_until_the_first_answers(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """On a route with concurrent = "wait", a repeat in flight gets the first's response."""
    key = new_key()
    headers = keyed(key, **{"x-delay-ms": "800"})
    first = asyncio.create_task(client.post("/wait/c", content=b"x", headers=headers))
    await _until_received(upstream, f'"{key}"')
    repeat = await client.post("/wait/c", content=b"x", headers=headers)
    assert repeat.status_code == 201 and repeat.headers["idempotent-replayed"] == "true"
    assert repeat.json() == (await first).json()
    assert upstream.count(f'"{key}"') == 1


async def test_missing_key_is_refused_or_passed_per_route(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """Without a key: 400 on a route that requires one, forwarded each time on another."""
    refused = await client.post("/pay/c", json={})
    assert refused.status_code == 400 and "requires an Idempotency-Key" in refused.text
    before = upstream.count("-")
    for _ in range(2):
        assert (await client.post("/open/c", json={})).status_code == 201
    assert upstream.count("-") == before + 2


@pytest.mark.parametrize("value", ['"unterminated', '"a" , "b"', "has space", '""',
                                   '"' + "k" * 65 + '"', '"tab\there"', "ключ"])
async def test_malformed_or_oversized_key_is_400_with_a_clear_body(
        client: httpx.AsyncClient, value: str) -> None:
    """A key that is not one quoted string or token, empty, or over 64 characters: 400."""
    response = await client.post("/pay/c", content=b"x",
                                 headers={"idempotency-key": value.encode()})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("Idempotency-Key ")


async def test_reads_and_bare_keys_and_scopes(client: httpx.AsyncClient,
                                              upstream: Upstream) -> None:
    """GET passes through; a bare-token key works; keys are scoped by the scope header."""
    assert (await client.get("/pay/thing")).json() == {"read": "/pay/thing"}
    key = new_key()
    bare = {"idempotency-key": key}
    await client.post("/open/c", content=b"1", headers=bare)
    assert (await client.post("/open/c", content=b"1", headers=bare)).headers[
        "idempotent-replayed"] == "true"
    for token in ("alice", "bob", "alice"):
        await client.post("/scoped/c", content=b"1",
                          headers={**keyed(key), "authorization": token})
    assert upstream.count(f'"{key}"') == 2


async def _raw_post(gateway: GatewayProcess, target: str, key: str) -> tuple[int, bytes]:
    """POST ``target`` exactly as written (an HTTP client would resolve its dot segments)."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {target} HTTP/1.1\r\nHost: {host}\r\nIdempotency-Key: \"{key}\""
                     "\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("target", ["/pay/../admin", "/pay/%2e%2e/admin", "/pay%2F..%2Fadmin",
                                    "/pay/./c", "/pay/c/.."])
async def test_dot_segments_cannot_leave_the_route_prefix(
        gateway: GatewayProcess, upstream: Upstream, target: str) -> None:
    """A path with a dot segment, encoded or not, is 400 and reaches no upstream (the
    /pay route forwarded /pay%2F..%2Fadmin to the upstream's /admin)."""
    key = new_key()
    status, body = await _raw_post(gateway, target, key)
    assert status == 400 and b"segments" in body
    assert upstream.count(f'"{key}"') == 0


async def test_an_encoded_question_mark_stays_in_the_path(
        gateway: GatewayProcess, upstream: Upstream) -> None:
    """A decoded %3F is sent encoded again: it does not become the upstream's query."""
    status, body = await _raw_post(gateway, "/pay/c%3Fadmin=1", new_key())
    assert status == 201
    assert json.loads(body)["path"] == "/pay/c%3Fadmin=1"  # As the upstream sees it.


async def test_health_and_metrics(client: httpx.AsyncClient) -> None:
    """Health reports the store; metrics count requests by route and outcome."""
    health = await client.get("/_gateway/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    key = new_key()
    for _ in range(2):
        await client.post("/pay/m", content=b"m", headers=keyed(key))
    metrics = (await client.get("/_gateway/metrics")).text
    assert 'wal_gateway_requests_total{outcome="replayed",route="pay"}' in metrics
    assert "wal_gateway_upstream_seconds_bucket" in metrics


async def test_stored_responses_survive_a_gateway_restart(
        gateway: GatewayProcess, upstream: Upstream) -> None:
    """Killed and restarted, the gateway still replays what it stored before."""
    key = new_key()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        first = await http.post("/pay/r", content=b"r", headers=keyed(key))
    gateway.restart()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        again = await http.post("/pay/r", content=b"r", headers=keyed(key))
    assert again.headers["idempotent-replayed"] == "true" and again.json() == first.json()
    assert upstream.count(f'"{key}"') == 1


async def test_unreachable_upstream_releases_the_key_a_timeout_settles_it(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """Connection refused: 502 and the key stays free (nothing was sent). A timeout: 504,
    recorded, since the upstream may have acted; the retry is not sent again."""
    key = new_key()
    for _ in range(2):
        refused = await client.post("/dead/c", content=b"x", headers=keyed(key))
        assert refused.status_code == 502 and "unreachable" in refused.json()["detail"]
    slow = keyed(key, **{"x-delay-ms": "1000"})
    assert (await client.post("/slow/c", content=b"x", headers=slow)).status_code == 504
    again = await client.post("/slow/c", content=b"x", headers=slow)
    assert again.status_code == 504 and "not resent" in again.json()["detail"]
    assert upstream.counters()["received"][f'"{key}"'] == 1


async def _until_received(upstream: Upstream, key: str, timeout_s: float = 10.0) -> None:
    """Wait until the upstream got a request under ``key``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (await asyncio.to_thread(upstream.counters))["received"].get(key):
        assert asyncio.get_running_loop().time() < deadline, "upstream never got the request"
        await asyncio.sleep(0.02)
