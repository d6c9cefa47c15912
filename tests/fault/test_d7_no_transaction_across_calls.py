"""D7 / I12 (RELIABILITY.md): no transaction is held across a tool or LLM call.

A slow fake call samples ``pg_stat_activity`` while it is in flight: an engine backend
``idle in transaction`` at that moment would hold row locks (and a snapshot) for as long
as the call takes. The same probe first sees a transaction the test leaves open on
purpose, so it can fail.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import asyncpg
import pytest

from tests.fault.support import check_everything, report
from wal_engine.engine import connect
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.crash import run_worker_until_idle
from wal_engine.testing.invariants import Violation
from wal_engine.testing.ledger import EffectLedger

AGENT: Final = "d7"
SAMPLES_PER_CALL: Final = 3
CALL_S: Final = 0.06

IDLE_IN_TRANSACTION: Final = """
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND state LIKE 'idle in transaction%'
   AND pid <> pg_backend_pid()
"""


class Sampler:
    """Counts the backends idle in a transaction, from its own connection."""

    def __init__(self, connection: asyncpg.Connection) -> None:
        self.connection = connection
        self.lock = asyncio.Lock()
        self.samples = 0
        self.seen: list[tuple[str, int]] = []

    async def sample(self, call: str) -> None:
        """Look ``SAMPLES_PER_CALL`` times while the call ``call`` is in flight."""
        for _ in range(SAMPLES_PER_CALL):
            async with self.lock:  # One connection: one statement at a time.
                idle = int(await self.connection.fetchval(IDLE_IN_TRANSACTION))
            self.samples += 1
            if idle:
                self.seen.append((call, idle))
            await asyncio.sleep(CALL_S / SAMPLES_PER_CALL)


@pytest.mark.timeout(180)
async def test_d7_no_transaction_is_held_across_a_call(database_dsn: str) -> None:
    """12 tasks, 4 at a time, each with an idempotent tool, a non-idempotent tool and an LLM
    call: while any call is in flight, no engine backend is idle in a transaction."""
    probe = await asyncpg.connect(database_dsn)
    sampler = Sampler(probe)
    control = await asyncpg.connect(database_dsn)
    try:
        # The control: a transaction left open is seen, so a zero below means something.
        async with control.transaction():
            await control.fetchval("SELECT 1")
            await sampler.sample("control")
        assert sampler.seen and sampler.seen[0][0] == "control", sampler.seen
        sampler.seen.clear()

        engine = await connect(database_dsn, migrate=False)
        try:
            await EffectLedger.for_engine(engine).prepare()  # check_everything reads it
            @engine.agent(AGENT)
            async def d7(ctx: AgentContext, task_input: Any) -> Any:
                async def call(kind: str) -> Any:
                    await sampler.sample(f"{ctx.task_id}:{kind}")
                    return {kind: task_input["n"]}

                async def tool(args: Any) -> Any:
                    return await call(args["kind"])

                async def llm(request: Any) -> Any:
                    return await call("llm")

                first = await ctx.tool("idem", tool, {"kind": "idem"})
                await ctx.checkpoint(next_action="unsafe")
                second = await ctx.tool("unsafe", tool, {"kind": "unsafe"}, idempotent=False)
                third = await ctx.llm("fake-model", llm, {"prompt": "hi"})
                return [first, second, third]

            tasks = [await engine.submit(AGENT, {"n": n}, task_id=f"d7-{n}") for n in range(12)]
            await run_worker_until_idle(engine, worker_id="d7", concurrency=4)
            states = [await engine.state(task_id) for task_id in tasks]
            violations, _ = await check_everything(engine)
        finally:
            await engine.close()
    finally:
        await control.close()
        await probe.close()
    violations += [Violation(invariant="I12", task_id=call.split(":")[0],
                             detail=f"{idle} backend(s) idle in transaction during {call}")
                   for call, idle in sampler.seen]
    violations += [Violation(invariant="I11", task_id=s.task_id, detail=f"{s.status}")
                   for s in states if s.status != "COMPLETED"]
    report("D7/I12", violations, tasks=len(tasks), calls=len(tasks) * 3,
           samples=sampler.samples, control_seen=True)
