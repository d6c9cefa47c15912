"""``wal-engine gateway`` used the ordinary wrong ways, all real processes: an upstream that
trickles its answer past the route's timeout, repeated response headers, a compressed
request body, non-ASCII header bytes, a rate-limited upstream, two gateways on one store."""

from __future__ import annotations

import asyncio
import gzip
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
from wal_engine.testing.redis_server import RedisServer

__all__ = ["redis_server"]  # A fixture the store fixture uses.


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this module's processes write their output and configuration."""
    return tmp_path_factory.mktemp("gateway-edges")


@pytest.fixture(scope="module")
def upstream(log_dir: Path) -> Iterator[Upstream]:
    """The counting upstream API."""
    server = Upstream(log_dir)
    yield server
    server.close()


@pytest_asyncio.fixture(scope="module", params=["redis", "postgres"])
async def store(request: pytest.FixtureRequest,
                database_factory: DatabaseFactory) -> dict[str, Any]:
    """The ``[store]`` table: a fresh tenant on the session's Redis, or a fresh database."""
    if request.param == "redis":
        require_redis()
        server: RedisServer = request.getfixturevalue("redis_server")
        return {"kind": "redis", "url": server.url, "tenant": fresh_tenant("edge")}
    return {"kind": "postgres", "url": await database_factory.create(), "development": True}


@pytest.fixture(scope="module")
def gateways(store: dict[str, Any], upstream: Upstream,
             log_dir: Path) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two gateway processes with the same routes on the same store."""
    routes = [route("pay", upstream, timeout_s=5.0),
              route("trickle", upstream, timeout_s=2.0, lease_s=3.0)]
    pair = (GatewayProcess(store, routes, log_dir).start(),
            GatewayProcess(store, routes, log_dir).start())
    yield pair
    for process in pair:
        process.close()


@pytest_asyncio.fixture
async def client(gateways: tuple[GatewayProcess, GatewayProcess]
                 ) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on the first gateway."""
    async with httpx.AsyncClient(base_url=gateways[0].url, timeout=30) as http:
        yield http


def keyed(key: str, **headers: str) -> dict[str, str]:
    """Headers with ``key`` as the draft's quoted Idempotency-Key."""
    return {"idempotency-key": f'"{key}"', **headers}


async def test_an_upstream_trickling_past_the_timeout_is_cut_and_in_doubt(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """timeout_s bounds the whole exchange, not each read: an upstream sending one byte
    every 50 ms (about 7 s for its answer) is cut at 2 s with 504, recorded, and the retry is
    not sent again. (It ran to the end, past the claim's lease, so a retry could take the
    live claim over.)"""
    key = str(uuid.uuid4())
    headers = keyed(key, **{"x-drip-ms": "50"})
    first = await client.post("/trickle/c", content=b"x", headers=headers)
    assert first.status_code == 504, first.text
    again = await client.post("/trickle/c", content=b"x", headers=headers)
    assert again.status_code == 504 and "not resent" in again.json()["detail"]
    assert upstream.counters()["received"][f'"{key}"'] == 1


async def test_repeated_response_headers_are_kept_apart(client: httpx.AsyncClient) -> None:
    """Two Set-Cookie lines reach the client as two lines, first time and replayed (they
    were joined into one with a comma, which breaks cookies whose Expires has one)."""
    headers = keyed(str(uuid.uuid4()), **{"x-cookies": "2"})
    first = await client.post("/pay/c", content=b"x", headers=headers)
    replayed = await client.post("/pay/c", content=b"x", headers=headers)
    cookies = [f"c{index}={index}; Expires=Wed, 21 Oct 2026 07:28:00 GMT" for index in (0, 1)]
    assert first.headers.get_list("set-cookie") == cookies
    assert replayed.headers.get_list("set-cookie") == cookies
    assert replayed.headers["idempotent-replayed"] == "true"


async def test_a_compressed_request_body_keeps_its_content_encoding(
        client: httpx.AsyncClient) -> None:
    """The body is forwarded as it came, so its Content-Encoding is too (it was dropped,
    and the upstream got gzip bytes it took for plain ones)."""
    response = await client.post("/pay/c", content=gzip.compress(b"hello"),
                                 headers=keyed(str(uuid.uuid4()), **{"content-encoding": "gzip"}))
    assert response.status_code == 201 and response.json()["content_encoding"] == "gzip"


async def test_non_ascii_header_bytes_pass_through_both_ways(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """A request header holding UTF-8 bytes is forwarded as those bytes (not a 500 after
    the key was claimed), and the request is stored and replayed like any other."""
    key = str(uuid.uuid4())
    headers = [("idempotency-key", f'"{key}"'), ("x-name", "ключ".encode())]
    first = await client.post("/pay/c", content=b"x", headers=headers)
    again = await client.post("/pay/c", content=b"x", headers=headers)
    assert first.status_code == again.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert upstream.count(f'"{key}"') == 1


async def test_a_rate_limited_answer_is_passed_on_and_not_stored(
        client: httpx.AsyncClient, upstream: Upstream) -> None:
    """429 (and 503) say the upstream did not act: the client gets it, the key is released,
    and the retry under the same key is forwarded (http_tool retries exactly these); the
    first answer that is not one of them is stored and replayed."""
    key = str(uuid.uuid4())
    for _ in range(2):
        limited = await client.post("/pay/c", content=b"x",
                                    headers=keyed(key, **{"x-status": "429"}))
        assert limited.status_code == 429 and "idempotent-replayed" not in limited.headers
    done = await client.post("/pay/c", content=b"x", headers=keyed(key))
    replayed = await client.post("/pay/c", content=b"x",
                                 headers=keyed(key, **{"x-status": "429"}))
    assert done.status_code == replayed.status_code == 201
    assert replayed.headers["idempotent-replayed"] == "true"
    assert upstream.counters()["received"][f'"{key}"'] == 3


async def test_two_gateways_on_one_store_forward_a_key_once(
        gateways: tuple[GatewayProcess, GatewayProcess], upstream: Upstream) -> None:
    """Sixteen concurrent repeats split between two gateway processes on one store: one is
    forwarded, the others get 409; afterwards both gateways replay it, and a different body
    under the key is 422 on either."""
    key = str(uuid.uuid4())
    headers = keyed(key, **{"x-delay-ms": "500"})
    async with httpx.AsyncClient(base_url=gateways[0].url, timeout=30) as one, \
            httpx.AsyncClient(base_url=gateways[1].url, timeout=30) as two:
        answers = await asyncio.gather(*(
            (one if index % 2 else two).post("/pay/c", content=b"x", headers=headers)
            for index in range(16)))
        assert sorted(answer.status_code for answer in answers) == [201] + [409] * 15
        for http in (one, two):
            replay = await http.post("/pay/c", content=b"x", headers=headers)
            assert replay.headers["idempotent-replayed"] == "true"
            assert (await http.post("/pay/c", content=b"y", headers=headers)).status_code == 422
    assert upstream.count(f'"{key}"') == 1
