"""DBOS Transact in the suite: one ``@DBOS.step`` per step inside a ``@DBOS.workflow``.

The step returns the step's ~500-byte message and ~1 KB tool result (DBOS records a step's
output, not its arguments, so the output carries both); the workflow keeps every output in
a list, so its state after step k is all messages so far. DBOS keeps its own system
database on the same server (``system_database_url``); each process that runs DBOS has its
own executor id, so that no process recovers another's workflows by accident.

Recovery is measured in a fresh process, as DBOS does it after a crash: the history build
leaves its workflow PENDING at its last step (the process exits without cleaning up); a
recovering process launches DBOS, then ``DBOS._recover_pending_workflows([dead executor])``
re-enqueues the workflow on DBOS's internal queue, a queue worker dequeues it, and the
workflow function re-executes from the top, each recorded step answered from the system
database, until it reaches the step after its last recorded one. Reported: the time from
the recovery call to that point, and the part of it spent re-executing (from the workflow
function's first line).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from typing import Any, Final

import asyncpg
from dbos import DBOS, DBOSConfig, SetWorkflowID

from benchmarks.peers_workload import (
    CONCURRENT_TASKS,
    Driver,
    StepClock,
    history_figures,
    message,
    peak_rss_mib,
    print_result,
    result,
    tables_bytes,
)
from wal_engine import limits

NAME: Final = "DBOS Transact"
APP_NAME: Final = "wal-bench-suite"
APP_VERSION: Final = "wal-bench-suite-1"
"""Fixed, so that every process of a run (and only those) can recover each other's work."""
SCHEMA: Final = "dbos"
TABLE_PATTERNS: Final = ("%",)
POOL_EXTRA_CONNECTIONS: Final = 8
"""Beyond one connection per concurrent workflow: DBOS's own threads use some."""
RECOVERY_TIMEOUT_S: Final = 600.0
PACKAGES: Final = ("dbos", "sqlalchemy", "psycopg")


def config(system_database_url: str, executor_id: str) -> DBOSConfig:
    """DBOS's configuration for one process of the suite."""
    return {
        "name": APP_NAME,
        "system_database_url": system_database_url,
        "sys_db_pool_size": CONCURRENT_TASKS + 1 + POOL_EXTRA_CONNECTIONS,
        "application_version": APP_VERSION,
        "executor_id": executor_id,
        "log_level": "WARNING",
    }


@DBOS.step()
async def work(step: int, text: str) -> dict[str, str]:
    """The tool of step ``step``: its output (message and result) is what DBOS records."""
    return {"message": text, "result": result(step)}


# ----------------------------------------------------------------------------- driven


_driver = Driver()


@DBOS.workflow()
async def suite_driven(key: str) -> int:
    """The workflow of the in-process workloads: one step each time the driver says go."""
    outputs: list[dict[str, str]] = []
    while await _driver.go[key].get():
        outputs.append(await work(len(outputs), message(len(outputs))))
        _driver.done[key].put_nowait(None)
    return len(outputs)


class DbosPeer:
    """The in-process contender: 1 + 64 driven workflows in this process's DBOS."""

    name = NAME

    def __init__(self, system_database_url: str) -> None:
        self.url = system_database_url
        self.keys: list[str] = []
        self.handles: list[Any] = []
        self.launched = False

    async def open(self) -> None:
        """Launch DBOS here and start every workflow (each waits for its first go)."""
        DBOS(config=config(self.url, f"main-{os.getpid()}-{uuid.uuid4().hex[:6]}"))
        DBOS.launch()
        self.launched = True
        run = uuid.uuid4().hex[:8]
        self.keys = [f"dbos-seq-{run}"] + [f"dbos-c{i:02d}-{run}" for i in range(CONCURRENT_TASKS)]
        for key in self.keys:
            _driver.add(key)
            with SetWorkflowID(key):
                self.handles.append(await DBOS.start_workflow_async(suite_driven, key))

    async def step_one(self) -> None:
        """One step of the sequential workflow."""
        await _driver.step(self.keys[0])

    async def step_all(self) -> None:
        """One step of each of the 64 concurrent workflows, all at once."""
        await asyncio.gather(*(_driver.step(key) for key in self.keys[1:]))

    async def close(self) -> None:
        """Let every workflow return, then shut DBOS down."""
        for key in self.keys:
            await _driver.stop(key)
        if self.handles:
            await asyncio.wait_for(asyncio.gather(*(h.get_result() for h in self.handles)),
                                   120)
        if self.launched:
            DBOS.destroy(destroy_registry=False)

    async def extra(self) -> dict[str, Any]:
        """Nothing beyond the common figures."""
        return {}


