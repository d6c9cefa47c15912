"""Concurrency and logic faults L2, L3, L4, L6, L7 (RELIABILITY.md); L1 is in
test_worker_processes.py, L5 in tests/golden, L8 in every crash-machine example."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from tests.fault import ledger_agents
from tests.fault.support import check_everything, expected_output, report
from wal_engine.engine import Engine
from wal_engine.errors import IllegalTransition, TaskAlreadyExists
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.replayer import replay_events
from wal_engine.state_machine import TRANSITIONS, Status, check_path
from wal_engine.testing.crash import (
    default_responder,
    drive_to_quiescence,
    expire_leases,
    run_worker_until_idle,
)
from wal_engine.testing.invariants import Violation
from wal_engine.testing.ledger import EffectLedger
from wal_engine.testing.replay import mismatch


@pytest.mark.timeout(120)
async def test_l2_duplicate_submissions_make_one_task(ledgered: Engine) -> None:
    """The same task id submitted 2-10 times at once: one task, one stream; another input
    under that id is refused."""
    violations: list[Violation] = []
    submissions = 0
    for copies in range(2, 11):
        task_id = f"l2-{copies}"
        task_input = {"n": copies, "sleep_ms": 0, "wait": False}
        results = await asyncio.gather(*(ledgered.submit(ledger_agents.AGENT, task_input,
                                                         task_id=task_id)
                                         for _ in range(copies)), return_exceptions=True)
        submissions += copies
        if any(isinstance(r, BaseException) or r != task_id for r in results):
            violations.append(Violation(invariant="L2", task_id=task_id,
                                        detail=f"submissions answered {results!r}"))
        try:
            await ledgered.submit(ledger_agents.AGENT, {**task_input, "n": 99}, task_id=task_id)
            violations.append(Violation(invariant="L2", task_id=task_id,
                                        detail="another input under the same id accepted"))
        except TaskAlreadyExists:
            pass
    await drive_to_quiescence(ledgered)
    rows = await ledgered.database.fetch(
        "SELECT task_id, count(*) AS n FROM wal_events WHERE type = 'task_submitted' "
        "GROUP BY task_id HAVING count(*) <> 1")
    violations += [Violation(invariant="L2", task_id=r["task_id"],
                             detail=f"{r['n']} submissions recorded") for r in rows]
    for copies in range(2, 11):
        state = await ledgered.state(f"l2-{copies}")
        if state.output != expected_output(copies):
            violations.append(Violation(invariant="I8", task_id=f"l2-{copies}",
                                        detail=f"{state.status} {state.output}"))
    more, effects = await check_everything(ledgered)
    report("L2", violations + more, tasks=9, effects=effects, submissions=submissions)


@pytest.mark.timeout(120)
async def test_l3_duplicate_and_reordered_signal_deliveries(ledgered: Engine) -> None:
    """A webhook delivered twice and out of order (dedup keys): one inbox row per key, and
    each waiting task observes exactly one signal."""
    violations: list[Violation] = []
    deliveries = 0
    for n in range(10):
        task_id = f"l3-{n}"
        await ledgered.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": True},
                              task_id=task_id)
        await run_worker_until_idle(ledgered)
        order = [("b", {"ok": "b"}), ("a", {"ok": "a"}), ("b", {"ok": "b"}),
                 ("a", {"ok": "a"})]
        for key, payload in order if n % 2 else reversed(order):
            await ledgered.signal(task_id, "go", payload, dedup_key=f"{task_id}:{key}")
            deliveries += 1
    await drive_to_quiescence(ledgered, responder=default_responder(ledgered))
    rows = await ledgered.database.fetch(
        "SELECT task_id, count(*) AS n FROM wal_signals GROUP BY task_id")
    violations += [Violation(invariant="L3", task_id=r["task_id"],
                             detail=f"{r['n']} inbox rows for 2 keys")
                   for r in rows if r["n"] != 2]
    received = await ledgered.database.fetch(
        "SELECT task_id, count(*) AS n FROM wal_events WHERE type = 'signal_received' "
        "GROUP BY task_id")
    violations += [Violation(invariant="L3", task_id=r["task_id"],
                             detail=f"{r['n']} signals observed, 1 awaited")
                   for r in received if r["n"] != 1]
    more, effects = await check_everything(ledgered)
    report("L3", violations + more, tasks=10, effects=effects, deliveries=deliveries,
           inbox_rows=sum(int(r["n"]) for r in rows))


@pytest.mark.timeout(120)
async def test_l4_concurrent_sweepers_orphan_once_and_spare_live_leases(
        ledgered: Engine, database_dsn: str) -> None:
    """Four sweepers break the same 40 expired leases at once: each task is orphaned once;
    a task claimed again afterwards is not yanked from its new owner."""
    for n in range(40):
        await ledgered.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": False},
                              task_id=f"l4-{n}")
    await ledgered.database.fetch("SELECT * FROM wal_claim_tasks('gone', 100, 60000)")
    await ledgered.database.fetch(
        "UPDATE wal_tasks SET lease_expires_at = now() - interval '1 second'")
    # Sweepers are bound to the tenant like every engine connection (wal_break_leases
    # breaks only the leases of its session's tenant).
    sweepers = [await ledgered.database.connect_session("wal-engine:sweeper")
                for _ in range(4)]
    try:
        broken = await asyncio.gather(*(s.fetch("SELECT * FROM wal_break_leases(100)")
                                        for s in sweepers))
        await ledgered.database.fetch("SELECT * FROM wal_claim_tasks('alive', 100, 60000)")
        again = await asyncio.gather(*(s.fetch("SELECT * FROM wal_break_leases(100)")
                                       for s in sweepers))
    finally:
        for sweeper in sweepers:
            await sweeper.close()
    violations: list[Violation] = []
    counts = await ledgered.database.fetch(
        "SELECT task_id, count(*) AS n FROM wal_events WHERE type = 'task_orphaned' "
        "GROUP BY task_id")
    violations += [Violation(invariant="L4", task_id=r["task_id"],
                             detail=f"orphaned {r['n']} times") for r in counts if r["n"] != 1]
    if sum(len(b) for b in broken) != 40:
        violations.append(Violation(invariant="L4", detail=f"{sum(map(len, broken))} broken"))
    if any(again):
        violations.append(Violation(invariant="L4", detail="a live lease was broken"))
    owners = await ledgered.database.fetch(
        "SELECT count(*) AS n FROM wal_tasks WHERE lease_owner = 'alive'")
    await expire_leases(ledgered)
    await drive_to_quiescence(ledgered)
    more, effects = await check_everything(ledgered)
    report("L4", violations + more, tasks=40, effects=effects, sweepers=4,
           broken_once=sum(len(b) for b in broken), live_leases_kept=int(owners[0]["n"]))


V2_ORDER = "ledgered-v2"


def _register_reordered(engine: Engine) -> None:
    """Today's code of the ledgered agent with two calls swapped (a careless deploy)."""
    ledger = EffectLedger.for_engine(engine)
    llm = ledger.llm("fake-llm")
    reserve = ledger.service("reserve", kind="idem", result=lambda a: {"reserved": a["n"]})

    async def reordered(ctx: AgentContext, task_input: Any) -> Any:
        n = int(task_input["n"])
        reserved = await ctx.tool("reserve", reserve, {"n": n})
        plan = await ctx.llm("fake-llm", llm, {"plan": n})
        return {"plan": plan, "reserved": reserved}

    engine.register(ledger_agents.AGENT, reordered)


