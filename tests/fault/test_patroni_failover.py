"""Failover of a real Patroni cluster (etcd, three PostgreSQL 15 nodes, synchronous_mode)
under a running workload: the leader's node lost, a planned switchover, the old leader
rewound and back as a replica while a zombie worker that was attached to it wakes up.

Workers (subprocesses) run the ledgered agent and a client submits tasks and signals them,
all through the cluster's multi-host DSN (``target_session_attrs=read-write``). Checked:
every append a worker or the client saw acknowledged is on the new leader (I1); the ledger
shows no effect twice (I4-I7); the log's invariants (I2, I3, I7, I9, I10, I13); every task
finishes with its expected output; a zombie's writes are refused after the failover.
Figures: seconds from the fault to the first acknowledged append, appends acknowledged
before the fault and found after it, and the client's errors by type.

One cluster serves the whole module (bootstrap ~10 s); every test leaves it with three
healthy members and works in a database of its own. The node-loss test runs in CI; the
switchover, the zombie and the repeated runs are deep (RELIABILITY_DEEP=1).

Not made here: the loss of a *host* whose packets vanish (no RST, clients hang until TCP
gives up). Every node runs on 127.0.0.1, so a killed node's sockets are closed by the
kernel and clients see the loss at once; a network partition needs the nodes in network
namespaces (wal_engine.testing.netns), which these tests do not use yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from tests.fault import ledger_agents
from tests.fault.support import (
    FIGURES,
    REPO,
    check_everything,
    expected_output,
    outcome_violations,
    report,
)
from wal_engine.dsn import Dsn
from wal_engine.engine import Engine, connect
from wal_engine.errors import TaskAlreadyExists, UnknownTask, WalError
from wal_engine.security.roles import DEVELOPMENT_ENV
from wal_engine.testing.crash import open_tasks
from wal_engine.testing.invariants import Violation, check_acknowledged
from wal_engine.testing.ledger import EffectLedger
from wal_engine.testing.patroni import (
    PatroniCluster,
    PatroniUnavailable,
    missing_components,
    start_cluster,
)
from wal_engine.testing.processes import WorkerPool, WorkerProcess, wait_until
from wal_engine.testing.worker import ACK_LOG_ENV, read_ack_log

REGISTER = "tests.fault.ledger_agents:register_failover"
WORKER_TIMINGS: dict[str, Any] = {"lease_ttl_ms": 2000, "heartbeat_ms": 300, "poll_ms": 50}
operation_timeout_s = 90.0
"""How long the client retries one submit or signal (a failover takes ~11 s)."""
finish_timeout_s = 180.0
_databases = itertools.count(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[PatroniCluster]:
    """One etcd and three Patroni nodes for the module (see the module docstring)."""
    missing = missing_components()
    if missing:
        pytest.skip("a Patroni cluster needs: " + ", ".join(missing))
    try:
        started = start_cluster()
    except PatroniUnavailable as error:
        # Every component is installed: a cluster that does not come up is a failure to
        # read (with the servers' logs), never a silent skip.
        pytest.fail(f"the Patroni cluster did not start: {error}")
    # The engine refuses a superuser outside a development setup (the embedded server is
    # recognised as one; a cluster of the test's own is one too). Workers inherit it.
    patch = pytest.MonkeyPatch()
    patch.setenv(DEVELOPMENT_ENV, "1")
    line = f"HA bootstrap: etcd + 3 Patroni nodes healthy in {started.bootstrap_s:.1f} s"
    print(line)
    FIGURES.append(line)
    try:
        yield started
    finally:
        patch.undo()
        started.close()


@pytest_asyncio.fixture
async def ha_dsn(cluster: PatroniCluster) -> AsyncIterator[str]:
    """A database of this test's own on the cluster, with the engine's schema, and the
    multi-host DSN of it; the cluster is healthy again (three members) when it ends."""
    cluster.wait_healthy(120)
    name = f"walha_{next(_databases)}"
    admin = await asyncpg.connect(cluster.dsn("postgres"))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    # asyncpg goes on to the next host of a multi-host DSN only when a host refuses the
    # connection (OSError) or is starting up; a replica that has not replayed the CREATE
    # DATABASE yet answers "does not exist", which ends the connect. Wait for every node.
    for node in cluster.nodes:
        await wait_until(lambda node=node: _connects(cluster.node_dsn(node, name)),
                         f"{name} on {node}", 30, 0.05)
    dsn = cluster.dsn(name)
    engine = await connect(dsn, migrate=True)
    await engine.close()
    yield dsn
    for node in cluster.nodes.values():
        if not node.running:
            cluster.start_node(node.name)
    await asyncio.to_thread(cluster.wait_healthy, 120)


async def _connects(dsn: str) -> bool:
    try:
        connection = await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError):
        return False
    await connection.close()
    return True


# ----------------------------------------------------------------------------- the client


@dataclass
class Client:
    """Submits ledgered tasks that wait for a signal and signals them, retrying each call
    until it is acknowledged; records what was acknowledged, when, and every error."""

    engine: Engine
    prefix: str
    expected: dict[str, Any] = field(default_factory=dict)
    submitted_at: dict[str, tuple[float, float]] = field(default_factory=dict)
    signalled_at: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Task -> (wall time the acknowledged attempt was sent, wall time it returned)."""
    errors: Counter[str] = field(default_factory=Counter)
    raw_errors: list[str] = field(default_factory=list)

    async def _call(self, operation: Any) -> tuple[float, float]:
        """Run ``operation`` until it is acknowledged; the (sent, returned) wall times of
        the attempt that was."""
        deadline = time.monotonic() + operation_timeout_s
        while True:
            sent = time.time()
            try:
                await operation()
                return sent, time.time()
            except TaskAlreadyExists:
                # An earlier, ambiguous attempt committed it; when is unknown.
                return float("inf"), time.time()
            except Exception as error:
                kind = f"{type(error).__module__}.{type(error).__qualname__}"
                self.errors[kind] += 1
                if not isinstance(error, WalError):
                    self.raw_errors.append(f"{kind}: {error}")
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)  # Paces the retries of a call; bounded above.

    async def submit(self, index: int) -> str:
        task_id = f"{self.prefix}-{index}"
        n = index % 5 + 1
        self.submitted_at[task_id] = await self._call(lambda: self.engine.submit(
            ledger_agents.AGENT, {"n": n, "sleep_ms": 0, "wait": True}, task_id=task_id))
        self.expected[task_id] = expected_output(n, approval={"go": index})
        return task_id

    async def signal(self, index: int) -> None:
        task_id = f"{self.prefix}-{index}"
        self.signalled_at[task_id] = await self._call(lambda: self.engine.signal(
            task_id, "go", {"go": index}, dedup_key=f"go-{task_id}"))

    async def run(self, count: int, fault_over: asyncio.Event, after: int = 10, lag: int = 3,
                  pace_s: float = 0.05) -> None:
        """Submit at least ``count`` tasks and go on until ``after`` more were submitted
        once ``fault_over`` is set, signalling each ``lag`` submissions later."""
        index = after_fault = 0
        while index < count or after_fault < after:
            await self.submit(index)
            if index >= lag:
                await self.signal(index - lag)
            after_fault += fault_over.is_set()
            index += 1
            await asyncio.sleep(pace_s)  # The client's pace, not a wait for a condition.
        for earlier in range(max(0, index - lag), index):
            await self.signal(earlier)

    def error_summary(self) -> str:
        if not self.errors:
            return "none"
        return "; ".join(f"{name.rsplit('.', 1)[-1]} {n}" for name, n in
                         self.errors.most_common())


