"""A one-call agent whose call blocks inside the effect when run by the worker "zombie":
the in-process stand-in for a worker paused (SIGSTOP) in the middle of a side effect."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext, current_call
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


async def zombie_round(engine: Engine, gate: asyncio.Event, inside: asyncio.Event,
                       task_id: str, *, timeout_s: float = 30.0) -> int:
    """One paused-zombie scenario on a submitted ``gated`` task; returns the zombie's epoch.

    The worker "zombie" runs the task and stops inside its effect; its lease is expired and
    broken; a rescuer worker takes the task over; then the zombie wakes up inside its effect.
    Every worker started here is stopped (or cancelled) before this returns, whatever
    happens: a worker left running would act and log into later tests.
    """
    from wal_engine.testing.crash import (
        FAST_TIMINGS,
        drive_to_quiescence,
        expire_leases,
        run_worker_until_idle,
    )

    gate.clear()
    inside.clear()
    # A paused worker does not heartbeat either: with a slow heartbeat the zombie does not
    # learn of its lost lease by itself, so its late writes must be refused by the database.
    zombie = engine.worker(concurrency=1, worker_id=ZOMBIE,
                           **{**FAST_TIMINGS, "heartbeat_ms": 10_000, "lease_ttl_ms": 30_000})
    zombie_run = asyncio.create_task(zombie.run())
    rescuer: asyncio.Task[Any] | None = None
    try:
        await asyncio.wait_for(inside.wait(), timeout_s)
        zombie_epoch = (await engine.head(task_id)).lease_epoch
        # The sweep skips a row another transaction holds (SKIP LOCKED): try until the
        # zombie's lease is broken, here or by a worker's own sweeper once it has expired:
        # the task has moved to a newer epoch, or (the D12 control whose sweeps keep the
        # epoch) the zombie no longer owns it.
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await expire_leases(engine, [task_id]):
            head = await engine.head(task_id)
            if head.lease_epoch > zombie_epoch or head.lease_owner != ZOMBIE:
                break
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the lease of {task_id} could not be broken")
            await asyncio.sleep(0.01)
        rescuer = asyncio.create_task(run_worker_until_idle(engine, worker_id="rescuer"))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not any(r.type == "task_resumed" and r.epoch > zombie_epoch
                      for r in await engine.history(task_id)):
            if rescuer.done() or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        gate.set()  # The zombie wakes up inside its effect.
        await asyncio.wait_for(asyncio.shield(rescuer), timeout_s)
    finally:
        gate.set()
        zombie.stop()  # The live zombie may have claimed the task again: it hands it back.
        for task in (zombie_run, rescuer):
            if task is None:
                continue
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except BaseException:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    await drive_to_quiescence(engine, [task_id])
    return zombie_epoch
