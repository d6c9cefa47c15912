"""Workers on several hosts (issue 22): three network namespaces on one machine, the
database host and two worker hosts on a bridge; worker host A is cut off while it holds
the leases of every task.

* link down (CI): A's cable is pulled at the bridge. B takes every task over once A's
  leases expire (TTL 2 s), and finishes them; when A's link comes back, its renewals are
  refused (``lease_lost``), its runs are fenced (``task_run_fenced``) and write nothing; the
  ledger in the database host counts every effect once.
* netem (deep): ``tc netem loss 30% delay 200ms`` on both ends of A's link instead. A may
  keep some leases through the loss or lose them to B: either way every task finishes,
  nothing A writes lands under a superseded epoch, no effect repeats. Skipped where the
  kernel has no ``sch_netem`` (this project's sandbox: "Specified qdisc kind is unknown").

Figures: time from the cut to B's first claim of A's tasks (database clock), and the late
writes of A refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import asyncpg
import pytest

from tests.fault import host_agents
from tests.fault.support import REPO, report
from wal_engine.engine import Engine, connect
from wal_engine.security.roles import DEVELOPMENT_ENV
from wal_engine.state_machine import Status
from wal_engine.store.connection import apply_schema
from wal_engine.testing import netns
from wal_engine.testing.crash import open_tasks
from wal_engine.testing.invariants import Violation, check_snapshot, read_snapshot
from wal_engine.testing.ledger import (
    READ_EFFECTS_IF_PRESENT,
    EffectLedger,
    check_effect_rows,
    effect_rows,
    totals,
)
from wal_engine.testing.processes import WorkerProcess, wait_until

REGISTER: Final = "tests.fault.host_agents:register"
TASKS: Final = 4
TTL_MS: Final = 2000
HEARTBEAT_MS: Final = 250
HOST_A: Final = "host-a"
HOST_B: Final = "host-b"


@pytest.fixture(scope="module")
def lab() -> Iterator[tuple[netns.Lab, netns.NamespacedPostgres]]:
    """The database host ``db`` (PostgreSQL on its bridge address) and worker hosts ``a``
    and ``b``; every namespace and link is deleted at the end of the module."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces: {reason}")
    with netns.lab_with_database(["db", "a", "b"]) as made:
        yield made
    assert made[0].leftovers() == []


@contextlib.asynccontextmanager
async def _database(server: netns.NamespacedPostgres, name: str) -> AsyncIterator[Engine]:
    """A fresh database on the lab's server with the schema and the ledger; the test's
    engine reaches it through the server's Unix socket."""
    admin = await asyncpg.connect(server.local_dsn())
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    connection = await asyncpg.connect(server.local_dsn(name))
    try:
        await apply_schema(connection)
    finally:
        await connection.close()
    engine = await connect(server.local_dsn(name), migrate=False, development=True)
    try:
        host_agents.register(engine)
        await EffectLedger.for_engine(engine).prepare()
        yield engine
    finally:
        await engine.close()


def _worker(lab: netns.Lab, server: netns.NamespacedPostgres, database: str, host: str,
            worker_id: str, log_dir: Path, env: dict[str, str] | None = None) -> WorkerProcess:
    return WorkerProcess(server.dsn(database), worker_id, REGISTER, log_dir=log_dir,
                         concurrency=TASKS, lease_ttl_ms=TTL_MS, heartbeat_ms=HEARTBEAT_MS,
                         poll_ms=100, env={DEVELOPMENT_ENV: "1", **(env or {})},
                         wrapper=lab.exec_argv(host, []), cwd=REPO, drain_timeout_s=5.0)


async def _stop(worker: WorkerProcess) -> None:
    worker.kill(signal.SIGTERM)
    with contextlib.suppress(AssertionError):
        await worker.exited(30)
    worker.close()