def _pool(dsn: str, tmp_path: Path) -> WorkerPool:
    return WorkerPool(dsn, REGISTER, tmp_path, cwd=REPO, concurrency=4, **WORKER_TIMINGS)


def _spawn_options(tmp_path: Path, worker_id: str) -> dict[str, Any]:
    return {"env": {ACK_LOG_ENV: str(tmp_path / f"{worker_id}.acks")}}


def _acks(tmp_path: Path) -> list[Any]:
    return [line for path in sorted(tmp_path.glob("*.acks")) for line in read_ack_log(path)]


async def _engine(dsn: str) -> Engine:
    engine = await connect(dsn, migrate=False)
    ledger_agents.register_failover(engine)
    await EffectLedger.for_engine(engine).prepare()
    return engine


@dataclass
class Outcome:
    """What one fault run measured."""

    fault_s: float
    first_append_s: float | None
    first_worker_append_s: float | None
    first_client_append_s: float | None
    write_gap_s: float
    before: int
    found: int
    violations: list[Violation]
    tasks: int = 0


async def _measure(engine: Engine, client: Client, tmp_path: Path, fault_wall: float
                   ) -> Outcome:
    """I1 over every append the workers (their ack logs) and the client saw acknowledged;
    the seconds from ``fault_wall`` to the first append sent after it and acknowledged; the
    longest time without any acknowledged append from 5 s before the fault on."""
    lines = _acks(tmp_path)
    acknowledged = {(line.task_id, line.seq): line.hash for line in lines}
    before = {(line.task_id, line.seq): line.hash for line in lines if line.at < fault_wall}
    violations = await check_acknowledged(engine.database, acknowledged)
    lost_before = await check_acknowledged(engine.database, before)
    client_acks = [*client.submitted_at.values(), *client.signalled_at.values()]
    after_worker = [line.at for line in lines if line.sent >= fault_wall]
    after_client = [at for sent, at in client_acks if sent >= fault_wall]
    client_before = [task for task, (_, at) in client.submitted_at.items() if at < fault_wall]
    missing = [task for task in client_before if not await _exists(engine, task)]
    violations += [Violation(invariant="I1", task_id=task, detail="acknowledged submit lost")
                   for task in missing]
    first_worker = min(after_worker) - fault_wall if after_worker else None
    first_client = min(after_client) - fault_wall if after_client else None
    firsts = [value for value in (first_worker, first_client) if value is not None]
    times = sorted(t for t in [*(line.at for line in lines), *(at for _, at in client_acks)]
                   if t >= fault_wall - 5)
    gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    return Outcome(fault_s=0.0, first_append_s=min(firsts) if firsts else None,
                   first_worker_append_s=first_worker, first_client_append_s=first_client,
                   write_gap_s=gap, before=len(before) + len(client_before),
                   found=len(before) - len(lost_before) + len(client_before) - len(missing),
                   violations=violations)


