"""An agent using every tool class of the side-effect ledger, for the fault suite.

``register`` is importable by worker subprocesses
(``python -m wal_engine.testing.worker DSN ID tests.fault.ledger_agents:register``).
"""

from __future__ import annotations

from typing import Any, Final

from wal_engine.engine import Engine
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.ledger import EffectLedger

AGENT: Final = "ledgered"
TOOLS: Final = {"fake-llm": "llm", "reserve": "idem", "book": "db", "charge": "lookup",
                "notify": "unsafe"}


def register(engine: Engine) -> None:
    """Register the ``ledgered`` agent: LLM, T-idem, T-db, T-lookup, T-unsafe, sleep, signal."""
    # The fakes keep their counts in the database the faults restart: a fake's own pooled
    # connections die with it and fail one delivery each. A run now goes on in place after
    # a lost connection (no lease expiry in between), so the backoff, not the lease TTL,
    # must span a restart: up to ~3 s over 8 attempts. The LLM call too: with the default
    # policy (3 attempts, ~1.5 s) a restart slowed by a loaded machine failed a D1 task.
    _register(engine, RetryPolicy(max_attempts=8, initial_delay_s=0.05, max_delay_s=1.0))


def register_failover(engine: Engine) -> None:
    """The ``ledgered`` agent for a database that fails over to a standby: the fakes keep
    their counts on the cluster, so their calls fail for as long as no node accepts writes
    (about the leader key's TTL, 10 s, when a leader is lost). Their backoff spans ~40 s."""
    _register(engine, RetryPolicy(max_attempts=45, initial_delay_s=0.1, max_delay_s=1.0))


def _register(engine: Engine, quick: RetryPolicy) -> None:
    ledger = EffectLedger.for_engine(engine)
    llm = ledger.llm("fake-llm")
    reserve = ledger.service("reserve", kind="idem", result=lambda a: {"reserved": a["n"]})
    book = ledger.transaction("book", result=lambda a: {"booked": a["n"]})
    charge = ledger.service("charge", kind="lookup", result=lambda a: {"charged": a["n"] * 10})
    notify = ledger.service("notify", kind="unsafe", result=lambda a: {"sent": a["n"]})

    @engine.agent(AGENT)
    async def ledgered(ctx: AgentContext, task_input: Any) -> Any:
        n = int(task_input["n"])
        plan = await ctx.llm("fake-llm", llm, {"plan": n}, retry=quick)
        reserved = await ctx.tool("reserve", reserve, {"n": n}, retry=quick)
        await ctx.checkpoint(next_action="book")
        booked = await ctx.transaction("book", book, {"n": n})
        if task_input.get("sleep_ms"):
            await ctx.sleep(task_input["sleep_ms"] / 1000)
        charged = await ctx.tool("charge", charge, {"n": n}, idempotent=False,
                                 lookup=ledger.lookup(), retry=quick)
        approval = None
        if task_input.get("wait"):
            approval = await ctx.wait_for_signal("go")
        await ctx.checkpoint(next_action="notify")
        sent = await ctx.tool("notify", notify, {"n": n}, idempotent=False, retry=quick)
        await ctx.message("assistant", f"done {n}")
        return {"plan": plan, "reserved": reserved, "booked": booked, "charged": charged,
                "approval": approval, "sent": sent}


FLAKY: Final = "flaky"


def register_flaky(engine: Engine) -> None:
    """The ledgered agent plus ``flaky``: one idempotent call whose first delivery fails, then
    a backoff of 1-2 s (in memory) before the retry."""
    register(engine)
    ledger = EffectLedger.for_engine(engine)
    service = ledger.service("flaky-call", kind="idem", result=lambda a: {"ok": a["n"]},
                             fail_first=1)
    slow_retry = RetryPolicy(max_attempts=3, initial_delay_s=2.0, max_delay_s=2.0)

    @engine.agent(FLAKY)
    async def flaky(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("flaky-call", service, {"n": task_input["n"]}, retry=slow_retry)
