"""K3 (RELIABILITY.md, deep tier): the database's own clock jumps.

Leases are decided by the database clock (K1, K2 show that a worker's clock does not
matter), so here PostgreSQL itself runs under libfaketime, its clock driven by a file the
test writes (P26: ``now()`` follows the file live).

* Forward by twice the lease TTL, five times while tasks run: every live lease looks
  expired, other workers' sweepers break them early, and fencing makes that safe: the old
  owners' writes are refused, every effect acts once, every task finishes.
* Back by an hour: a worker that dies then is reclaimed late, by at most the jump
  (documented in RELIABILITY.md): its task is not taken over while the clock is behind, and
  is as soon as the clock is put right.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import asyncpg
import pytest

from tests.fault import ledger_agents
from tests.fault.support import (
    check_everything,
    expected_output,
    ledgered_engine,
    outcome_violations,
    report,
)
from tests.fault.test_d_database_faults import _all_done, _workers
from tests.fault.test_k_clock_faults import faketime_env, needs_faketime
from wal_engine.embedded import EmbeddedPostgres
from wal_engine.engine import Engine, connect
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.crash import crash_at, run_worker_until_idle
from wal_engine.testing.ledger import EffectLedger
from wal_engine.testing.processes import wait_until

LEASE_TTL_MS: Final = 2000
FORWARD_JUMPS: Final = 5


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment, for the children started meanwhile."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _clock_dir() -> tuple[Path, Path]:
    """A directory the server's account can read, holding the clock file at +0."""
    root = Path(tempfile.mkdtemp(prefix="wal-k3-"))
    root.chmod(0o755)
    clock = root / "faketime"
    _set_clock(clock, "+0\n")
    clock.chmod(0o644)
    return root, clock


def _set_clock(clock: Path, offset: str) -> None:
    """Move the server's clock: libfaketime rereads the file on every call (P26)."""
    clock.write_text(offset)


def _read_clock(clock: Path) -> str:
    return clock.read_text().strip()


async def _orphans(engine: Engine) -> int:
    rows = await engine.database.fetch(
        "SELECT count(*) AS n FROM wal_events WHERE type = 'task_orphaned'")
    return int(rows[0]["n"])


@needs_faketime
@pytest.mark.deep
@pytest.mark.timeout(600)
async def test_k3_database_clock_jumps() -> None:
    """The database clock jumps forward (2x TTL, 5 times) and back (1 h)."""
    root, clock = _clock_dir()
    server = EmbeddedPostgres(root / "pgdata", fsync=False)
    with _environment(faketime_env(timestamp_file=clock)):
        dsn = await asyncio.to_thread(server.ensure_running)
    try:
        admin = await asyncpg.connect(dsn)
        before = await admin.fetchval("SELECT now()")
        _set_clock(clock, "+1h\n")
        after = await admin.fetchval("SELECT now()")
        _set_clock(clock, "+0\n")
        await admin.close()
        assert (after - before).total_seconds() > 3000, "the server's clock is not faked"
        await (await connect(dsn)).close()  # The schema.
        engine = await ledgered_engine(dsn)
        register_slow(engine)
        try:
            forward = await _forward_jumps(engine, clock)
            broken_early = await _orphans(engine)
            backward = await _backward_jump(engine, clock)
            violations, effects = await check_everything(engine)
            outcomes, escalated = await outcome_violations(engine, {**forward, **backward})
        finally:
            await engine.close()
    finally:
        await asyncio.to_thread(server.stop, "immediate")
        shutil.rmtree(root, ignore_errors=True)
    report("K3", violations + outcomes, tasks=len(forward) + len(backward), effects=effects,
           forward_jumps=FORWARD_JUMPS, leases_broken_early=broken_early,
           backward_jump="1h", takeover_delayed=True, escalated=escalated)
    assert broken_early > 0  # The forward jumps really expired live leases.


SLOW_AGENT: Final = "k3-slow"
SLOW_CALLS: Final = 5


def register_slow(engine: Engine) -> None:
    """``k3-slow``: five idempotent calls, each 300 ms inside its effect (lease held)."""
    service = EffectLedger.for_engine(engine).service(
        "k3-call", kind="idem", result=lambda args: {"n": args["n"]})

    @engine.agent(SLOW_AGENT)
    async def slow(ctx: AgentContext, task_input: Any) -> Any:
        total = 0
        for call in range(SLOW_CALLS):
            async def act(args: Any) -> Any:
                await asyncio.sleep(0.3)  # The remote service's latency.
                return await service(args)
            total += (await ctx.tool(f"call-{call}", act, {"n": task_input["n"]}))["n"]
        return total


async def _forward_jumps(engine: Engine, clock: Path) -> dict[str, Any]:
    """Tasks run on two workers while the clock jumps 2x TTL ahead, five times."""
    expected = {}
    for n in range(12):
        task_id = await engine.submit(SLOW_AGENT, {"n": n}, task_id=f"k3f-{n}")
        expected[task_id] = n * SLOW_CALLS
    offset_s = 0
    # Heartbeats as rare as R6 allows and sweeps frequent: after a jump, a sweeper usually
    # sees an expired lease before its owner renews it.
    async with _workers(engine, 2, lease_ttl_ms=LEASE_TTL_MS, heartbeat_ms=LEASE_TTL_MS // 3,
                        sweep_ms=50):
        for _ in range(FORWARD_JUMPS):
            await asyncio.sleep(0.4)
            offset_s += 2 * LEASE_TTL_MS // 1000
            _set_clock(clock, f"+{offset_s}s\n")
        await wait_until(lambda: _all_done(engine, list(expected)), "every task", 120, 0.1)
    _set_clock(clock, f"+{offset_s}s\n")  # Stays ahead: time does not go back here.
    return expected


async def _backward_jump(engine: Engine, clock: Path) -> dict[str, Any]:
    """A worker dies after the clock went back an hour: no takeover until it is put right."""
    current = _read_clock(clock)
    task_id = await engine.submit(ledger_agents.AGENT, {"n": 3, "sleep_ms": 0, "wait": False},
                                  task_id="k3b")
    with crash_at("after_intent_commit", 1) as crash:
        await run_worker_until_idle(engine, worker_id="k3-doomed", lease_ttl_ms=LEASE_TTL_MS,
                                    heartbeat_ms=300, sweep_ms=100)
    assert crash.fired
    _set_clock(clock, "-1h\n")  # The dead worker's lease now ends an hour from "now".
    orphans = await _orphans(engine)
    async with _workers(engine, 1, lease_ttl_ms=LEASE_TTL_MS, heartbeat_ms=300):
        await asyncio.sleep(3 * LEASE_TTL_MS / 1000)
        delayed = await _orphans(engine) == orphans
        _set_clock(clock, f"{current}\n")  # Put right: the stale lease is an hour overdue.
        await wait_until(lambda: _all_done(engine, [task_id]), "the takeover", 60, 0.1)
    if not delayed:
        raise AssertionError("the lease was broken while the database clock was behind")
    return {task_id: expected_output(3)}

