"""Fault-test plumbing: worker subprocesses we start, kill, pause and resume ourselves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.fault import agents
from tests.fault.support import ledgered_engine
from wal_engine.engine import Engine, connect
from wal_engine.testing.processes import wait_until

REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """One worker subprocess and its output."""

    def __init__(self, dsn: str, worker_id: str, failpoint: str | None, concurrency: int,
                 env: dict[str, str], log_dir: Path) -> None:
        self.worker_id = worker_id
        environment = {**os.environ, **env}
        environment.pop("ENGINE_FAILPOINT", None)
        if failpoint:
            environment["ENGINE_FAILPOINT"] = failpoint
        self.log_path = log_dir / f"{worker_id}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fault.worker_main", dsn, worker_id, str(concurrency)],
            cwd=REPO, env=environment, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        """Everything the worker printed so far."""
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) if the process still runs."""
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def close(self) -> None:
        """Kill and reap the process."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=30)
        self._log.close()


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
        self.dsn = dsn
        self.log_dir = log_dir
        self.workers: list[WorkerProcess] = []
        self.env = {"FAULT_LEASE_TTL_MS": "1000", "FAULT_HEARTBEAT_MS": "250"}

    async def spawn(self, worker_id: str, *, failpoint: str | None = None,
                    concurrency: int = 4) -> WorkerProcess:
        """Start a worker and wait until it says it is ready."""
        worker = WorkerProcess(self.dsn, worker_id, failpoint, concurrency, self.env,
                               self.log_dir)
        self.workers.append(worker)
        await wait_for(lambda: "ready" in worker.output() or worker.process.poll() is not None,
                       f"{worker_id} to start")
        return worker

    async def effects(self) -> list[Any]:
        """Every row of fault_effects."""
        return await self.engine.database.fetch(
            "SELECT key, tool, deliveries, applied, owners FROM fault_effects ORDER BY key")

    async def assert_effects_once_and_intended(self) -> list[Any]:
        """I4 and I5: every key acted exactly once, and every key is a durable intent."""
        rows = await self.effects()
        assert rows, "no side effect happened at all"
        assert [r["key"] for r in rows if r["applied"] != 1] == []
        intents = {r["idempotency_key"] for r in await self.engine.database.fetch(
            "SELECT idempotency_key FROM wal_events WHERE idempotency_key IS NOT NULL")}
        assert {r["key"] for r in rows} <= intents
        return rows

    def close(self) -> None:
        """Kill every worker this harness started."""
        for worker in self.workers:
            worker.close()


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
# (the reliability suite: deep tier switch and the figures summary)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``deep`` run only with RELIABILITY_DEEP=1 (RELIABILITY.md budget)."""
    if item.get_closest_marker("deep") is not None and os.environ.get("RELIABILITY_DEEP") != "1":
        pytest.skip("deep reliability test: set RELIABILITY_DEEP=1 to run it")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print every fault test's figures line, so matrix coverage can be read off."""
    from tests.fault.support import FIGURES

    if FIGURES:
        terminalreporter.section("reliability figures (RELIABILITY.md matrix ids)")
        for line in FIGURES:
            terminalreporter.write_line(line)


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