@pytest.mark.timeout(120)
async def test_l6_changed_code_is_caught_by_replay_and_quarantined_live(
        ledgered: Engine) -> None:
    """Code whose call order changed: the replay check names the divergence, and a live
    resume fails the task with reason nondeterminism instead of silently diverging."""
    finished = await ledgered.submit(ledger_agents.AGENT, {"n": 3, "sleep_ms": 0,
                                                           "wait": False}, task_id="l6-done")
    waiting = await ledgered.submit(ledger_agents.AGENT, {"n": 4, "sleep_ms": 0,
                                                          "wait": True}, task_id="l6-wait")
    await drive_to_quiescence(ledgered, [finished])
    await run_worker_until_idle(ledgered)
    clean = await replay_events(await ledgered.history(finished), ledgered.agents)
    _register_reordered(ledgered)
    diverged = await replay_events(await ledgered.history(finished), ledgered.agents)
    deliveries_before = (await EffectLedger.for_engine(ledgered).totals()).deliveries
    await ledgered.signal(waiting, "go", {"ok": True})
    await drive_to_quiescence(ledgered, [waiting])
    state = await ledgered.state(waiting)
    deliveries_after = (await EffectLedger.for_engine(ledgered).totals()).deliveries
    violations: list[Violation] = []
    if mismatch(clean) is not None:
        violations.append(Violation(invariant="L6", detail=f"unchanged code: {clean}"))
    if diverged.divergence is None:
        violations.append(Violation(invariant="L6", detail="replay missed the divergence"))
    if state.failure is None or state.failure.reason != "nondeterminism":
        violations.append(Violation(invariant="L6", task_id=waiting,
                                    detail=f"live resume: {state.status} {state.failure}"))
    if deliveries_after != deliveries_before:
        violations.append(Violation(invariant="L6", task_id=waiting,
                                    detail="the diverged code acted"))
    more, effects = await check_everything(ledgered)
    report("L6", violations + more, tasks=2, effects=effects,
           divergence=None if diverged.divergence is None else
           f"{diverged.divergence.kind} at seq {diverged.divergence.seq}, fork at "
           f"{diverged.divergence.fork_point}",
           quarantined=state.failure.reason if state.failure else None)


