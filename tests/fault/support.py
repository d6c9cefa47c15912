"""Shared plumbing of the fault suite: figures, full invariant checks, the ledgered engine.

Every fault test ends with :func:`report`, which prints one line of figures named after the
matrix id (crash points tried, tasks, side effects counted, violations) and collects it for
the summary at the end of the session, then fails on a single violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final

from tests.fault import ledger_agents
from wal_engine.engine import Engine
from wal_engine.runtime.worker import Worker
from wal_engine.testing.invariants import (
    AckRecorder,
    Violation,
    assert_no_violations,
    check_acknowledged,
    check_snapshot,
    read_snapshot,
)
from wal_engine.testing.ledger import (
    READ_EFFECTS_IF_PRESENT,
    EffectLedger,
    LedgerTotals,
    check_effect_rows,
    effect_rows,
    totals,
)

REPO: Final = Path(__file__).resolve().parents[2]
LEDGERED: Final = "tests.fault.ledger_agents:register"
DEEP: Final = os.environ.get("RELIABILITY_DEEP") == "1"
DEEP_FULL: Final = os.environ.get("RELIABILITY_DEEP_FULL") == "1"
"""RELIABILITY.md's own deep counts (W4 5,000 kills, W1 2,000 crash points, D1 2,000
restarts, 3,000 crash-machine programs), which take hours on the project's 2-core machine."""


def deep_count(full: int, budget: int) -> int:
    """A deep test's count: ``budget``, sized so that the deep tier ends within its hour on
    the project's 2-core machine (docs/testing.md has the measured run), or RELIABILITY.md's
    ``full`` count with ``RELIABILITY_DEEP_FULL=1``."""
    return full if DEEP_FULL else budget

FIGURES: list[str] = []
"""Every figures line printed this session (the fault conftest prints them at the end)."""


def fault_seed(default: int = 1234) -> int:
    """The seed of a randomised schedule: ``WAL_ENGINE_FAULT_SEED`` / ``FAULT_SEED``."""
    text = os.environ.get("WAL_ENGINE_FAULT_SEED") or os.environ.get("FAULT_SEED")
    return int(text) if text else default


def rng(default: int = 1234) -> tuple[random.Random, int]:
    """A seeded random source and its seed."""
    seed = fault_seed(default)
    return random.Random(seed), seed


async def ledgered_engine(dsn: str, **options: Any) -> Engine:
    """An engine on ``dsn`` with the ledgered agent registered and its ledger ready."""
    from wal_engine.engine import connect

    engine = await connect(dsn, migrate=False, **options)
    ledger_agents.register(engine)
    await EffectLedger.for_engine(engine).prepare()
    return engine


async def check_everything(engine: Engine, *, acks: AckRecorder | None = None,
                           effects_query: str | None = None,
                           task_ids: Sequence[str] | None = None
                           ) -> tuple[list[Violation], LedgerTotals]:
    """Every invariant the database can tell (I1-I7, I9, I10, I13) and the ledger totals."""
    query = effects_query or READ_EFFECTS_IF_PRESENT
    snapshot = await read_snapshot(engine.database, task_ids, extra={"effects": query})
    rows = effect_rows(snapshot.extra["effects"])
    violations = check_snapshot(snapshot)
    violations += check_effect_rows(rows, snapshot.events, completed_tools=ledger_agents.TOOLS)
    if acks is not None:
        violations += await check_acknowledged(engine.database, acks.acknowledged)
    return violations, totals(rows)


def report(matrix_id: str, violations: Sequence[Violation], *, tasks: int,
           effects: LedgerTotals | None = None, crash_points: int | None = None,
           **figures: Any) -> None:
    """Print the figures of one fault test, then fail on a single violation."""
    parts = []
    if crash_points is not None:
        parts.append(f"crash points tried {crash_points}")
    parts.append(f"tasks {tasks}")
    if effects is not None:
        parts.append(f"side effects: {effects}")
    parts += [f"{name.replace('_', ' ')} {value}" for name, value in figures.items()]
    parts.append(f"violations {len(violations)}")
    line = f"{matrix_id}: " + ", ".join(parts)
    print(line)
    FIGURES.append(line)
    assert_no_violations(violations, matrix_id)


def expected_output(n: int, approval: Any = None) -> dict[str, Any]:
    """The ledgered agent's output for input ``n`` (crash-free)."""
    return {"plan": {"echo": {"plan": n}}, "reserved": {"reserved": n},
            "booked": {"booked": n}, "charged": {"charged": n * 10}, "approval": approval,
            "sent": {"sent": n}}


async def outcome_violations(engine: Engine, expected: dict[str, Any],
                             *, allow_escalated: bool = True) -> tuple[list[Violation], int]:
    """I8/I11 for tasks whose expected output is known: every task terminal with it (or
    FAILED as escalated after a crash, when allowed). Returns violations and escalations."""
    from wal_engine.testing.machine import allow_escalated as escalated_ok

    violations: list[Violation] = []
    escalated = 0
    for task_id, output in expected.items():
        state = await engine.state(task_id)
        if state.status is not None and str(state.status) == "COMPLETED" \
                and state.output == output:
            continue
        if allow_escalated and escalated_ok(state, await engine.history(task_id)):
            escalated += 1
            continue
        violations.append(Violation(
            invariant="I8" if state.terminal else "I11", task_id=task_id,
            detail=f"{state.status}: {state.output if state.failure is None else state.failure}"))
    return violations, escalated


@contextlib.asynccontextmanager
async def running_workers(engine: Engine, count: int, timings: dict[str, Any], *,
                          prefix: str = "w", concurrency: int = 4
                          ) -> AsyncIterator[list[Worker]]:
    """``count`` in-process workers running on ``engine``; stopped (or cancelled after
    30 s) when the block ends, so that none acts or logs into a later test."""
    workers = [engine.worker(concurrency=concurrency, worker_id=f"{prefix}{n}", **timings)
               for n in range(count)]
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()
        _, pending = await asyncio.wait(tasks, timeout=30)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