async def _exists(engine: Engine, task_id: str) -> bool:
    try:
        await engine.head(task_id)
    except UnknownTask:
        return False
    return True


def _seconds(value: float | None) -> str:
    return "none" if value is None else f"{value:.2f}"


async def _finish_and_check(engine: Engine, client: Client) -> tuple[list[Violation], Any, int]:
    """Wait until every task ends; the full invariant checks and the expected outputs."""
    await wait_until(lambda: _all_done(engine, list(client.expected)),
                     "every task to finish", finish_timeout_s, 0.2)
    violations, effects = await check_everything(engine)
    outcomes, escalated = await _outcomes(engine, client.expected)
    return violations + outcomes, effects, escalated


async def _outcomes(engine: Engine, expected: dict[str, Any]) -> tuple[list[Violation], int]:
    """I8/I11 with escalations allowed, and (as in D1, D10) a task failed because a
    non-deduplicating fake lost its own answer: the fakes keep their counts on the
    cluster, so a delivery cut by the failover has an unknown outcome and the engine must
    not send it again. Those count as escalated, not as violations."""
    violations, escalated = await outcome_violations(engine, expected)
    kept = []
    for violation in violations:
        state = await engine.state(violation.task_id or "")
        failure = state.failure
        if (violation.invariant == "I8" and failure is not None
                and failure.reason == "agent_error" and "OutcomeUnknown" in (failure.error or "")):
            escalated += 1
        else:
            kept.append(violation)
    return kept, escalated


async def _all_done(engine: Engine, task_ids: list[str]) -> bool:
    with contextlib.suppress(WalError):
        return not await open_tasks(engine, task_ids)
    return False


def _assert_only_engine_errors(client: Client) -> None:
    """A caller of the public API sees only wal_engine errors (WalError), never the
    driver's: asserted after the figures are out."""
    assert not client.raw_errors, (
        f"{len(client.raw_errors)} raw driver errors reached the client: "
        f"{client.raw_errors[:5]}")


