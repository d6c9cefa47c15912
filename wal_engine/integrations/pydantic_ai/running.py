"""Running a durable Pydantic AI agent inside a wal-engine agent function."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wal_engine.errors import ConfigurationError
from wal_engine.integrations.pydantic_ai.durability import WalDurability, durable_scope

if TYPE_CHECKING:
    from pydantic_ai.agent import AbstractAgent
    from pydantic_ai.run import AgentRunResult

    from wal_engine.runtime.context import AgentContext


async def run_agent(ctx: AgentContext, agent: AbstractAgent[Any, Any], user_prompt: Any = None,
                    **options: Any) -> AgentRunResult[Any]:
    """Run ``agent`` as part of the task of ``ctx``: ``agent.run(user_prompt, **options)``
    with every model request and tool call journaled in the task's log.

    Call it from a function registered with ``engine.agent(name)``. Build ``deps`` (an
    option, as for ``agent.run``) from the task's input: they stay in this process, and a
    worker that resumes the task builds them again. The options must be the same on every
    run of the task (they shape the calls that are matched against the journal).

    Raises:
        ConfigurationError: ``agent`` does not carry :class:`WalDurability` (its calls would
            not be journaled, and would run again on every resume).
        ToolError: a model request or tool call failed for good.
    """
    if WalDurability.from_agent(agent) is None:
        raise ConfigurationError(
            f"agent {getattr(agent, 'name', None)!r} has no WalDurability capability: "
            "create it with Agent(..., capabilities=[WalDurability()])")
    with durable_scope(ctx):
        return await agent.run(user_prompt, **options)
