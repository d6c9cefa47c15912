"""The agent of the multi-host tests (tests/fault/test_hosts_netns.py), run by worker
processes inside network namespaces: ``tests.fault.host_agents:register``.

Each task makes an LLM call, an idempotent reservation, a booking in the engine's own
transaction and an unsafe notification, all counted by the side-effect ledger in the
database host. On the host whose worker has ``WAL_ENGINE_TEST_HOLD_FILE`` set, the
reservation waits, after marking that it is inside, until that file exists: the worker
holds its leases (renewed by its heartbeat) while the test cuts its host off.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Final

from wal_engine.engine import Engine
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.ledger import EffectLedger

AGENT: Final = "hosted"
HOLD_FILE_ENV: Final = "WAL_ENGINE_TEST_HOLD_FILE"
TOOLS: Final = {"h-llm": "llm", "h-reserve": "idem", "h-book": "db", "h-notify": "unsafe"}
hold_max_s: Final = 300.0


def inside_marker(hold_file: Path, n: int) -> Path:
    """The file a holding reservation of task input ``n`` creates once it is inside."""
    return hold_file.with_name(f"{hold_file.name}.inside-{n}")


def expected_output(n: int) -> dict[str, Any]:
    """What a task of input ``n`` returns."""
    return {"plan": {"echo": {"plan": n}}, "reserved": {"reserved": n},
            "booked": {"booked": n}, "sent": {"sent": n}}


def register(engine: Engine) -> None:
    """Register the ``hosted`` agent."""
    ledger = EffectLedger.for_engine(engine)
    llm = ledger.llm("h-llm")
    reserve = ledger.service("h-reserve", kind="idem", result=lambda a: {"reserved": a["n"]})
    book = ledger.transaction("h-book", result=lambda a: {"booked": a["n"]})
    notify = ledger.service("h-notify", kind="unsafe", result=lambda a: {"sent": a["n"]})
    held = os.environ.get(HOLD_FILE_ENV)
    hold_file = Path(held) if held else None
    # Retries must outlast a link that is down for a few seconds on the host that keeps
    # its lease; the other host's calls never meet the fault.
    patient = RetryPolicy(max_attempts=10, initial_delay_s=0.1, max_delay_s=1.0)

    async def held_reserve(args: Any) -> Any:
        if hold_file is not None:
            inside_marker(hold_file, int(args["n"])).touch()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + hold_max_s
            while not hold_file.exists() and loop.time() < deadline:
                await asyncio.sleep(0.02)
        return await reserve(args)

    @engine.agent(AGENT)
    async def hosted(ctx: AgentContext, task_input: Any) -> Any:
        n = int(task_input["n"])
        plan = await ctx.llm("h-llm", llm, {"plan": n}, retry=patient)
        reserved = await ctx.tool("h-reserve", held_reserve, {"n": n}, retry=patient)
        booked = await ctx.transaction("h-book", book, {"n": n})
        sent = await ctx.tool("h-notify", notify, {"n": n}, idempotent=False, retry=patient)
        return {"plan": plan, "reserved": reserved, "booked": booked, "sent": sent}