async def _run_fault(cluster: PatroniCluster, dsn: str, tmp_path: Path, prefix: str,
                     fault: str) -> tuple[Outcome, Client, Any, int, str]:
    """Two workers and the client run; after 12 submissions the fault happens ("kill":
    the leader's node SIGKILLed, "switchover": patronictl switchover); the client goes on
    until 30 tasks and 10 more after the new leader is up. Returns the outcome, the
    client, the ledger totals, the escalations and the old leader's name."""
    engine = await _engine(dsn)
    workers = _pool(dsn, tmp_path)
    client = Client(engine, prefix)
    try:
        for worker_id in ("w1", "w2"):
            workers.start(worker_id, **_spawn_options(tmp_path, worker_id))
        for worker in workers.workers:
            await worker.ready()
        old_leader = cluster.wait_for_leader(30)
        fault_over = asyncio.Event()
        running = asyncio.create_task(client.run(30, fault_over))
        await wait_until(lambda: len(client.submitted_at) >= 12 or running.done(),
                         "12 submissions", 60)
        started = time.monotonic()
        if fault == "kill":
            await asyncio.to_thread(cluster.kill_node, old_leader)
            fault_wall = time.time()  # Every process of the node is gone.
            new_leader = await asyncio.to_thread(cluster.wait_for_leader, 60,
                                                 other_than=old_leader)
        else:
            fault_wall = time.time()
            new_leader = await asyncio.to_thread(cluster.switchover)
        fault_s = time.monotonic() - started
        fault_over.set()
        await running
        violations, effects, escalated = await _finish_and_check(engine, client)
        outcome = await _measure(engine, client, tmp_path, fault_wall)
        outcome.fault_s = fault_s
        outcome.tasks = len(client.expected)
        outcome.violations += violations
        assert new_leader != old_leader
        assert cluster.leader() == new_leader
        return outcome, client, effects, escalated, old_leader
    finally:
        workers.close()
        await engine.close()


def _rejoin(cluster: PatroniCluster, old_leader: str) -> tuple[float, bool]:
    """Start the old leader again; wait until it is a replica on the new timeline.
    Returns the seconds it took and whether Patroni ran pg_rewind."""
    started = time.monotonic()
    if not cluster.nodes[old_leader].running:
        cluster.start_node(old_leader)
    cluster.wait_healthy(120)
    leader = cluster.wait_for_leader(30)
    assert cluster.role(old_leader) in ("replica", "sync_standby")
    assert cluster.timeline(old_leader) == cluster.timeline(leader)
    rewound = "pg_rewind" in cluster.log(old_leader)
    return time.monotonic() - started, rewound


def _report(matrix_id: str, outcome: Outcome, client: Client, effects: Any, escalated: int,
            **more: Any) -> None:
    report(matrix_id, outcome.violations, tasks=len(client.expected), effects=effects,
           fault_to_new_leader_s=f"{outcome.fault_s:.2f}",
           fault_to_first_append_s=_seconds(outcome.first_append_s),
           first_worker_append_s=_seconds(outcome.first_worker_append_s),
           first_client_append_s=_seconds(outcome.first_client_append_s),
           longest_write_gap_s=f"{outcome.write_gap_s:.2f}",
           acknowledged_before=outcome.before, found_after=outcome.found,
           escalated=escalated, client_errors=client.error_summary(),
           raw_driver_errors=len(client.raw_errors), **more)


# ----------------------------------------------------------------------------- the tests


@pytest.mark.timeout(420)
async def test_ha1_leader_node_lost_mid_run(cluster: PatroniCluster, ha_dsn: str,
                                            tmp_path: Path) -> None:
    """The leader's Patroni and postmaster SIGKILLed together while two workers run
    ledgered tasks and the client submits and signals: the synchronous standby takes
    over, every acknowledged append is on it, nothing acts twice, every task finishes;
    the old leader then comes back as a replica on the new timeline (pg_rewind)."""
    outcome, client, effects, escalated, old = await _run_fault(
        cluster, ha_dsn, tmp_path, "ha1", "kill")
    rejoin_s, rewound = await asyncio.to_thread(_rejoin, cluster, old)
    _report("HA1", outcome, client, effects, escalated, rejoin_s=f"{rejoin_s:.1f}",
            pg_rewind="yes" if rewound else "no")
    _assert_only_engine_errors(client)


