"""Agents for the effect-safety regression tests of issue 15, run by worker processes
(``python -m wal_engine.testing.worker DSN ID tests.fault.effect_agents:register``).

Every effect goes through a fake of the side-effect ledger, which counts attempts,
deliveries and applied effects per idempotency key in the test database.
"""

from __future__ import annotations

import time
from typing import Any, Final

from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.ledger import Behaviour, EffectLedger

REGISTER: Final = "tests.fault.effect_agents:register"
BLOCKING: Final = "blocking-charge"
LOOP_HOG: Final = "loop-hog"
ZOMBIE: Final = "zombie-charge"
CHARGE: Final = "charge-once"
CHARGE_LOOKUP: Final = "charge-with-lookup"
HOG_FUNCTION: Final = "hog_the_loop"
"""The agent-side function that blocks the loop (the stall's cause names it)."""


def _block(args: Any, attempt: int) -> Behaviour:
    """Block ``block_s`` before acting (every attempt: a retry must not double it)."""
    del attempt
    return Behaviour(outcome="block", sleep_s=float(args["block_s"]))


def hog_the_loop(seconds: float) -> int:
    """CPU-bound work on the event loop (a parse, a regex), for ``seconds``."""
    end, spins = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        spins += 1
    return spins


async def register(engine: Engine) -> None:
    """Register the effect-safety agents (their tools are non-idempotent ledger fakes)."""
    ledger = EffectLedger.for_engine(engine)
    await ledger.prepare()  # Sync fakes run their statements on this loop.
    blocking = ledger.service("blocking", kind="unsafe", result={"charged": True},
                              script=_block, sync=True)
    charge = ledger.service("charge", kind="unsafe", result={"charged": True})
    looked_up = ledger.service("charge-lookup", kind="lookup", result={"charged": True})

    @engine.agent(BLOCKING)
    async def blocking_charge(ctx: AgentContext, task_input: Any) -> Any:
        # A plain def blocking its thread longer than the lease; ensure_lease() guards
        # its irreversible part (the fakes call it right before they act).
        return await ctx.tool("blocking", blocking, task_input, idempotent=False,
                              on_uncertain=task_input.get("on_uncertain", "fail"))

    @engine.agent(LOOP_HOG)
    async def loop_hog(ctx: AgentContext, task_input: Any) -> Any:
        hog_the_loop(float(task_input["hog_s"]))
        return await ctx.tool("charge", charge, task_input, idempotent=False)

    @engine.agent(ZOMBIE)
    async def zombie_charge(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("blocking", blocking, task_input, idempotent=False,
                              on_uncertain="wait")

    @engine.agent(CHARGE)
    async def charge_once(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("charge", charge, task_input, idempotent=False)

    @engine.agent(CHARGE_LOOKUP)
    async def charge_with_lookup(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("charge-lookup", looked_up, task_input, idempotent=False,
                              lookup=ledger.lookup())
