"""A one-call agent whose call blocks inside the effect when run by the worker "zombie":
the in-process stand-in for a worker paused (SIGSTOP) in the middle of a side effect."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from wal_engine.context import AgentContext, current_call
from wal_engine.engine import Engine
from wal_engine.testing.ledger import EffectLedger

GATED: Final = "gated"
ZOMBIE: Final = "zombie"
KINDS: Final = ("idem", "lookup", "unsafe", "db")


def register_gated(engine: Engine, gate: asyncio.Event, inside: asyncio.Event) -> None:
    """Register ``gated``: input ``{"kind": idem|lookup|unsafe|db}``; the zombie's call sets
    ``inside`` and waits for ``gate`` before it reaches the fake service."""
    ledger = EffectLedger.for_engine(engine)
    services = {
        "idem": ledger.service("g-idem", kind="idem", result=lambda a: {"idem": a}),
        "lookup": ledger.service("g-lookup", kind="lookup", result=lambda a: {"lookup": a}),
        "unsafe": ledger.service("g-unsafe", kind="unsafe", result=lambda a: {"unsafe": a}),
    }
    transaction = ledger.transaction("g-db", result=lambda a: {"db": a})

    async def hold_if_zombie() -> None:
        claim = current_call()
        if claim is not None and claim.owner == ZOMBIE:
            inside.set()
            await gate.wait()

    @engine.agent(GATED)
    async def gated(ctx: AgentContext, task_input: Any) -> Any:
        kind = task_input["kind"]
        if kind == "db":
            async def act(connection: Any, args: Any) -> Any:
                await hold_if_zombie()
                return await transaction(connection, args)
            return await ctx.transaction("g-db", act, {"n": 1})

        async def call(args: Any) -> Any:
            await hold_if_zombie()
            return await services[kind](args)
        return await ctx.tool(f"g-{kind}", call, {"n": 1}, idempotent=kind == "idem",
                              lookup=ledger.lookup() if kind == "lookup" else None)
