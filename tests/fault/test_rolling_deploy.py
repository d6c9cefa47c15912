"""A rolling deploy with real worker processes (issue 17): version 1 workers run, version 2
workers start, version 1 workers are stopped with SIGTERM, over tasks that wait on timers
and signals across the deploy while version 2 adds a call, removes one and changes
arguments behind ``ctx.patched`` (see :mod:`tests.fault.deploy_agents`)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from tests.fault import deploy_agents as agents
from tests.fault.conftest import REPO
from tests.fault.support import report
from wal_engine.engine import Engine, connect
from wal_engine.runtime.replayer import check_tasks
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.testing.crash import advance_timers
from wal_engine.testing.invariants import Violation
from wal_engine.testing.ledger import check_effects
from wal_engine.testing.processes import WorkerPool, WorkerProcess, wait_until

V1_TASKS: dict[str, dict[str, Any]] = {
    "sig": {"wait": "signal"}, "timer": {"wait": "timer", "sleep_s": 600.0},
    "held": {"wait": "signal", "gate": True}}
"""Version 1's tasks, four of each: waiting on a signal across the whole deploy, sleeping
through it (the test makes their timers due once version 1 is gone, as the clock would), and
held inside a call by the gate while their version 1 worker is stopped."""
V2_TASKS: dict[str, dict[str, Any]] = {
    "v2sig": {"wait": "signal"}, "v2timer": {"wait": "timer", "sleep_s": 0.3}}
PER_GROUP = 4
EFFECTS_BY_TASK = """
SELECT task_id, tool, deliveries, applied, owners FROM wal_test_effects ORDER BY key LIMIT $1
"""
WAITED = """
SELECT count(DISTINCT task_id) AS n FROM wal_events
 WHERE task_id = ANY($1::text[]) AND type IN ('timer_started', 'signal_awaited')
"""
CLAIMS = """
SELECT task_id, payload FROM wal_events
 WHERE type IN ('task_claimed', 'task_resumed') ORDER BY task_id, seq LIMIT $1
"""


@pytest_asyncio.fixture
async def engines(database_dsn: str) -> AsyncIterator[tuple[Engine, Engine]]:
    """The submitters of each version (a task records the version its submitter runs)."""
    v1 = await connect(database_dsn, migrate=False)
    v2 = await connect(database_dsn, migrate=False)
    agents.register_v1(v1)
    agents.register_v2(v2)
    await agents.prepare_tables(v1)
    try:
        yield v1, v2
    finally:
        await v1.close()
        await v2.close()


async def _submit(engine: Engine, groups: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Submit PER_GROUP tasks of each group; task id -> group."""
    tasks: dict[str, str] = {}
    for group, options in groups.items():
        for n in range(PER_GROUP):
            task_id = await engine.submit(agents.AGENT, {"n": n + 1, **options},
                                          task_id=f"{group}-{n}")
            tasks[task_id] = group
    return tasks


async def _statuses(engine: Engine, task_ids: list[str]) -> list[Status]:
    return [(await engine.head(task_id)).status for task_id in task_ids]


async def _all(engine: Engine, task_ids: list[str], wanted: frozenset[Status]) -> bool:
    return all(status in wanted for status in await _statuses(engine, task_ids))


async def _waited(engine: Engine, task_ids: list[str]) -> bool:
    """Every task reached its wait (a timer may already have fired: its task may have gone
    on, on version 1, which the checks allow)."""
    rows = await engine.database.fetch(WAITED, task_ids)
    return int(rows[0]["n"]) == len(task_ids)


async def _held(engine: Engine, count: int) -> bool:
    rows = await engine.database.fetch(
        "SELECT count(*) AS n FROM deploy_flags WHERE name LIKE 'inside:%'")
    return int(rows[0]["n"]) >= count


