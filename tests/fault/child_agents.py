"""The agents of the child-task fault test (``python -m wal_engine.testing.worker DSN ID
tests.fault.child_agents:register``): a parent that fans out to children, each of which
makes one tool call (where a worker armed with ``during_effect:1:sigkill`` dies)."""

from __future__ import annotations

from typing import Any, Final

from wal_engine.engine import Engine

REGISTER: Final = "tests.fault.child_agents:register"
CHILDREN: Final = 3


def register(engine: Engine) -> None:
    """Register ``fan_parent`` (spawns CHILDREN ``fan_child`` tasks and sums their
    results) and ``fan_child`` (one tool call, then its input doubled)."""

    @engine.agent("fan_child")
    async def fan_child(ctx: Any, value: Any) -> Any:
        async def double(n: int) -> int:
            return n * 2

        return await ctx.tool("double", double, value["n"])

    @engine.agent("fan_parent")
    async def fan_parent(ctx: Any, value: Any) -> Any:
        handles = [await ctx.spawn("fan_child", {"n": n}) for n in range(1, CHILDREN + 1)]
        return sum(await ctx.gather(*handles))