def live_peer(arguments: dict[str, Any]) -> DbosPeer:
    """(Child) The live contender of ``serve``."""
    return DbosPeer(arguments["system_url"])


# ----------------------------------------------------------------------------- histories


class _Hook:
    """A point of the history workflow where it stops (until released, or for good)."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.reached_at = 0.0
        self.release = threading.Event()


_hooks: dict[int, _Hook] = {}
_body_started: list[float] = []


@DBOS.workflow(max_recovery_attempts=None)
async def suite_history() -> None:
    """The workflow of a history build: steps until the process stops it at a hook."""
    _body_started.append(time.perf_counter())
    outputs: list[dict[str, str]] = []
    while True:
        hook = _hooks.get(len(outputs))
        if hook is not None:
            hook.reached_at = time.perf_counter()
            hook.reached.set()
            while not hook.release.is_set():
                await asyncio.sleep(0.005)
        outputs.append(await work(len(outputs), message(len(outputs))))


async def _wait(event: threading.Event, timeout_s: float) -> None:
    if not await asyncio.to_thread(event.wait, timeout_s):
        raise TimeoutError("the DBOS workflow did not reach its hook")


async def build(arguments: dict[str, Any]) -> dict[str, Any]:
    """(Child) Run the history workflow for ``steps`` steps, measure the system database,
    and exit with the workflow PENDING at its next step (a crash, as far as DBOS knows)."""
    url, steps, window = arguments["system_url"], int(arguments["steps"]), int(arguments["window"])
    executor_id = f"build-{uuid.uuid4().hex[:8]}"
    middle_hook, end_hook = _Hook(), _Hook()
    _hooks.update({steps - window: middle_hook, steps: end_hook})
    DBOS(config=config(url, executor_id))
    DBOS.launch()
    connection = await asyncpg.connect(arguments["system_dsn"], timeout=limits.connect_timeout_s)
    before = await tables_bytes(connection, SCHEMA, TABLE_PATTERNS)
    clock = StepClock()
    with SetWorkflowID(arguments["task_id"]):
        await DBOS.start_workflow_async(suite_history)
    await _wait(middle_hook.reached, RECOVERY_TIMEOUT_S)
    middle = await tables_bytes(connection, SCHEMA, TABLE_PATTERNS)
    clock.mark_window()
    middle_hook.release.set()
    await _wait(end_hook.reached, RECOVERY_TIMEOUT_S)
    after = await tables_bytes(connection, SCHEMA, TABLE_PATTERNS)
    clock.steps = steps
    figures = history_figures(steps=steps, window=window, before=before, middle=middle,
                              after=after, clock=clock, extra={"executor_id": executor_id})
    print_result(figures)
    os._exit(0)  # Leave the workflow PENDING: no DBOS shutdown, no cancellation.


async def recover(arguments: dict[str, Any]) -> dict[str, Any]:
    """(Child) Launch DBOS in this fresh process, recover the dead executor's workflows,
    and time until the workflow is back at the step after its last recorded one."""
    steps = int(arguments["steps"])
    executor_id = f"recover-{uuid.uuid4().hex[:8]}"
    hook = _Hook()  # Never released: the parent kills this process once it reports.
    _hooks[steps] = hook
    DBOS(config=config(arguments["system_url"], executor_id))
    launch_started = time.perf_counter()
    DBOS.launch()
    launch_ms = (time.perf_counter() - launch_started) * 1000
    start = time.perf_counter()
    handles = await asyncio.to_thread(DBOS._recover_pending_workflows,
                                      [arguments["from_executor"]])
    await _wait(hook.reached, RECOVERY_TIMEOUT_S)
    figures = {
        "recovered": len(handles),
        "recovery_ns": round((hook.reached_at - start) * 1e9),
        "reexecution_ns": round((hook.reached_at - _body_started[-1]) * 1e9),
        "launch_ms": launch_ms,
        "executor_id": executor_id,
        "peak_rss_mib": peak_rss_mib(),
    }
    print_result(figures)
    os._exit(0)  # The workflow stays PENDING under this executor for the next recovery.