@pytest.mark.deep
@pytest.mark.timeout(420)
async def test_ha2_planned_switchover_mid_run(cluster: PatroniCluster, ha_dsn: str,
                                             tmp_path: Path) -> None:
    """``patronictl switchover`` to the synchronous standby while the workers run and the
    client submits and signals: the same invariants as a node loss; the old leader is a
    replica of the new one at once (Patroni demotes it, no rewind needed)."""
    outcome, client, effects, escalated, old = await _run_fault(
        cluster, ha_dsn, tmp_path, "ha2", "switchover")
    rejoin_s, _ = await asyncio.to_thread(_rejoin, cluster, old)
    _report("HA2", outcome, client, effects, escalated, rejoin_s=f"{rejoin_s:.1f}")
    _assert_only_engine_errors(client)


deep_runs = 5


@pytest.mark.deep
@pytest.mark.timeout(1800)
async def test_ha1_repeated_node_losses(cluster: PatroniCluster, ha_dsn: str,
                                        tmp_path: Path) -> None:
    """HA1 five times on one cluster (each time the current leader lost, then rewound
    back): the figures per run, their median and spread."""
    runs: list[Outcome] = []
    errors: Counter[str] = Counter()
    raw = 0
    for run in range(deep_runs):
        logs = tmp_path / f"run{run}"
        logs.mkdir()
        outcome, client, effects, escalated, old = await _run_fault(
            cluster, ha_dsn, logs, f"ha1r{run}", "kill")
        rejoin_s, rewound = await asyncio.to_thread(_rejoin, cluster, old)
        _report(f"HA1 run {run + 1}", outcome, client, effects, escalated,
                rejoin_s=f"{rejoin_s:.1f}", pg_rewind="yes" if rewound else "no")
        runs.append(outcome)
        errors.update(client.errors)
        raw += len(client.raw_errors)
    firsts = [r.first_append_s for r in runs if r.first_append_s is not None]
    gaps = [r.write_gap_s for r in runs]
    report("HA1 summary", [], tasks=sum(r.tasks for r in runs), runs=deep_runs,
           kill_to_first_append_median_s=f"{statistics.median(firsts):.2f}",
           kill_to_first_append_min_max_s=f"{min(firsts):.2f}-{max(firsts):.2f}",
           write_gap_median_s=f"{statistics.median(gaps):.2f}",
           acknowledged_before=sum(r.before for r in runs),
           found_after=sum(r.found for r in runs), raw_driver_errors=raw)
    assert len(firsts) == deep_runs


# ----------------------------------------------------------------------------- zombies

ZOMBIE_WORDS = ("task_run_fenced", "lease_lost", "lease_broken", "task_run_given_up",
                "read-only", "ReadOnly", "StaleEpoch", "LeaseExpired", "StaleDelivery")
HELD = """
SELECT task_id, lease_epoch FROM wal_tasks
 WHERE lease_owner = $1 AND status IN ('RUNNING', 'CHECKPOINTED')
"""
OWNED_DELIVERIES = "SELECT count(*) FROM wal_test_effects, unnest(owners) AS o WHERE o = $1"


async def _pause_holding(engine: Engine, zombie: WorkerProcess, attempts: int = 50
                         ) -> dict[str, int]:
    """SIGSTOP ``zombie`` at a moment it holds leases on running tasks; the tasks and the
    epochs it holds them at."""
    for _ in range(attempts):
        await wait_until(lambda: engine.database.fetch(HELD, zombie.worker_id),
                         f"{zombie.worker_id} to hold a lease", 30, 0.005)
        zombie.pause()
        held = {str(r["task_id"]): int(r["lease_epoch"])
                for r in await engine.database.fetch(HELD, zombie.worker_id)}
        if held:
            return held
        zombie.resume()
    raise AssertionError(f"{zombie.worker_id} never held a lease when paused")