async def _scenario(lab: netns.Lab, server: netns.NamespacedPostgres, tmp_path: Path,
                    name: str, fault: Callable[[], None], *, release_early: bool
                    ) -> dict[str, Any]:
    """Run TASKS tasks on A, start B, apply ``fault`` to A's link, and see every task
    through. With ``release_early`` A's held calls go on while the fault lasts (netem:
    A may keep its leases); else only after its link is back and B has finished."""
    hold = tmp_path / "hold"
    figures: dict[str, Any] = {}
    violations: list[Violation] = []
    async with _database(server, name) as engine:
        ids = [await engine.submit(host_agents.AGENT, {"n": n}, task_id=f"{name}-{n}")
               for n in range(TASKS)]
        a = _worker(lab, server, name, "a", HOST_A, tmp_path,
                    {host_agents.HOLD_FILE_ENV: str(hold)})
        b: WorkerProcess | None = None
        try:
            await a.ready()
            await wait_until(lambda: all(host_agents.inside_marker(hold, n).exists()
                                         for n in range(TASKS)),
                             "host A inside every task's reservation", 60)
            heads = {task: await engine.head(task) for task in ids}
            assert {head.lease_owner for head in heads.values()} == {HOST_A}
            a_epochs = {task: head.lease_epoch for task, head in heads.items()}
            b = _worker(lab, server, name, "b", HOST_B, tmp_path)
            await b.ready()
            cut_at: dt.datetime = (await engine.database.fetchrow(
                "SELECT clock_timestamp() AS now"))["now"]
            fault()
            try:
                if release_early:
                    await asyncio.sleep(2 * TTL_MS / 1000)  # the fault lasts; A goes on
                    hold.touch()
                await wait_until(lambda: _all_completed(engine, ids),
                                 "every task to finish while A is cut off", 90, 0.1)
            finally:
                lab.restore("a")
            hold.touch()
            takeovers = await _takeovers(engine, ids, a_epochs)
            figures["tasks taken over by B"] = len(takeovers)
            if takeovers:
                first = min(takeovers.values())
                figures["cut to B's first claim ms"] = round(
                    (first - cut_at).total_seconds() * 1000)
                figures["cut to B's last claim ms"] = round(
                    (max(takeovers.values()) - cut_at).total_seconds() * 1000)
            # A's side: each taken-over lease is refused at A's first renewal after the
            # link returns, and its held run is fenced at its next write.
            await wait_until(lambda: a.output().count("task_run_fenced") >= len(takeovers),
                             "host A's runs to be fenced", 60, 0.1)
            await asyncio.sleep(0.5)  # anything A still had queued lands (or not) now
            refusals = _refusals(a.output())
            figures["A late writes refused"] = sum(refusals.values())
            figures.update({f"A {what}": count for what, count in refusals.items()})
            for task, epoch in a_epochs.items():
                violations += await _late_writes(engine, task, epoch)
        finally:
            for worker in (a, b):
                if worker is not None:
                    await _stop(worker)
        snapshot = await read_snapshot(engine.database, ids,
                                       extra={"effects": READ_EFFECTS_IF_PRESENT})
        rows = effect_rows(snapshot.extra["effects"])
        violations += check_snapshot(snapshot)
        violations += check_effect_rows(rows, snapshot.events,
                                        completed_tools=host_agents.TOOLS)
        repeated = [row.key for row in rows if row.applied > 1 or (row.deliveries > 1
                    and row.tool_class == "unsafe")]
        violations += [Violation(invariant="I4", task_id=None, detail=f"{key} acted twice")
                       for key in repeated]
        for task in ids:
            state = await engine.state(task)
            if state.status is not Status.COMPLETED or \
                    state.output != host_agents.expected_output(int(task.rsplit("-", 1)[1])):
                violations.append(Violation(invariant="I8", task_id=task,
                                            detail=f"{state.status}: {state.output}"))
        figures["effects"] = totals(rows)
        figures["violations list"] = violations
        figures["a log"] = a.log_path
    return figures


