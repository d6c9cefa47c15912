"""Agents and tools for the fault tests: effects counted per idempotency key in a table.

``fault_effects`` holds one row per key: ``deliveries`` counts how often the callee was
reached, ``applied`` how often it really acted (through the idempotency gateway, so at most
once per key), ``owners`` which workers reached it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from typing import Any, Final

from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext, current_call

EFFECTS_TABLE: Final = """
CREATE TABLE IF NOT EXISTS fault_effects (
    key        text PRIMARY KEY,
    tool       text NOT NULL,
    deliveries integer NOT NULL DEFAULT 0,
    applied    integer NOT NULL DEFAULT 0,
    owners     text[] NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS fault_flags (name text PRIMARY KEY)
"""
DELIVERED: Final = """
INSERT INTO fault_effects (key, tool, deliveries, owners) VALUES ($1, $2, 1, ARRAY[$3])
ON CONFLICT (key) DO UPDATE SET deliveries = fault_effects.deliveries + 1,
                                owners = fault_effects.owners || $3
"""
APPLIED: Final = "UPDATE fault_effects SET applied = applied + 1 WHERE key = $1"
FLAG_SET: Final = "SELECT 1 FROM fault_flags WHERE name = $1"
ZOMBIE_WORKER: Final = "zombie"


def big_text(index: int, size: int) -> str:
    """``size`` characters of base64 of pseudo-random bytes (an image): the same for the same
    ``index`` in every process, incompressible beyond base64's own redundancy."""
    raw = hashlib.shake_256(b"big-value-%d" % index).digest(size * 3 // 4 + 3)
    return base64.b64encode(raw).decode()[:size]


def register(engine: Engine) -> None:
    """Register the fault-test agents on ``engine``."""
    database = engine.database

    async def effect(tool: str, result: Any, latency_s: float = 0.0) -> Any:
        claim = current_call()
        assert claim is not None
        await database.fetch(DELIVERED, claim.key, tool, claim.owner)
        if latency_s:
            await asyncio.sleep(latency_s)  # The remote service's latency.

        async def act(connection: Any) -> Any:
            # The fake service's effect commits with its dedup record: exactly once per key.
            await connection.execute(APPLIED, claim.key)
            return result

        return await engine.gateway.run_in_transaction(claim, act)

    async def gated(args: dict[str, Any]) -> Any:
        """Blocks the zombie worker until the test raises the flag, then acts."""
        claim = current_call()
        assert claim is not None
        if claim.owner == ZOMBIE_WORKER:
            await database.fetch("INSERT INTO fault_flags VALUES ('zombie-inside') "
                                 "ON CONFLICT DO NOTHING")
            while not await database.fetch(FLAG_SET, "release-zombie"):
                await asyncio.sleep(0.02)
        return await effect("gated", args["n"])

    @engine.agent("steps")
    async def steps(ctx: AgentContext, task_input: Any) -> Any:
        total = 0
        latency_s = task_input.get("latency_ms", 0) / 1000
        for i in range(task_input.get("tools", 3)):
            total += await ctx.tool(f"t{i}", lambda a, i=i: effect(f"t{i}", i + 1, latency_s),
                                    {"i": i})
            await ctx.checkpoint(next_action=f"t{i + 1}")
        return total

    @engine.agent("big_values")
    async def big_values(ctx: AgentContext, task_input: Any) -> Any:
        """Tools returning large values (decision 61): each result's digest as seen by the
        code, live or replayed from the log after a crash."""
        digests = []
        for i in range(task_input.get("tools", 2)):
            text = await ctx.tool(
                f"b{i}", lambda a, i=i: effect(f"b{i}", big_text(i, task_input["bytes"])),
                {"i": i})
            digests.append(hashlib.sha256(text.encode()).hexdigest())
            await ctx.checkpoint(next_action=f"b{i + 1}")
        return digests

    async def hog(args: dict[str, Any]) -> Any:
        """A service whose first answer is huge (``mib`` MiB built in memory, then held),
        and small afterwards: the worker that receives it is OOM-killed (W8)."""
        claim = current_call()
        assert claim is not None
        flag = f"hogged:{claim.key}"
        first = await database.fetch("INSERT INTO fault_flags VALUES ($1) "
                                     "ON CONFLICT DO NOTHING RETURNING name", flag)
        if first:
            huge = b"h" * (args["mib"] << 20)  # Touches every page: the RSS grows with it.
            await asyncio.sleep(30)  # Held until the memory watchdog kills the process.
            return len(huge)
        return await effect("hog", args["mib"])

    @engine.agent("hog")
    async def hog_agent(ctx: AgentContext, task_input: Any) -> Any:
        first = await ctx.tool("before", lambda a: effect("before", 1), {})
        await ctx.checkpoint(next_action="hog")
        size = await ctx.tool("hog", hog, {"mib": task_input["mib"]})
        return first + size

    @engine.agent("zombie_target")
    async def zombie_target(ctx: AgentContext, task_input: Any) -> Any:
        first = await ctx.tool("first", lambda a: effect("first", 1), {})
        second = await ctx.tool("gated", gated, {"n": 2})
        third = await ctx.tool("third", lambda a: effect("third", 3), {})
        return first + second + third

    @engine.agent("sleepy")
    async def sleepy(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.tool("before", lambda a: effect("before", 1), {})
        await ctx.sleep(task_input["sleep_s"])
        payload = await ctx.wait_for_signal("go")
        await ctx.tool("after", lambda a: effect("after", 2), {})
        return payload


async def prepare(engine: Engine) -> None:
    """Create the effect-count tables."""
    await engine.database.fetch(EFFECTS_TABLE.split(";")[0])
    await engine.database.fetch(EFFECTS_TABLE.split(";")[1])


async def setup(engine: Engine) -> None:
    """Register the agents and prepare their tables (the fault workers' register function,
    ``tests.fault.agents:setup``)."""
    register(engine)
    await prepare(engine)