STATUSES = list(Status)
WALK = {
    Status.QUEUED: [],
    Status.RUNNING: [Status.RUNNING],
    Status.CHECKPOINTED: [Status.RUNNING, Status.CHECKPOINTED],
    Status.WAITING: [Status.RUNNING, Status.WAITING],
    Status.RESUMING: [Status.RUNNING, Status.RESUMING],
    Status.COMPLETED: [Status.RUNNING, Status.COMPLETED],
    Status.FAILED: [Status.FAILED],
}
"""A legal walk from QUEUED to each status, one hop per UPDATE."""


@pytest.mark.timeout(120)
async def test_l7_every_status_move_checked_by_engine_and_database(ledgered: Engine) -> None:
    """Exhaustive (status x status): the engine's rule and the database trigger accept
    exactly the legal moves of the state machine, and agree with each other."""
    violations: list[Violation] = []
    counter = itertools.count()
    for source, target in itertools.product(STATUSES, STATUSES):
        legal = (source, target) in TRANSITIONS
        try:
            check_path(source, [target], "l7")
            engine_says = True
        except IllegalTransition:
            engine_says = False
        task_id = f"l7-{next(counter)}"
        await ledgered.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": False},
                              task_id=task_id)
        for hop in WALK[source]:
            await ledgered.database.fetch("UPDATE wal_tasks SET status = $2 WHERE task_id = $1",
                                          task_id, str(hop))
        try:
            await ledgered.database.fetch("UPDATE wal_tasks SET status = $2 WHERE task_id = $1",
                                          task_id, str(target))
            database_says = True
        except IllegalTransition:
            database_says = False
        if source == target:
            # Staying put is no move: the database sees no status change at all.
            database_says = legal
        if engine_says != legal or database_says != legal:
            violations.append(Violation(
                invariant="I9", detail=f"{source} -> {target}: legal {legal}, engine "
                                       f"{engine_says}, database {database_says}"))
    report("L7", violations, tasks=len(STATUSES) ** 2, moves_checked=len(STATUSES) ** 2,
           legal_moves=len(TRANSITIONS))
