"""wal-engine's fixtures for LangGraph's own test suite (not collected from our tree).

``run_langgraph_suites.py`` copies this file over ``tests/conftest.py`` of the unpacked
``langgraph`` sdist. It gives the fixtures LangGraph's tests ask for, with the checkpointers
``memory`` (LangGraph's ``MemorySaverAssertImmutable``), ``postgres`` (``PostgresSaver`` /
``AsyncPostgresSaver`` on psycopg) and ``wal_engine`` (``WalCheckpointSaver.from_dsn``), each
on a fresh database of the server named by ``WAL_UPSTREAM_ADMIN_DSN``. The caches and stores
are the in-memory ones (the suite's Redis, SQLite and Postgres variants need services or
packages this run does not set up, and no checkpointer test depends on them).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from uuid import UUID

import psycopg
import pytest
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.store.memory import InMemoryStore

from tests.memory_assert import MemorySaverAssertImmutable
from wal_engine.dsn import with_database
from wal_engine.integrations.langgraph import WalCheckpointSaver

pytest.register_assert_rewrite("tests.memory_assert")

ADMIN_DSN = os.environ["WAL_UPSTREAM_ADMIN_DSN"]
STRICT = os.environ.get("LANGGRAPH_STRICT_MSGPACK", "false").lower() in ("1", "true", "yes")
"""LangGraph's strict msgpack mode: LangGraph's fixtures then give their savers
``JsonPlusSerializer(allowed_msgpack_modules=None)``; wal-engine's saver keeps its default,
which follows the same setting (the behaviour under test)."""
SAVERS = os.environ.get("WAL_UPSTREAM_SAVERS", "memory,postgres,wal_engine").split(",")
_names = itertools.count(1)


def _fresh_database() -> str:
    """A new empty database (named from a counter: tests patch ``uuid.uuid4``)."""
    name = f"upstream_{os.getpid()}_{next(_names)}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return with_database(ADMIN_DSN, name)


def _drop_database(dsn: str) -> None:
    name = dsn.rsplit("/", 1)[-1].split("?", 1)[0]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def _wal_engine_sync() -> Iterator[WalCheckpointSaver]:
    """The saver on a loop of its own thread, so its sync bridges serve sync graphs."""
    dsn = _fresh_database()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    manager = WalCheckpointSaver.from_dsn(dsn)
    try:
        saver = asyncio.run_coroutine_threadsafe(manager.__aenter__(), loop).result(120)
        try:
            yield saver
        finally:
            asyncio.run_coroutine_threadsafe(
                manager.__aexit__(None, None, None), loop).result(120)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
        _drop_database(dsn)


@contextmanager
def _postgres_sync() -> Iterator[PostgresSaver]:
    dsn = _fresh_database()
    try:
        with PostgresSaver.from_conn_string(dsn) as saver:
            saver.setup()
            yield saver
    finally:
        _drop_database(dsn)


@asynccontextmanager
async def _wal_engine_async() -> AsyncIterator[WalCheckpointSaver]:
    dsn = _fresh_database()
    try:
        async with WalCheckpointSaver.from_dsn(dsn) as saver:
            yield saver
    finally:
        _drop_database(dsn)


@asynccontextmanager
async def _postgres_async() -> AsyncIterator[AsyncPostgresSaver]:
    dsn = _fresh_database()
    try:
        async with AsyncPostgresSaver.from_conn_string(dsn) as saver:
            await saver.setup()
            yield saver
    finally:
        _drop_database(dsn)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
def deterministic_uuids(mocker: Any) -> Any:
    """``uuid.uuid4`` patched to return 00000000-0000-4000-8000-<i> for i = 0, 1, ..."""
    side_effect = (UUID(f"00000000-0000-4000-8000-{i:012}", version=4) for i in range(10000))
    return mocker.patch("uuid.uuid4", side_effect=side_effect)


@pytest.fixture(params=["sync", "async", "exit"])
def durability(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(params=["memory"])
def cache(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield InMemoryCache()


@pytest.fixture(params=["in_memory"])
def sync_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield InMemoryStore()


@pytest.fixture(params=["in_memory"])
async def async_store(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    yield InMemoryStore()


def _strict(saver: Any) -> Any:
    if STRICT:
        saver.serde = JsonPlusSerializer(allowed_msgpack_modules=None)
    return saver


@pytest.fixture(params=SAVERS)
def sync_checkpointer(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "memory":
        yield _strict(MemorySaverAssertImmutable())
    elif request.param == "postgres":
        with _postgres_sync() as saver:
            yield _strict(saver)
    elif request.param == "wal_engine":
        with _wal_engine_sync() as saver:
            yield saver
    else:
        raise NotImplementedError(request.param)


@pytest.fixture(params=SAVERS)
async def async_checkpointer(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield _strict(MemorySaverAssertImmutable())
    elif request.param == "postgres":
        async with _postgres_async() as saver:
            yield _strict(saver)
    elif request.param == "wal_engine":
        async with _wal_engine_async() as saver:
            yield saver
    else:
        raise NotImplementedError(request.param)