@pytest.mark.deep
@pytest.mark.timeout(600)
async def test_ha3_old_leader_rejoins_and_its_zombies_are_fenced(
        cluster: PatroniCluster, ha_dsn: str, tmp_path: Path) -> None:
    """Two workers SIGSTOPped while they hold leases, both attached to the leader (one
    through the multi-host DSN, one through the leader's own address only); the leader's
    node is lost, a rescuer finishes their tasks on the new leader, the old leader comes
    back rewound as a replica, and only then do the zombies resume: neither can write
    (the pinned one reaches a read-only replica, the other a leader whose epochs moved
    on), the ledger counts no delivery of theirs after the resume, every task finishes."""
    engine = await _engine(ha_dsn)
    database = Dsn.parse(ha_dsn).database or ""
    old = cluster.wait_for_leader(30)
    pool = _pool(ha_dsn, tmp_path)
    expected: dict[str, Any] = {}
    try:
        zombie = pool.start("zombie", drain_timeout_s=5.0, **_spawn_options(tmp_path, "zombie"))
        pinned = WorkerProcess(cluster.node_dsn(old, database), "pinned", REGISTER,
                               log_dir=tmp_path, cwd=REPO, concurrency=4, drain_timeout_s=5.0,
                               **WORKER_TIMINGS, **_spawn_options(tmp_path, "pinned"))
        pool.workers.append(pinned)
        for worker in (zombie, pinned):
            await worker.ready()
        for index in range(60):
            task_id = await engine.submit(ledger_agents.AGENT,
                                          {"n": index % 5 + 1, "sleep_ms": 0, "wait": False},
                                          task_id=f"ha3-{index}")
            expected[task_id] = expected_output(index % 5 + 1)
        held = {**await _pause_holding(engine, zombie), **await _pause_holding(engine, pinned)}
        await asyncio.to_thread(cluster.kill_node, old)
        killed_wall = time.time()
        new_leader = await asyncio.to_thread(cluster.wait_for_leader, 60, other_than=old)
        rescuer = await pool.spawn("rescuer", **_spawn_options(tmp_path, "rescuer"))
        await wait_until(lambda: _all_done(engine, list(expected)), "every task to finish",
                         finish_timeout_s, 0.2)
        rejoin_s, rewound = await asyncio.to_thread(_rejoin, cluster, old)
        assert cluster.leader() == new_leader
        owned = {w.worker_id: await _owned(engine, w.worker_id) for w in (zombie, pinned)}
        stale_before = (await EffectLedger.for_engine(engine).totals()).stale_rejected
        sizes = {w.worker_id: len(w.output()) for w in (zombie, pinned)}
        for worker in (zombie, pinned):
            worker.resume()
        for worker in (zombie, pinned):
            # What it tries after waking: its leases are gone (the database's clock), its
            # sockets to the old leader are dead; it is stopped once it said so.
            await wait_until(lambda w=worker: any(word in w.output()[sizes[w.worker_id]:]
                                                  for word in ZOMBIE_WORDS),
                             f"{worker.worker_id} to meet its fence", 60, 0.1)
            worker.kill(15)
            await worker.exited(60)
        after = {w.worker_id: await _owned(engine, w.worker_id) for w in (zombie, pinned)}
        effects_totals = await EffectLedger.for_engine(engine).totals()
        violations, effects = await check_everything(engine)
        outcomes, escalated = await _outcomes(engine, expected)
        acks = await _measure(engine, Client(engine, "none"), tmp_path, killed_wall)
        for worker_id, count in after.items():
            if count != owned[worker_id]:
                violations.append(Violation(
                    invariant="I7", detail=f"{worker_id} delivered {count - owned[worker_id]} "
                                           f"effects after it woke up"))
        refusals = {w.worker_id: sum(w.output()[sizes[w.worker_id]:].count(word)
                                     for word in ZOMBIE_WORDS) for w in (zombie, pinned)}
        report("HA3", violations + outcomes + acks.violations, tasks=len(expected),
               effects=effects, zombies=2, leases_held_when_paused=len(held),
               rescued_by_rescuer=rescuer.worker_id,
               stale_refused_after_wake=effects_totals.stale_rejected - stale_before,
               zombie_refusals_logged=refusals, rejoin_s=f"{rejoin_s:.1f}",
               pg_rewind="yes" if rewound else "no", acknowledged_before=acks.before,
               found_after=acks.found, escalated=escalated)
    finally:
        pool.close()
        await engine.close()


async def _owned(engine: Engine, worker_id: str) -> int:
    """Deliveries the ledger accepted from ``worker_id`` (its name in ``owners``)."""
    row = await engine.database.fetchrow(OWNED_DELIVERIES, worker_id)
    return int(row[0])
