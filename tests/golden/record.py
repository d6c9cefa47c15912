"""Record the golden histories: ``python -m tests.golden.record`` (needs PostgreSQL: an
embedded server is started, or ``WAL_ENGINE_TEST_DSN`` is borrowed).

Each history is one task's whole log as written by the code of the day it was recorded,
kept as a fixture that today's code must replay unchanged (RELIABILITY.md L5). Record new
ones when the vocabulary grows; never re-record an old one to make a test pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from tests.fault import ledger_agents
from wal_engine import demo
from wal_engine.engine import Engine, connect
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


async def _crash_then_finish(engine: Engine, task_id: str, point: str, nth: int) -> None:
    with crash_at(point, nth):
        await run_worker_until_idle(engine, worker_id="golden-doomed")
    await expire_leases(engine)
    await drive_to_quiescence(engine, [task_id], worker_id="golden-survivor")


async def _record(engine: Engine) -> dict[str, str]:
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
    for recipe in recipes.values():
        await recipe()
    return tasks


async def main() -> None:
    """Record every golden history into ``histories/``."""
    server = start_test_server()
    factory = DatabaseFactory(server)
    try:
        await factory.prepare()
        dsn = await factory.create()
        engine = await connect(dsn, migrate=False)
        try:
            await register_all(engine)
            tasks = await _record(engine)
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
    asyncio.run(main())
