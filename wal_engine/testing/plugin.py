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
``RELIABILITY_DEEP=1``) and the Hypothesis profiles ``crash-quick``, ``crash-dev``,
``crash-ci`` and ``crash-deep``.

Installing wal-engine registers the plugin in every project of the environment, so it loads
with plain pytest alone: without pytest-asyncio the async fixtures are replaced by ones that
fail the test that uses them with what to install, and without Hypothesis the crash
profiles are not registered (``wal_crash_machine`` says what to install). The async
fixtures are pytest-asyncio fixtures, so they work under its strict mode (tests marked
``@pytest.mark.asyncio``) as well as its auto mode, on the loop scope configured by
``asyncio_default_fixture_loop_scope``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import pytest

from wal_engine.testing.postgres import DatabaseFactory, TestServer, start_test_server

if TYPE_CHECKING:
    from wal_engine.engine import Engine
    from wal_engine.testing.ledger import EffectLedger
    from wal_engine.testing.machine import AgentUnderTest, MachineStats
    from wal_engine.testing.processes import WorkerPool

T = TypeVar("T")

DEEP_ENV: Final = "RELIABILITY_DEEP"
SEED_ENV: Final = "WAL_ENGINE_FAULT_SEED"
INSTALL_HINT: Final = "pip install 'wal-engine[test]'"


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    return importlib.util.find_spec(module) is not None


def _missing(fixture: str, module: str) -> BaseException:
    """The failure of a fixture whose optional dependency is not installed."""
    return pytest.fail.Exception(
        f"the wal-engine fixture {fixture!r} needs {module}, which is not installed: "
        f"{INSTALL_HINT} (or pip install {module})", pytrace=False)


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
    if _installed("hypothesis"):
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


async def _engine_fixture(wal_database_dsn: str) -> AsyncIterator[Engine]:
    """An engine on the test's fresh database (closed after the test)."""
    from wal_engine.engine import connect

    engine = await connect(wal_database_dsn, migrate=False, pool_size_max=10)
    try:
        yield engine
    finally:
        await engine.close()


async def _ledger_fixture(wal_test_engine: Engine) -> EffectLedger:
    """The side-effect ledger of :func:`wal_test_engine`, ready to use."""
    from wal_engine.testing.ledger import EffectLedger

    ledger = EffectLedger.for_engine(wal_test_engine)
    await ledger.prepare()
    return ledger


if _installed("pytest_asyncio"):
    import pytest_asyncio

    wal_test_engine = pytest_asyncio.fixture(_engine_fixture, name="wal_test_engine")
    wal_effect_ledger = pytest_asyncio.fixture(_ledger_fixture, name="wal_effect_ledger")
else:
    @pytest.fixture(name="wal_test_engine")
    def _engine_unavailable() -> Engine:
        """Stands in for the async engine fixture when pytest-asyncio is missing."""
        raise _missing("wal_test_engine", "pytest-asyncio")

    @pytest.fixture(name="wal_effect_ledger")
    def _ledger_unavailable() -> EffectLedger:
        """Stands in for the async ledger fixture when pytest-asyncio is missing."""
        raise _missing("wal_effect_ledger", "pytest-asyncio")


@pytest.fixture
def wal_crash_machine(request: pytest.FixtureRequest) -> Callable[..., MachineStats]:
    """``run(AgentUnderTest(...), profile=None)``: the crash machine on fresh databases.

    Use it from a synchronous test: the machine runs its own event loop per program.
    Without Hypothesis it fails at once, before a PostgreSQL server is started for it.
    """
    if not _installed("hypothesis"):
        raise _missing("wal_crash_machine", "hypothesis")
    from wal_engine.testing.machine import run_crash_machine

    wal_database_factory: DatabaseFactory = request.getfixturevalue("wal_database_factory")

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
