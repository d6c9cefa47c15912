"""D12 negative controls: break a safety mechanism on purpose, run the same harness, and
require it to report the violation. A harness that cannot fail proves nothing; each of
these tests passes only when the harness finds what the sabotage caused."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import asyncpg
import pytest

from tests.fault import ledger_agents
from tests.fault.gated import GATED, KINDS, register_gated, zombie_round
from tests.fault.support import FIGURES, check_everything, rng
from tests.fault.test_d_database_faults import (
    _engine_with_own_ledger,
    _restart,
    _submit,
    _workers,
)
from wal_engine.dsn import Dsn
from wal_engine.engine import Engine, connect
from wal_engine.store.connection import schema_sql
from wal_engine.testing.invariants import AckRecorder, Violation, summarise
from wal_engine.testing.ledger import EffectLedger
from wal_engine.testing.postgres import DatabaseFactory, TestServer


def report_control(control: str, violations: Sequence[Violation], expected: set[str],
                   **figures: Any) -> None:
    """Print the control's figures; fail unless the harness reported an expected violation."""
    found = summarise(violations)
    extra = ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in figures.items())
    line = (f"D12 {control}: violations reported {len(violations)} {found}"
            + (f", {extra}" if extra else "") + " (the control passes only when > 0)")
    print(line)
    FIGURES.append(line)
    assert expected & found.keys(), (
        f"negative control {control!r}: the harness reported no {sorted(expected)} violation "
        f"(found {found}): it cannot detect this fault")


def _function(sql: str, name: str) -> str:
    """The CREATE [OR REPLACE] FUNCTION statement of ``name`` in ``schema.sql``."""
    match = re.search(rf"CREATE (?:OR REPLACE )?FUNCTION {name}\(.*?\n\$\$;\n", sql, re.S)
    assert match is not None, f"{name} not found in schema.sql"
    return match.group(0).replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def unfenced_functions() -> str:
    """Test-only replacements of the claim and sweep functions that keep the lease epoch:
    the fencing token never moves, so a zombie writes and acts as the new owner."""
    sql = schema_sql()
    claim = _function(sql, "wal_claim_tasks").replace(
        "new_epoch := due.lease_epoch + 1;", "new_epoch := due.lease_epoch;")
    sweep = _function(sql, "wal_break_leases").replace(
        "stale.lease_epoch + 1", "stale.lease_epoch")
    assert "lease_epoch + 1" not in claim + sweep
    return claim + sweep


async def _zombie_rounds(engine: Engine, gate: asyncio.Event, inside: asyncio.Event,
                         rounds: int, kinds: Sequence[str] = KINDS) -> None:
    """The W6 scenario: a worker paused inside its effect, its lease broken, a rescuer."""
    for n in range(rounds):
        task_id = await engine.submit(GATED, {"kind": kinds[n % len(kinds)], "n": n},
                                      task_id=f"c-{n}")
        await zombie_round(engine, gate, inside, task_id)


@pytest.mark.timeout(120)
async def test_d12_fencing_disabled_is_reported(database_dsn: str) -> None:
    """With claims and sweeps that never bump the epoch (test-only function replacement),
    the paused-zombie scenario makes the harness report I3/I7 (two owners, one epoch)."""
    admin = await asyncpg.connect(database_dsn)
    await admin.execute(unfenced_functions())
    await admin.close()
    engine = await connect(database_dsn, migrate=False)
    gate, inside = asyncio.Event(), asyncio.Event()
    register_gated(engine, gate, inside)
    await EffectLedger.for_engine(engine).prepare()
    try:
        # Service kinds only: with the fence gone, the zombie's open transaction of the
        # db kind and the rescuer's wait on its key can block each other until the timeout.
        await _zombie_rounds(engine, gate, inside, 3, kinds=("idem", "lookup", "unsafe"))
        violations, effects = await check_everything(engine)
    finally:
        gate.set()
        await engine.close()
    report_control("fencing disabled", violations, {"I3", "I7"}, tasks=3, side_effects=effects)


DROP_UNIQUE = "ALTER TABLE wal_events DROP CONSTRAINT wal_events_pkey"


@pytest.mark.timeout(120)
async def test_d12_unique_task_seq_dropped_is_reported(database_dsn: str) -> None:
    """With UNIQUE (task_id, seq) dropped, the paused-zombie scenario (fencing intact)
    makes the harness report I2: an observation is fenced by the key alone, so the zombie's
    late append lands on a seq the new owner already wrote."""
    admin = await asyncpg.connect(database_dsn)
    await admin.execute(DROP_UNIQUE)
    await admin.close()
    engine = await connect(database_dsn, migrate=False)
    gate, inside = asyncio.Event(), asyncio.Event()
    register_gated(engine, gate, inside)
    await EffectLedger.for_engine(engine).prepare()
    try:
        await _zombie_rounds(engine, gate, inside, 8)
        violations, effects = await check_everything(engine)
    finally:
        gate.set()
        await engine.close()
    report_control("unique (task, seq) dropped", violations, {"I2"}, tasks=8,
                   side_effects=effects)


@pytest.mark.timeout(300)
async def test_d12_synchronous_commit_off_loses_acknowledged_events(
        crashable: tuple[TestServer, DatabaseFactory]) -> None:
    """D1 with synchronous_commit=off: immediate stops lose acknowledged appends, and the
    harness reports I1."""
    server, factory = crashable
    random_source, seed = rng()
    dsn = await factory.create()
    name = Dsn.parse(dsn).database
    admin = await asyncpg.connect(server.admin_dsn)
    await admin.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    await admin.close()
    engine, ledger_db = await _engine_with_own_ledger(dsn, require_synchronous_commit=False)
    acks = AckRecorder()
    acks.install(engine)
    restarts = 0
    lost: list[Violation] = []
    try:
        expected = await _submit(engine, "async", 60)
        async with _workers(engine, 2):
            while restarts < 30:
                await asyncio.sleep(random_source.uniform(0.05, 0.3))
                await _restart(server)
                restarts += 1
                lost = await _lost(engine, acks)
                if lost:
                    break
        # What the check saw right after the restart counts: a run that continues in place
        # may write a lost event again, identical, before the end (then the log is whole
        # again, and only the check at the moment of the loss could tell).
        violations, _ = await _settle_and_check(engine, acks)
        violations = lost + violations
    finally:
        await engine.close()
        await ledger_db.close()
    report_control("synchronous_commit off", violations, {"I1"}, tasks=len(expected),
                   restarts=restarts, seed=seed, acknowledged_appends=len(acks.acknowledged))


async def _lost(engine: Engine, acks: AckRecorder) -> list[Violation]:
    from wal_engine.testing.invariants import check_acknowledged

    for _ in range(50):
        try:
            return await check_acknowledged(engine.database, acks.acknowledged)
        except Exception:
            await asyncio.sleep(0.1)
    return []


async def _settle_and_check(engine: Engine, acks: AckRecorder) -> tuple[list[Violation], Any]:
    for _ in range(50):
        try:
            return await check_everything(engine, acks=acks)
        except Exception:
            await asyncio.sleep(0.1)
    return await check_everything(engine, acks=acks)


__all__ = ["ledger_agents"]
