"""Agents for the gateway fault tests: HTTP tools sent through ``wal-engine gateway``.

``http_charges`` posts ``charges`` times to ``input["url"]`` with
:func:`wal_engine.gateway.client.http_tool`,
so each call carries its idempotency key as the ``Idempotency-Key`` header; the upstream
behind the gateway counts mutations per key. ``redis_effects`` acts through
:class:`~wal_engine.effects.gateway.IdempotencyGateway` on a Redis store (``input["redis"]``) and
counts its acts per key in ``gateway_acts``.
"""

from __future__ import annotations

from typing import Any, Final

from wal_engine.effects.gateway import IdempotencyGateway
from wal_engine.effects.redis_store import RedisGatewayStore
from wal_engine.engine import Engine
from wal_engine.gateway.client import http_tool
from wal_engine.runtime.context import AgentContext, current_call

ACTS_TABLE: Final = """
CREATE TABLE IF NOT EXISTS gateway_acts (key text PRIMARY KEY, acts integer NOT NULL)
"""
ACTED: Final = """
INSERT INTO gateway_acts VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET acts = gateway_acts.acts + 1
"""


async def register(engine: Engine) -> None:
    """Register the agents and create ``gateway_acts`` (the workers' register function)."""
    await engine.database.fetch(ACTS_TABLE)
    stores: dict[str, RedisGatewayStore] = {}

    @engine.agent("http_charges")
    async def http_charges(ctx: AgentContext, task_input: Any) -> Any:
        mutations = []
        for i in range(task_input["charges"]):
            async def charge(args: Any) -> Any:
                return await http_tool("POST", task_input["url"], json=args, timeout_s=10)

            answer = await ctx.tool(f"charge{i}", charge, {"i": i})
            mutations.append(answer["body"]["mutation"])
        return mutations

    @engine.agent("redis_effects")
    async def redis_effects(ctx: AgentContext, task_input: Any) -> Any:
        url = task_input["redis"]
        store = stores.get(url) or stores.setdefault(
            url, RedisGatewayStore.from_url(url, tenant=task_input["tenant"]))
        gateway = IdempotencyGateway(store=store)
        total = 0
        for i in range(task_input["tools"]):
            async def act(args: Any) -> Any:
                claim = current_call()
                assert claim is not None

                async def effect() -> Any:
                    await engine.database.fetch(ACTED, claim.key)
                    return args["i"] + 1

                return await gateway.run_once(claim, effect)

            total += await ctx.tool(f"act{i}", act, {"i": i})
        return total
