"""Fixtures shared by every test: a real PostgreSQL and a fresh database per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, settings

from wal_engine.store import Database, Store
from wal_engine.testing.postgres import DatabaseFactory, TestServer, start_test_server

settings.register_profile(
    "ci",
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "deep",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TEST_POOLER_ENV = "WAL_ENGINE_TEST_POOLER"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[TestServer]:
    """The session's PostgreSQL: WAL_ENGINE_TEST_DSN, else an embedded server we own."""
    server = start_test_server()
    yield server
    server.close()


@pytest_asyncio.fixture(scope="session")
async def database_factory(pg_server: TestServer) -> AsyncIterator[DatabaseFactory]:
    """Makes fresh databases from a template holding the schema."""
    factory = DatabaseFactory(pg_server)
    await factory.prepare()
    yield factory
    await factory.drop_all()


@pytest.fixture(scope="session")
def test_pooler(pg_server: TestServer) -> Iterator[Any]:
    """With WAL_ENGINE_TEST_POOLER=transaction|session: a PgBouncer in that pool mode in
    front of the session's server, through which ``database_dsn`` (and so ``database``
    and ``engine``) connect, and WAL_ENGINE_POOLER set to match for every engine the tests
    open (the CLI's too). Else None. (docs/pgbouncer.md, "The test suite through it".)"""
    mode = os.environ.get(TEST_POOLER_ENV) or None
    if mode is None:
        yield None
        return
    from wal_engine.store.pooler import POOLER_ENV
    from wal_engine.testing.pgbouncer import PgBouncer

    bouncer = PgBouncer.in_front_of(pg_server.admin_dsn, pool_mode=mode).start()
    saved = os.environ.get(POOLER_ENV)
    os.environ[POOLER_ENV] = mode
    try:
        yield bouncer
    finally:
        if saved is None:
            os.environ.pop(POOLER_ENV, None)
        else:
            os.environ[POOLER_ENV] = saved
        bouncer.close()


@pytest_asyncio.fixture
async def database_dsn(database_factory: DatabaseFactory, test_pooler: Any
                       ) -> AsyncIterator[str]:
    """DSN of a fresh database with the schema applied, dropped after the test (through
    the session's PgBouncer under WAL_ENGINE_TEST_POOLER)."""
    dsn = await database_factory.create()
    yield dsn if test_pooler is None else test_pooler.via(dsn)
    await database_factory.drop(dsn)


@pytest_asyncio.fixture
async def database(database_dsn: str) -> AsyncIterator[Database]:
    """An open connection pool on the test's fresh database."""
    db = await Database.open(database_dsn, migrate=False, max_size=10)
    yield db
    await db.close()


@pytest_asyncio.fixture
async def store(database: Database) -> Store:
    """A store on the test's fresh database."""
    return Store(database)


@pytest_asyncio.fixture
async def engine(database_dsn: str) -> AsyncIterator[Any]:
    """A wal-engine Engine on the test's fresh database."""
    from wal_engine.engine import connect

    connected = await connect(database_dsn, migrate=False, pool_size_max=10)
    yield connected
    await connected.close()


# ----------------------------------------------------------------------------- figures
# Fault and machine tests append a figures line each (tests.fault.support.FIGURES). Under
# pytest-xdist they run in worker processes, so each line travels on its test's report
# (user_properties) to the process that prints the summary; without xdist the same path
# runs in process.

FIGURE_PROPERTY = "wal_figure"
_figures_sent = 0
_figures_received: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    """Attach the figures lines a test added to its teardown report."""
    global _figures_sent
    outcome = yield
    if call.when != "teardown":
        return
    from tests.fault.support import FIGURES

    report = outcome.get_result()
    for line in FIGURES[_figures_sent:]:
        report.user_properties.append((FIGURE_PROPERTY, line))
    _figures_sent = len(FIGURES)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the figures lines of every report (from xdist workers too), and record its
    duration where WAL_ENGINE_TEST_TIMES asks (see pytest_configure)."""
    _figures_received.extend(value for key, value in report.user_properties
                             if key == FIGURE_PROPERTY)
    if _times_path:
        with open(_times_path, "a", encoding="utf-8") as times:
            times.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t"
                        f"{report.outcome}\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print every fault test's figures line, so matrix coverage can be read off."""
    if _figures_received:
        terminalreporter.section("reliability figures (RELIABILITY.md matrix ids)")
        for line in _figures_received:
            terminalreporter.write_line(line)


# ----------------------------------------------------------------------------- scheduling
# `-n 2 --dist loadfile` gives each xdist worker whole files. pytest-xdist's default
# (--loadscope-reorder) queues files by their number of tests, most first, so the files
# holding a few long tests (the crash machine, the effect model, the walkthrough) were sent
# last and ran alone at the end: the run's wall time was their start plus their length.
# Files are queued in collection order instead, with the longest known files first (a
# longest-first schedule over two workers); the rest keep pytest's order, short unit
# tests last, filling whichever worker frees first. The list is by measured time per file
# (WAL_ENGINE_TEST_TIMES below records it); a file missing from it only runs later.
SLOW_FIRST = (
    "tests/fault/test_w1_w3_crash_machine.py",
    "tests/fault/test_w1_w3_crash_machine_tool_classes.py",
    "tests/property/test_effect_model.py",
    "tests/fault/test_n_network_faults.py",
    "tests/fault/test_d_database_faults.py",
    "tests/fault/test_w_worker_faults.py",
    "tests/fault/test_effect_safety.py",
    "tests/fault/test_k_clock_faults.py",
    "tests/fault/test_gateway_faults.py",
    "tests/integration/test_walkthrough.py",
    "tests/fault/test_l_logic_faults.py",
    "tests/fault/test_rolling_deploy.py",
)


_times_path: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Queue files in collection order under xdist (see SLOW_FIRST). With
    WAL_ENGINE_TEST_TIMES=path, the controlling process appends each phase's duration (node
    id, phase, seconds, outcome) to that file as it ends, so a run stopped part-way still
    says where its time went and what failed."""
    global _times_path
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        _times_path = os.environ.get("WAL_ENGINE_TEST_TIMES") or None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest known files first, everything else in pytest's order (a stable sort)."""
    rank = {path: index for index, path in enumerate(SLOW_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], len(SLOW_FIRST))

    items.sort(key=key)