async def _deploy(engine: Engine, tasks: dict[str, str], v1: list[WorkerProcess],
                  v2_pool: WorkerPool) -> list[int]:
    """Version 1's tasks all waiting or held; start version 2, SIGTERM version 1, open the
    gate; returns version 1's exit codes."""
    of = {group: [t for t, g in tasks.items() if g == group] for group in V1_TASKS}
    await wait_until(lambda: _waited(engine, of["sig"] + of["timer"]), "v1 tasks waiting", 20)
    await wait_until(lambda: _held(engine, PER_GROUP), "held tasks inside prepare", 20)
    await asyncio.gather(*(v2_pool.spawn(f"v2-{n}") for n in range(2)))
    for worker in v1:
        worker.kill(signal.SIGTERM)
    await engine.database.fetch(agents.INSIDE_GATE, agents.OPEN_GATE)
    return [await worker.exited(20) for worker in v1]


def _replay_cli(dsn: str, spec: str) -> tuple[int, Any]:
    """``wal-engine replay --all`` against ``spec``'s code: exit status and JSON lines."""
    done = subprocess.run(
        [sys.executable, "-m", "wal_engine.cli", "replay", "--all", "--finished", "100",
         "--agents", spec, "--dsn", dsn, "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    lines = [orjson.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, (lines, done.stderr)


def _branch_violations(task_id: str, state: Any, effects: dict[str, set[str]]
                       ) -> list[Violation]:
    """The effects and the output match the branches the task's history records."""
    patches = set(state.patches)
    tools = effects.get(task_id, set())
    wrong = []
    if ("notify" in tools) == ("drop-notify" in patches):
        wrong.append(f"notify {'ran' if 'notify' in tools else 'missing'} with patches "
                     f"{sorted(patches)}")
    if ("receipt" in tools) != ("add-receipt" in patches) or \
            ("receipt" in state.output) != ("add-receipt" in patches):
        wrong.append(f"receipt does not match patches {sorted(patches)}")
    currency = state.output["charged"]["currency"]
    if (currency == "EUR") != ("charge-eur" in patches):
        wrong.append(f"charged in {currency} with patches {sorted(patches)}")
    return [Violation(invariant="deploy", task_id=task_id, detail=d) for d in wrong]


def _expected_patches(group: str, patches: set[str]) -> str | None:
    """What went wrong with ``group``'s patches, if anything."""
    if group.startswith("v2"):
        return None if patches == set(agents.PATCHES) else "a v2 task skipped a patch"
    if "drop-notify" in patches and group != "held":
        return "a v1 task that waited on v1 took v2's branch before its wait"
    if patches & set(agents.AFTER_WAIT) != set(agents.AFTER_WAIT):
        return "a v1 task woken on v2 after the deploy ran v1's second half"
    return None


@pytest.mark.timeout(120)
async def test_rolling_deploy_v1_to_v2_over_waiting_tasks(
        database_dsn: str, engines: tuple[Engine, Engine], fault_log_dir: Path) -> None:
    """v1 workers, then v2 workers, then SIGTERM to v1, over tasks waiting on timers and
    signals: each task completes on the code its history calls for, no effect repeats, and
    the deploy gate passes v2 and refuses v2 written without its patches."""
    v1_engine, v2_engine = engines
    v1_pool = WorkerPool(database_dsn, "tests.fault.deploy_agents:setup_v1", fault_log_dir,
                         cwd=REPO, lease_ttl_ms=1500, heartbeat_ms=250)
    v2_pool = WorkerPool(database_dsn, "tests.fault.deploy_agents:setup_v2", fault_log_dir,
                         cwd=REPO, lease_ttl_ms=1500, heartbeat_ms=250)
    try:
        v1 = list(await asyncio.gather(*(v1_pool.spawn(f"v1-{n}") for n in range(2))))
        tasks = await _submit(v1_engine, V1_TASKS)
        exits = await _deploy(v1_engine, tasks, v1, v2_pool)
        tasks.update(await _submit(v2_engine, V2_TASKS))
        await advance_timers(v2_engine)
        for task_id, group in tasks.items():
            if "sig" in group or group == "held":
                await v2_engine.signal(task_id, "go", {"by": "deploy-test"})
        await wait_until(lambda: _all(v2_engine, list(tasks), TERMINAL), "every task", 45, 0.1)
    finally:
        v1_pool.close()
        v2_pool.close()
    violations, figures = await _check_outcomes(v2_engine, tasks)
    violations += await check_effects(v2_engine.database, completed_tools=agents.TOOLS)
    gate = await check_tasks(v2_engine, finished_sample=100)
    if not gate.ok:
        # A task that ended wrongly also diverges at the gate: name how each ended, and its
        # whole log (pytest would cut an assertion's message short).
        lines = [f"outcome violations: {violations}"]
        for divergent in gate.divergent:
            lines += [f"{divergent.task_id}: {divergent.divergence}",
                      *await _history(v2_engine, divergent.task_id)]
        pytest.fail("\n".join(lines), pytrace=False)
    assert gate.checked == len(tasks), gate
    code, (lines, stderr) = _replay_cli(database_dsn,
                                        "tests.fault.deploy_agents:register_v2_unpatched")
    summary = lines[-1] if lines else {}
    assert code == 1 and not summary.get("ok", True), (code, stderr)
    refused = set(summary["divergent"])
    # Every task whose notify ran on v1 is named; none of v2's own (their histories hold
    # the markers, and the unpatched code takes the same branches).
    assert {t for t, g in tasks.items() if g == "sig"} <= refused
    assert refused <= {t for t, g in tasks.items() if not g.startswith("v2")}
    assert exits == [0, 0], [w.output()[-2000:] for w in v1]
    report("deploy", violations, tasks=len(tasks), **figures, v1_exit_codes=exits,
           gate_checked=gate.checked, unpatched_refused=len(refused))


async def _history(engine: Engine, task_id: str) -> list[str]:
    """A task's events, one short line each, for a failure message."""
    return [f"{e.seq} {e.type} {e.epoch} {bytes(e.payload)[:200]!r}"
            for e in await engine.store.read_events(task_id, from_seq=1, limit=200)]


async def _check_outcomes(engine: Engine, tasks: dict[str, str]
                          ) -> tuple[list[Violation], dict[str, Any]]:
    """Every task completed on the right code: its version, patches, effects and workers."""
    effects: dict[str, set[str]] = {}
    owners: dict[str, set[str]] = {}
    for row in await engine.database.fetch(EFFECTS_BY_TASK, 10_000):
        effects.setdefault(row["task_id"], set()).add(row["tool"])
        if row["tool"] in ("charge", "receipt"):
            owners.setdefault(row["task_id"], set()).update(row["owners"])
    claimers: dict[str, set[str]] = {}
    for row in await engine.database.fetch(CLAIMS, 10_000):
        claimers.setdefault(row["task_id"], set()).add(orjson.loads(row["payload"])["worker_id"])
    resumes = {(r["task_id"], r["reason"]): r for r in await engine.database.fetch(
        "SELECT * FROM deploy_resumes WHERE new_version LIMIT 1000")}
    violations: list[Violation] = []
    mixed = 0
    for task_id, group in tasks.items():
        state = await engine.state(task_id)
        if state.status is not Status.COMPLETED:
            violations.append(Violation(invariant="I8", task_id=task_id,
                                        detail=f"{state.status}: {state.failure}"))
            continue
        version = "2" if group.startswith("v2") else "1"
        wrong = _expected_patches(group, set(state.patches))
        if state.agent_version != version or wrong:
            violations.append(Violation(invariant="deploy", task_id=task_id,
                                        detail=f"version {state.agent_version}: {wrong}"))
        violations += _branch_violations(task_id, state, effects)
        if version == "2" and any(w.startswith("v1-") for w in claimers[task_id]):
            violations.append(Violation(invariant="deploy", task_id=task_id,
                                        detail="a v1 worker claimed a v2 task"))
        if version == "1" and not (
                owners.get(task_id, set()) <= {"v2-0", "v2-1"}
                and (task_id, "woken") in resumes):
            violations.append(Violation(invariant="deploy", task_id=task_id,
                                        detail="its second half did not run on v2"))
        mixed += version == "1" and bool(set(state.patches))
    return violations, {"v1_tasks_finished_on_v2": mixed,
                        "held_released_to_v2": sum(r == "released" for _, r in resumes)}
