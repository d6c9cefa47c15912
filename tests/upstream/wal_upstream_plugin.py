"""pytest plugin for upstream suites: selects the checkpointer tests, tallies them per saver.

Loaded by ``run_langgraph_suites.py`` with ``-p wal_upstream_plugin`` into a pytest run of
an unpacked sdist's tests (this file is copied next to them, it is not collected here).

* ``WAL_UPSTREAM_PARAM``: the parameter naming the checkpointer (``async_checkpointer``,
  ``sync_checkpointer`` or ``saver_name``); tests without it are deselected.
* ``WAL_UPSTREAM_SAVERS``: the savers (parameter values) to keep.
* ``WAL_UPSTREAM_REPORT``: where to write the outcome of every test as JSON.
* ``WAL_UPSTREAM_ADMIN_DSN``: the server; for the checkpoint-postgres suite the plugin
  adds ``wal_engine`` to each ``saver_name`` parametrization and routes ``_saver("wal_engine")``
  to ``WalCheckpointSaver.from_dsn`` on a fresh database.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
from _pytest.mark.structures import Mark

PARAM = os.environ.get("WAL_UPSTREAM_PARAM", "")
SAVERS = [name for name in os.environ.get("WAL_UPSTREAM_SAVERS", "").split(",") if name]
REPORT = os.environ.get("WAL_UPSTREAM_REPORT", "")
ADMIN_DSN = os.environ.get("WAL_UPSTREAM_ADMIN_DSN", "")
_outcomes: dict[str, dict[str, Any]] = {}
_names = itertools.count(1)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Add ``wal_engine`` to the ``saver_name`` parametrization of checkpoint-postgres."""
    if PARAM != "saver_name" or "wal_engine" not in SAVERS:
        return
    markers = metafunc.definition.own_markers
    for position, mark in enumerate(markers):
        if mark.name == "parametrize" and mark.args and mark.args[0] == "saver_name":
            values = [*mark.args[1], "wal_engine"]
            markers[position] = Mark(mark.name, (mark.args[0], values, *mark.args[2:]),
                                     mark.kwargs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests parametrized by the checkpointer, for the savers asked for."""
    kept, dropped = [], []
    for item in items:
        saver = _saver_of(item)
        (kept if saver is not None and (not SAVERS or saver in SAVERS) else dropped).append(item)
        module = getattr(item, "module", None)
        if PARAM == "saver_name" and module is not None and hasattr(module, "_saver"):
            _route_wal_engine(module)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _saver_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or PARAM not in callspec.params:
        return None
    return str(callspec.params[PARAM])


def _route_wal_engine(module: Any) -> None:
    """Wrap the module's ``_saver(name)`` so that ``"wal_engine"`` opens our saver."""
    original: Callable[[str], AbstractAsyncContextManager[Any]] = module._saver
    if getattr(original, "wal_engine_routed", False):
        return

    @asynccontextmanager
    async def routed(name: str) -> AsyncIterator[Any]:
        if name != "wal_engine":
            async with original(name) as saver:
                yield saver
            return
        import psycopg

        from wal_engine.dsn import with_database
        from wal_engine.integrations.langgraph import WalCheckpointSaver

        database = f"upstream_wal_{os.getpid()}_{next(_names)}"
        async with await psycopg.AsyncConnection.connect(ADMIN_DSN, autocommit=True) as admin:
            await admin.execute(f'CREATE DATABASE "{database}"')
        try:
            async with WalCheckpointSaver.from_dsn(with_database(ADMIN_DSN, database)) as saver:
                yield saver
        finally:
            async with await psycopg.AsyncConnection.connect(ADMIN_DSN,
                                                             autocommit=True) as admin:
                await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')

    routed.wal_engine_routed = True  # type: ignore[attr-defined]
    module._saver = routed


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record each test's worst phase: failed (call) or error (setup/teardown) over passed."""
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "detail": ""})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["detail"] = (entry["detail"] + "\n" + report.longreprtext[-3000:]).strip()
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"


def pytest_itemcollected(item: pytest.Item) -> None:
    saver = _saver_of(item)
    if saver is not None:
        _outcomes.setdefault(item.nodeid, {"outcome": "passed", "detail": ""})["saver"] = saver


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the outcomes of the selected tests that ran."""
    if REPORT:
        ran = {nodeid: entry for nodeid, entry in _outcomes.items()
               if "saver" in entry and (not SAVERS or entry["saver"] in SAVERS)
               and nodeid in _ran}
        with open(REPORT, "w", encoding="utf-8") as handle:
            json.dump(ran, handle, indent=1, sort_keys=True)


_ran: set[str] = set()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _ran.add(nodeid)
