"""The wal-engine pytest plugin: PostgreSQL, engines, ledgers and crash tools as fixtures.

Registered through the ``pytest11`` entry point ``wal_engine`` (or ``-p
wal_engine.testing.plugin``). Every fixture name starts with ``wal_`` so that none
shadows a fixture of your own:

=========================  ========  ====================================================
fixture                    scope     what it gives
=========================  ========  ====================================================
``wal_pg_server``          session   a :class:`~wal_engine.testing.postgres.TestServer`:
                                     ``WAL_ENGINE_TEST_DSN`` when set, else an embedded
                                     server in a temporary directory (stopped at the end)
``wal_database_factory``   session   fresh databases cloned from a template with the schema
``wal_database_dsn``       function  the DSN of a fresh database, dropped after the test
``wal_test_engine``        function  an :class:`~wal_engine.engine.Engine` on that database
                                     (async fixture, needs pytest-asyncio)
``wal_effect_ledger``      function  the engine's :class:`~wal_engine.testing.ledger.
                                     EffectLedger`, its table created
``wal_crash_machine``      function  ``run(AgentUnderTest(...), profile=None)``: runs the
                                     Hypothesis crash machine, returns its figures
``wal_worker_pool``        function  ``pool("pkg.module:register")``: a
                                     :class:`~wal_engine.testing.processes.WorkerPool` of
                                     worker subprocesses on the test's database
``wal_fault_seed``         function  the seed for randomised fault schedules
                                     (``--wal-fault-seed`` or ``WAL_ENGINE_FAULT_SEED``),
                                     printed so that a failure can be replayed
=========================  ========  ====================================================

The plugin also registers the marker ``deep`` (long reliability tests, skipped unless
``RELIABILITY_DEEP=1``) and the Hypothesis profiles ``crash-dev``, ``crash-ci`` and
``crash-deep``.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import pytest
import pytest_asyncio

from wal_engine.testing.postgres import DatabaseFactory, TestServer, start_test_server

if TYPE_CHECKING:
    from wal_engine.engine import Engine
    from wal_engine.testing.ledger import EffectLedger
    from wal_engine.testing.machine import AgentUnderTest, MachineStats
    from wal_engine.testing.processes import WorkerPool

T = TypeVar("T")

DEEP_ENV: Final = "RELIABILITY_DEEP"
SEED_ENV: Final = "WAL_ENGINE_FAULT_SEED"


def run_sync(work: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a private event loop (never the thread's current one)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(work)
    finally:
        loop.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--wal-fault-seed``: replay a randomised fault schedule."""
    parser.addoption("--wal-fault-seed", type=int, default=None,
                     help="seed of randomised fault schedules (printed by every fault test)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``deep`` marker and the crash profiles."""
    config.addinivalue_line(
        "markers", f"deep: long reliability tests, run only with {DEEP_ENV}=1")
    from wal_engine.testing.machine import register_profiles

    register_profiles()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip tests marked ``deep`` unless ``RELIABILITY_DEEP=1``."""
    if item.get_closest_marker("deep") is not None and os.environ.get(DEEP_ENV) != "1":
        pytest.skip(f"deep reliability test: set {DEEP_ENV}=1 to run it")


@pytest.fixture(scope="session")
def wal_pg_server() -> Iterator[TestServer]:
    """``WAL_ENGINE_TEST_DSN``, else an embedded PostgreSQL this session owns."""
    server = start_test_server()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def wal_database_factory(wal_pg_server: TestServer) -> Iterator[DatabaseFactory]:
    """Makes fresh databases from a template that holds the schema."""
    factory = DatabaseFactory(wal_pg_server)
    run_sync(factory.prepare())
    try:
        yield factory
    finally:
        run_sync(factory.drop_all())


@pytest.fixture
def wal_database_dsn(wal_database_factory: DatabaseFactory) -> Iterator[str]:
    """DSN of a fresh database with the schema applied, dropped after the test."""
    dsn = run_sync(wal_database_factory.create())
    try:
        yield dsn
    finally:
        run_sync(wal_database_factory.drop(dsn))


@pytest_asyncio.fixture
async def wal_test_engine(wal_database_dsn: str) -> AsyncIterator[Engine]:
    """An engine on the test's fresh database (closed after the test)."""
    from wal_engine.engine import connect

    engine = await connect(wal_database_dsn, migrate=False, pool_size_max=10)
    try:
        yield engine
    finally:
        await engine.close()


@pytest_asyncio.fixture
async def wal_effect_ledger(wal_test_engine: Engine) -> EffectLedger:
    """The side-effect ledger of :func:`wal_test_engine`, ready to use."""
    from wal_engine.testing.ledger import EffectLedger

    ledger = EffectLedger.for_engine(wal_test_engine)
    await ledger.prepare()
    return ledger


@pytest.fixture
def wal_crash_machine(wal_database_factory: DatabaseFactory
                      ) -> Callable[..., MachineStats]:
    """``run(AgentUnderTest(...), profile=None)``: the crash machine on fresh databases.

    Use it from a synchronous test: the machine runs its own event loop per program.
    """
    from wal_engine.testing.machine import run_crash_machine

    def run(config: AgentUnderTest, profile: str | None = None) -> MachineStats:
        stats = run_crash_machine(config, wal_database_factory, profile=profile)
        print(f"wal-engine crash machine: {stats}")
        return stats

    return run


@pytest.fixture
def wal_worker_pool(wal_database_dsn: str, tmp_path: Path
                    ) -> Iterator[Callable[..., WorkerPool]]:
    """``pool("pkg.module:register", **timings)``: worker subprocesses on the test's
    database, all killed after the test."""
    from wal_engine.testing.processes import WorkerPool

    pools: list[WorkerPool] = []

    def pool(register: str, **defaults: Any) -> WorkerPool:
        made = WorkerPool(wal_database_dsn, register, tmp_path, cwd=Path.cwd(), **defaults)
        pools.append(made)
        return made

    try:
        yield pool
    finally:
        for made in pools:
            made.close()


@pytest.fixture
def wal_fault_seed(request: pytest.FixtureRequest) -> int:
    """The seed of this test's randomised fault schedule (printed)."""
    option = request.config.getoption("--wal-fault-seed", default=None)
    from_env = os.environ.get(SEED_ENV)
    seed = int(option) if option is not None else (
        int(from_env) if from_env else random.SystemRandom().randrange(2**31))
    print(f"fault seed: {seed} (replay with --wal-fault-seed={seed})")
    return seed
