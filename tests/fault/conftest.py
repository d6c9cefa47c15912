"""Fault-test plumbing: worker subprocesses we start, kill, pause and resume ourselves."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.fault import agents
from tests.fault.support import ledgered_engine
from wal_engine.engine import Engine, connect
from wal_engine.testing.processes import WorkerPool, WorkerProcess, wait_until

REPO = Path(__file__).resolve().parents[2]


wait_for = wait_until
"""The fault tests' name for :func:`wal_engine.testing.processes.wait_until`."""


@pytest_asyncio.fixture
async def ledgered(database_dsn: str) -> AsyncIterator[Engine]:
    """An engine with the ledgered agent registered and its ledger ready."""
    engine = await ledgered_engine(database_dsn)
    try:
        yield engine
    finally:
        await engine.close()


class FaultHarness:
    """Starts workers on the test's database and inspects the outcome."""

    def __init__(self, engine: Engine, dsn: str, log_dir: Path) -> None:
        self.engine = engine
        self.workers = WorkerPool(dsn, "tests.fault.agents:setup", log_dir, cwd=REPO,
                                  lease_ttl_ms=1000, heartbeat_ms=250)

    async def spawn(self, worker_id: str, *, failpoint: str | None = None,
                    concurrency: int = 4) -> WorkerProcess:
        """Start a worker (the library's crash-test worker with the fault agents, lease 1 s,
        heartbeat 250 ms) and wait until it says it is ready."""
        return await self.workers.spawn(worker_id, failpoint=failpoint,
                                        concurrency=concurrency)

    async def effects(self) -> list[Any]:
        """Every row of fault_effects."""
        return await self.engine.database.fetch(
            "SELECT key, tool, deliveries, applied, owners FROM fault_effects ORDER BY key")

    async def assert_effects_once_and_intended(self) -> list[Any]:
        """I4 and I5: every key acted exactly once, and every key is a durable intent."""
        rows = await self.effects()
        assert rows, "no side effect happened at all"
        assert [r["key"] for r in rows if r["applied"] != 1] == []
        # An intent's own key is derived from its task and seq, not stored (decision 71):
        # wal_event_key gives every event's key as the engine reads it.
        intents = {r["key"] for r in await self.engine.database.fetch(
            "SELECT wal_event_key(chain_version, type, task_id, seq, idempotency_key) AS key"
            "  FROM wal_events WHERE idempotency_key IS NOT NULL")} - {None}
        assert {r["key"] for r in rows} <= intents
        return rows

    def close(self) -> None:
        """Kill every worker this harness started."""
        self.workers.close()


@pytest.fixture
def fault_log_dir(tmp_path: Path) -> Iterator[Path]:
    """Where worker outputs go (printed on failure by the tests that need them)."""
    yield tmp_path


@pytest_asyncio.fixture
async def harness(database_dsn: str, fault_log_dir: Path) -> AsyncIterator[FaultHarness]:
    """A harness with an engine on the test's database and the fault agents registered."""
    engine = await connect(database_dsn, migrate=False)
    agents.register(engine)
    await agents.prepare(engine)
    fault = FaultHarness(engine, database_dsn, fault_log_dir)
    try:
        yield fault
    finally:
        fault.close()
        await engine.close()


# ----------------------------------------------------------------------------- additions
# (the reliability suite: deep tier switch; tests/conftest.py prints the figures summary)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``deep`` run only with RELIABILITY_DEEP=1 (RELIABILITY.md budget)."""
    if item.get_closest_marker("deep") is not None and os.environ.get("RELIABILITY_DEEP") != "1":
        pytest.skip("deep reliability test: set RELIABILITY_DEEP=1 to run it")


@pytest.fixture(scope="module")
def crashable() -> Iterator[tuple[Any, Any]]:
    """A PostgreSQL server of the test module's own, which its tests stop, crash and
    restart (never the session's server: a test stops only what it started)."""
    from wal_engine.testing.plugin import run_sync
    from wal_engine.testing.postgres import DatabaseFactory, start_embedded_server

    server = start_embedded_server(fsync=False)
    factory = DatabaseFactory(server)
    run_sync(factory.prepare())
    try:
        yield server, factory
    finally:
        server.close()
