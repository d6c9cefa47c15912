"""Record the golden histories: ``python -m tests.golden.record`` (needs PostgreSQL: an
embedded server is started, or ``WAL_ENGINE_TEST_DSN`` is borrowed).

Each history is one task's whole log as written by the code of the day it was recorded,
kept as a fixture that today's code must replay unchanged (RELIABILITY.md L5). Record new
ones when the vocabulary grows; never re-record an old one to make a test pass: only the
histories without a file yet are recorded (``python -m tests.golden.record NAME...`` names
them; an existing file is never overwritten).

The ``deployed_*`` histories are written by version 1 of :mod:`tests.fault.deploy_agents`
(and, for the one continued after a deploy, by version 2 with a failing hook and a lost
connection, so that ``patch_marked``, ``hook_failed`` and ``run_interrupted`` are in the
fixtures); today's version 2 must replay them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import asyncpg

from tests.fault import deploy_agents, ledger_agents
from wal_engine.cli import demo
from wal_engine.engine import Engine, connect
from wal_engine.runtime.hooks import HookEvent
from wal_engine.store import queries
from wal_engine.testing.crash import (
    crash_at,
    default_responder,
    drive_to_quiescence,
    expire_leases,
    run_worker_until_idle,
)
from wal_engine.testing.ledger import EffectLedger
from wal_engine.testing.postgres import DatabaseFactory, start_test_server
from wal_engine.testing.replay import dump_history

HISTORIES: Final = Path(__file__).resolve().parent / "histories"
DEMO_INPUT: Final = {"question": "Why write ahead?", "recipient": "ops@example.com"}


async def register_all(engine: Engine) -> None:
    """The agents the golden histories were recorded with."""
    demo.register(engine)
    await demo.prepare(engine)
    ledger_agents.register(engine)
    await EffectLedger.for_engine(engine).prepare()
    deploy_agents.register_v2(engine)
    await deploy_agents.prepare_tables(engine)


APPENDS: Final = (queries.OBSERVE_ONE, queries.OBSERVE_MANY, queries.TRANSITION,
                  queries.APPEND_MANY)


async def _deploy_engines(dsn: str) -> tuple[Engine, Engine]:
    """Version 1 of ``deployed``, and version 2 whose ``on_claim`` hook raises and whose
    first ``charge`` result is lost with the connection (its append fails before reaching
    the server, as when the socket drops: the run reads back, records the result again
    and ``run_interrupted``, and goes on under its lease)."""
    v1 = await connect(dsn, migrate=False)
    deploy_agents.register_v1(v1)
    await deploy_agents.prepare_tables(v1)
    v2 = await connect(dsn, migrate=False)
    services = deploy_agents.Services(v2)
    charge = services.charge
    drop_next_append: list[bool] = []
    fetch = v2.database.fetch

    async def charge_then_drop(args: Any) -> Any:
        result = await charge(args)
        if not drop_next_append:
            drop_next_append.append(True)
        return result

    async def dropping_fetch(query: str, *args: Any, **kwargs: Any) -> Any:
        if query in APPENDS and drop_next_append == [True]:
            drop_next_append.append(False)
            raise asyncpg.exceptions.ConnectionDoesNotExistError(
                "golden recording: the connection dropped before the append was sent")
        return await fetch(query, *args, **kwargs)

    def sandbox_gone(event: HookEvent) -> None:
        raise RuntimeError(f"sandbox for {event.task_id} is gone")

    services.charge = charge_then_drop
    v2.database.fetch = dropping_fetch  # type: ignore[method-assign]
    deploy_agents.register_v2(v2, services=services, on_claim=sandbox_gone)
    return v1, v2


async def _record_deployed(dsn: str, tasks: dict[str, str], wanted: set[str]) -> None:
    respond_go = {"go": {"approved_by": "golden"}}
    v1, v2 = await _deploy_engines(dsn)
    try:
        if "deployed_v1_waiting" in wanted:
            task = await v1.submit(deploy_agents.AGENT, {"n": 1, "wait": "signal"},
                                   task_id="golden-deployed-waiting")
            await run_worker_until_idle(v1, worker_id="golden-v1")
            tasks["deployed_v1_waiting"] = task
        if "deployed_v1_completed" in wanted:
            task = await v1.submit(deploy_agents.AGENT,
                                   {"n": 2, "wait": "timer", "sleep_s": 0.02},
                                   task_id="golden-deployed-v1")
            await drive_to_quiescence(v1, [task], worker_id="golden-v1")
            tasks["deployed_v1_completed"] = task
        if "deployed_v1_finished_on_v2" in wanted:
            task = await v1.submit(deploy_agents.AGENT, {"n": 3, "wait": "signal"},
                                   task_id="golden-deployed-v2")
            await run_worker_until_idle(v1, worker_id="golden-v1")
            await drive_to_quiescence(v2, [task], worker_id="golden-v2",
                                      responder=default_responder(v2, respond_go))
            tasks["deployed_v1_finished_on_v2"] = task
    finally:
        await v1.close()
        await v2.close()


DEPLOYED: Final = ("deployed_v1_waiting", "deployed_v1_completed",
                   "deployed_v1_finished_on_v2")


async def _crash_then_finish(engine: Engine, task_id: str, point: str, nth: int) -> None:
    with crash_at(point, nth):
        await run_worker_until_idle(engine, worker_id="golden-doomed")
    await expire_leases(engine)
    await drive_to_quiescence(engine, [task_id], worker_id="golden-survivor")


async def _record(engine: Engine, wanted: set[str]) -> dict[str, str]:
    respond = default_responder(engine, {"go": {"approved_by": "golden"}})
    recipes: dict[str, Callable[[], Awaitable[Any]]] = {}
    tasks: dict[str, str] = {}

    async def demo_completed() -> None:
        task = await engine.submit(demo.AGENT_NAME, DEMO_INPUT, task_id="golden-demo")
        await drive_to_quiescence(engine, [task], responder=respond, worker_id="golden")
        tasks["demo_completed"] = task

    async def demo_crash_recovered() -> None:
        task = await engine.submit(demo.AGENT_NAME, DEMO_INPUT, task_id="golden-demo-crash")
        await _crash_then_finish(engine, task, "after_effect_before_result", 2)
        await drive_to_quiescence(engine, [task], responder=respond, worker_id="golden")
        tasks["demo_crash_recovered"] = task

    async def demo_waiting_for_approval() -> None:
        task = await engine.submit(demo.AGENT_NAME, DEMO_INPUT, task_id="golden-demo-wait")
        await run_worker_until_idle(engine, worker_id="golden")
        tasks["demo_waiting_for_approval"] = task

    async def ledgered_timers_and_signals() -> None:
        task = await engine.submit(ledger_agents.AGENT, {"n": 2, "sleep_ms": 20, "wait": True},
                                   task_id="golden-ledgered")
        await drive_to_quiescence(engine, [task], responder=respond, worker_id="golden")
        tasks["ledgered_timers_and_signals"] = task

    async def ledgered_escalated() -> None:
        task = await engine.submit(ledger_agents.AGENT, {"n": 3, "sleep_ms": 0, "wait": False},
                                   task_id="golden-escalated")
        await _crash_then_finish(engine, task, "after_effect_before_result", 3)
        tasks["ledgered_escalated"] = task

    recipes.update(demo_completed=demo_completed, demo_crash_recovered=demo_crash_recovered,
                   demo_waiting_for_approval=demo_waiting_for_approval,
                   ledgered_timers_and_signals=ledgered_timers_and_signals,
                   ledgered_escalated=ledgered_escalated)
    for name, recipe in recipes.items():
        if name in wanted:
            await recipe()
    return tasks


RECIPES: Final = ("demo_completed", "demo_crash_recovered", "demo_waiting_for_approval",
                  "ledgered_timers_and_signals", "ledgered_escalated", *DEPLOYED)


async def main(names: list[str]) -> None:
    """Record the golden histories ``names`` (default: every one without a file yet) into
    ``histories/``; an existing file is never overwritten."""
    wanted = set(names) if names else {n for n in RECIPES
                                       if not (HISTORIES / f"{n}.jsonl").exists()}
    unknown = wanted - set(RECIPES)
    existing = {n for n in wanted if (HISTORIES / f"{n}.jsonl").exists()}
    if unknown or existing:
        raise SystemExit(f"unknown recipes {sorted(unknown)}; already recorded (never "
                         f"re-recorded) {sorted(existing)}")
    server = start_test_server()
    factory = DatabaseFactory(server)
    try:
        await factory.prepare()
        dsn = await factory.create()
        engine = await connect(dsn, migrate=False)
        try:
            await register_all(engine)
            tasks = await _record(engine, wanted)
            await _record_deployed(dsn, tasks, wanted)
            HISTORIES.mkdir(exist_ok=True)
            for name, task_id in tasks.items():
                records = await engine.history(task_id)
                dump_history(records, HISTORIES / f"{name}.jsonl")
                print(f"{name}: {len(records)} events, {records[-1].type}")
        finally:
            await engine.close()
        await factory.drop_all()
    finally:
        server.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