def _refusals(log: str) -> dict[str, int]:
    """A's writes the database refused, from its log: renewals of a lease another worker
    owns (the keeper's ``lease_lost``) and appends fenced by the epoch (``LeaseLost``:
    "... (current epoch N)")."""
    counts = {"renewals refused": 0, "appends refused": 0}
    for line in log.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if not isinstance(record, dict):
                continue
            reason = str(record.get("reason", ""))
            if record.get("event") == "lease_lost" and "not renewed" in reason:
                counts["renewals refused"] += 1
            elif record.get("event") == "task_run_fenced" and "current epoch" in reason:
                counts["appends refused"] += 1
    return counts


async def _all_completed(engine: Engine, ids: list[str]) -> bool:
    return not await open_tasks(engine, ids)


async def _takeovers(engine: Engine, ids: list[str], a_epochs: dict[str, int]
                     ) -> dict[str, dt.datetime]:
    """When each task was first claimed at an epoch newer than A's (database clock)."""
    found: dict[str, dt.datetime] = {}
    for task in ids:
        for record in await engine.history(task):
            if record.epoch > a_epochs[task] and record.type in ("task_claimed",
                                                                 "task_resumed"):
                assert record.recorded_at is not None
                found[task] = record.recorded_at
                break
    return found


async def _late_writes(engine: Engine, task: str, a_epoch: int) -> list[Violation]:
    """Events written at A's epoch after the task moved to a newer one (none may be)."""
    history = await engine.history(task)
    newer = [record.seq for record in history if record.epoch > a_epoch]
    if not newer:
        return []
    late = [record.type for record in history
            if record.epoch <= a_epoch and record.seq > min(newer)]
    return [Violation(invariant="I7", task_id=task, detail=f"A wrote {late} after takeover")
            ] if late else []


def _finish(matrix_id: str, figures: dict[str, Any]) -> None:
    violations = figures.pop("violations list")
    log_path = figures.pop("a log")
    effects = figures.pop("effects")
    if violations:
        print(f"--- host A's log ({log_path}) ---\n{Path(log_path).read_text()[-6000:]}")
    report(matrix_id, violations, tasks=TASKS, effects=effects,
           **{key.replace(" ", "_"): value for key, value in figures.items()})


@pytest.mark.timeout(240)
async def test_host_cut_off_by_link_down_is_fenced_and_b_finishes(
        lab: tuple[netns.Lab, netns.NamespacedPostgres], tmp_path: Path) -> None:
    """A holds every lease, its link goes down: B takes the tasks after the TTL, A's late
    renewals are refused and its runs fenced when the link returns, nothing acts twice."""
    network, server = lab
    figures = await _scenario(network, server, tmp_path, "linkdown",
                              lambda: network.cut("a"), release_early=False)
    assert figures["tasks taken over by B"] == TASKS
    assert figures["A late writes refused"] >= TASKS
    assert figures["cut to B's first claim ms"] >= TTL_MS * 0.5
    _finish("HOSTS-linkdown", figures)


@pytest.mark.deep
@pytest.mark.timeout(300)
async def test_host_behind_lossy_slow_link_is_fenced_or_finishes(
        lab: tuple[netns.Lab, netns.NamespacedPostgres], tmp_path: Path) -> None:
    """netem loss 30% and delay 200 ms on A's link while it holds every lease: whoever
    ends up owning each task finishes it; A's writes under a lost lease are refused."""
    network, server = lab
    probe_host = "b"
    try:
        network.impair(probe_host, loss_percent=0, delay_ms=1)
    except netns.NetemUnavailable as refused:
        pytest.skip(f"tc netem is not available here: {refused}")
    network.clear_impairment(probe_host)
    figures = await _scenario(
        network, server, tmp_path, "netem",
        lambda: network.impair("a", loss_percent=30, delay_ms=200), release_early=True)
    _finish("HOSTS-netem", figures)


def test_lab_teardown_deletes_every_namespace() -> None:
    """A lab deletes what it made, also when its database host fails to start."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces: {reason}")
    made = netns.Lab(["hub", "x"])
    with pytest.raises(RuntimeError, match="inside"), made:
        assert len(made.leftovers()) == 2
        raise RuntimeError("a failure inside the lab")
    assert made.leftovers() == []

