"""The durable runner: the SDK's own agent loop over journaled model calls and tools.

:meth:`DurableRunner.run` takes the same arguments as the SDK's ``Runner.run`` and runs
inside a wal-engine agent function (``@engine.agent``). Before the loop starts, the agent
graph (the starting agent and every agent reachable through its handoffs) is copied with

* each model wrapped in a :class:`~.model.DurableModel` (a string or missing model is
  resolved through the run config's provider, wrapped in a
  :class:`~.model.DurableModelProvider`);
* each function tool's ``on_invoke_tool`` wrapped in ``ctx.tool``, keyed by the tool's
  name and the model's arguments and call id: the tool acts after its intent committed and
  a re-run gets its recorded output. The tool's output is recorded in its plain JSON form,
  and the SDK is handed that form live as on replay, so both see the same value;
* each handoff pointing at the copy of its target, so a handoff continues on journaled
  models and tools. The handoff itself is in the journaled model response; a handoff's
  ``on_handoff`` callback is part of the SDK's loop and runs again when the task's code
  runs again (after a wait or a crash): make its effects through a tool.

Tools run one at a time, in the order of the model's response
(``max_function_tool_concurrency=1``): the journal matches calls by their position, and
concurrent tools would reach it in an order that can change between runs.

Approvals: a tool with ``needs_approval`` interrupts the SDK run (its ``interruptions``).
The runner asks wal-engine for a decision on each interruption (``ctx.approval``, with the
tool's name and the model's arguments): the task waits durably (status WAITING) until
``engine.approve`` or ``wal-engine approve`` answers, then approves or rejects the call in
the SDK's run state and continues the SDK run. A rejection reaches the model as the SDK's
own rejection output. On a re-run the recorded decision is used again.

Tools the SDK runs on this machine without a function (computer, shell, apply-patch, local
shell) and MCP servers are refused with :class:`~wal_engine.errors.InvalidInput`: their
effects would not be journaled. Hosted tools (web search, file search, code interpreter,
hosted MCP, image generation) run inside the model's response and are journaled with it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from typing import Any, Final

import pydantic
from agents import (
    Agent,
    Handoff,
    RunConfig,
    Runner,
    RunResult,
    ToolOutputFileContent,
    ToolOutputImage,
    ToolOutputText,
)
from agents.models.interface import Model
from agents.models.multi_provider import MultiProvider
from agents.run_config import ToolExecutionConfig
from agents.tool import (
    CodeInterpreterTool,
    FileSearchTool,
    FunctionTool,
    HostedMCPTool,
    ImageGenerationTool,
    ValidToolOutputPydanticModelsTypeAdapter,
    WebSearchTool,
)
from agents.tool_context import ToolContext

from wal_engine.errors import InvalidInput, WalError
from wal_engine.integrations.openai_agents.model import (
    DurableModel,
    DurableModelProvider,
    model_label,
    plain,
)
from wal_engine.retries import DEFAULT_POLICY, RetryPolicy
from wal_engine.runtime.context import AgentContext

DEFAULT_MAX_TURNS: Final = 10
"""The SDK's own default for ``max_turns``."""
interruptions_max: Final = 100
"""Most rounds of approvals one run may go through (each round: the interruptions of one
SDK run); a bound on the loop, far above what a human answers in one task."""
_hosted_tools: Final = (FileSearchTool, WebSearchTool, CodeInterpreterTool, HostedMCPTool,
                        ImageGenerationTool)


class DurableRunner:
    """Runs SDK agents durably for the task of one wal-engine agent context."""

    def __init__(self, ctx: AgentContext, *, retry: RetryPolicy = DEFAULT_POLICY,
                 non_idempotent_tools: Collection[str] = (),
                 checkpoint_each_turn: bool = True) -> None:
        """Bind the runner to a task.

        Args:
            ctx: The ``ctx`` a wal-engine agent function receives.
            retry: Attempts and backoff of each model and tool call.
            non_idempotent_tools: Names of tools that must never be run twice: one left in
                doubt by a crash is escalated (the task fails, or waits per wal-engine's
                ``on_uncertain``) instead of being retried under its idempotency key.
            checkpoint_each_turn: Record a step boundary before each model call.

        Raises:
            InvalidInput: ``ctx`` is not a wal-engine agent context.
        """
        if not isinstance(ctx, AgentContext):
            raise InvalidInput(
                f"DurableRunner needs the ctx of a wal-engine agent function, not {ctx!r}")
        self.ctx = ctx
        self.retry = retry
        self.non_idempotent_tools = frozenset(non_idempotent_tools)
        self.checkpoint_each_turn = checkpoint_each_turn

    async def run(self, starting_agent: Agent[Any], input: str | list[Any], *,
                  context: Any = None, max_turns: int = DEFAULT_MAX_TURNS,
                  run_config: RunConfig | None = None) -> RunResult:
        """Run ``starting_agent`` on ``input`` to its final output, as ``Runner.run`` does,
        with model calls, tool calls and approvals journaled (see the module).

        Args:
            starting_agent: The SDK agent to start with.
            input: A user message, or a list of input items (plain JSON, as the SDK takes).
            context: The SDK run context handed to tools (not recorded: rebuild it the same
                way on every run, from the task's input).
            max_turns: The SDK's bound on model turns.
            run_config: The SDK's run configuration; its model provider is wrapped, and
                tools are run one at a time.

        Returns:
            The SDK's result of the finished run.

        Raises:
            InvalidInput: an argument the SDK or the journal cannot take (not an agent, an
                input that is neither text nor a list, a tool whose effects would not be
                journaled, tool concurrency above 1, ``max_turns`` below 1).
            WalError: more than ``interruptions_max`` rounds of approvals.
        """
        _check_arguments(starting_agent, input, max_turns)
        config = self._config(run_config)
        agent = _Graph(self, config).durable(starting_agent)
        result = await Runner.run(agent, input, context=context, max_turns=max_turns,
                                  run_config=config)
        for _ in range(interruptions_max):
            if not result.interruptions:
                return result
            state = result.to_state()
            for item in result.interruptions:
                raw = plain(item.raw_item)
                arguments = raw.get("arguments") if isinstance(raw, dict) else None
                call_id = raw.get("call_id") if isinstance(raw, dict) else None
                decision = await self.ctx.approval(
                    item.tool_name or "tool",
                    {"agent": item.agent.name, "call_id": call_id, "arguments": arguments})
                if decision.approved:
                    state.approve(item)
                else:
                    state.reject(item)
            result = await Runner.run(agent, state, context=context, max_turns=max_turns,
                                      run_config=config)
        raise WalError(f"the run went through {interruptions_max} rounds of approvals")

    def _config(self, run_config: RunConfig | None) -> RunConfig:
        """The run config with a journaled provider and model, tools one at a time."""
        config = run_config or RunConfig()
        execution = config.tool_execution
        concurrency = None if execution is None else execution.max_function_tool_concurrency
        if concurrency not in (None, 1):
            raise InvalidInput(
                "a durable run calls tools one at a time (the journal matches calls in"
                f" order): tool_execution.max_function_tool_concurrency={concurrency}")
        execution = dataclasses.replace(execution or ToolExecutionConfig(),
                                        max_function_tool_concurrency=1)
        provider = config.model_provider or MultiProvider()
        if not isinstance(provider, DurableModelProvider):
            provider = DurableModelProvider(self.ctx, provider,
                                            checkpoint_each_turn=self.checkpoint_each_turn)
        model = config.model
        if isinstance(model, Model) and not isinstance(model, DurableModel):
            model = self._model(model)
        return dataclasses.replace(config, model_provider=provider, model=model,
                                   tool_execution=execution)

    def _model(self, model: Model) -> DurableModel:
        return DurableModel(self.ctx, model, name=model_label(model),
                            checkpoint_each_turn=self.checkpoint_each_turn)

    def durable_tool(self, tool: FunctionTool) -> FunctionTool:
        """A copy of ``tool`` whose invocations are journaled ``ctx.tool`` calls."""
        invoke = tool.on_invoke_tool
        ctx, name = self.ctx, tool.name
        typed = tool.output_json_schema is not None

        async def journaled(tool_context: ToolContext[Any], arguments: str) -> Any:
            async def act(_args: Any) -> Any:
                return tool_output(await invoke(tool_context, arguments), typed=typed)

            args = {"arguments": arguments, "call_id": tool_context.tool_call_id}
            return await ctx.tool(name, act, args, retry=self.retry,
                                  idempotent=name not in self.non_idempotent_tools)

        return dataclasses.replace(tool, on_invoke_tool=journaled)


class _Graph:
    """Copies of the agents of one run, each agent copied once (handoffs may cycle)."""

    def __init__(self, runner: DurableRunner, config: RunConfig) -> None:
        self.runner = runner
        self.config = config
        self.copies: dict[int, Agent[Any]] = {}

    def durable(self, agent: Agent[Any]) -> Agent[Any]:
        """The journaled copy of ``agent`` (its handoffs' targets copied on the way)."""
        copy = self.copies.get(id(agent))
        if copy is not None:
            return copy
        if agent.mcp_servers:
            raise InvalidInput(
                f"agent {agent.name!r} has MCP servers, whose tool calls a durable run does"
                " not journal: wrap their tools as function tools")
        model = agent.model
        if isinstance(model, Model) and not isinstance(model, DurableModel):
            model = self.runner._model(model)
        copy = agent.clone(model=model, tools=[self._tool(agent, tool) for tool in agent.tools])
        self.copies[id(agent)] = copy
        copy.handoffs = [self._handoff(target) for target in agent.handoffs]
        return copy

    def _tool(self, agent: Agent[Any], tool: Any) -> Any:
        if isinstance(tool, FunctionTool):
            return self.runner.durable_tool(tool)
        if isinstance(tool, _hosted_tools):
            return tool
        raise InvalidInput(
            f"agent {agent.name!r}: tool {getattr(tool, 'name', tool)!r} ({type(tool).__name__})"
            " acts on this machine outside a function, so a durable run cannot journal it")

    def _handoff(self, target: Agent[Any] | Handoff[Any, Any]) -> Agent[Any] | Handoff[Any, Any]:
        if isinstance(target, Agent):
            return self.durable(target)
        if not isinstance(target, Handoff):
            raise InvalidInput(f"a handoff must be an Agent or a Handoff, not {target!r}")
        invoke = target.on_invoke_handoff

        async def to_copy(run_context: Any, arguments: str) -> Any:
            # The handoff itself is in the journaled model response; its target is the
            # journaled copy of the agent the SDK's handoff returns.
            return self.durable(await invoke(run_context, arguments))

        return dataclasses.replace(target, on_invoke_handoff=to_copy)


def tool_output(output: Any, *, typed: bool) -> Any:
    """A tool's output as the journal records it and the SDK gets it, live and on replay.

    The SDK turns an output into text with ``str`` unless it is structured (text, image or
    file content, or a list of them), so that is what is recorded: a dict recorded as
    such would come back with its keys in the database's order, and ``str`` of it, the
    model's next input, would differ between a live run and a replay. Structured outputs
    are recorded as plain JSON (the SDK validates them back into its models, whatever the
    key order); a tool with a declared output schema gets its output as JSON text.
    """
    if isinstance(output, str):
        return output
    if typed:
        return json.dumps(plain(output), ensure_ascii=False)
    items = output if isinstance(output, (list, tuple)) and output else [output]
    if all(_structured(item) for item in items):
        return plain(output)
    return str(output)


def _structured(item: Any) -> bool:
    """Whether the SDK takes ``item`` as structured content (not stringified)."""
    if isinstance(item, (ToolOutputText, ToolOutputImage, ToolOutputFileContent)):
        return True
    if not isinstance(item, dict) or "type" not in item:
        return False
    try:
        ValidToolOutputPydanticModelsTypeAdapter.validate_python(item)
    except pydantic.ValidationError:
        return False
    return True


def _check_arguments(agent: Any, input: Any, max_turns: Any) -> None:
    if not isinstance(agent, Agent):
        raise InvalidInput(f"DurableRunner.run needs an agents.Agent, not {agent!r}")
    if not isinstance(input, (str, list)):
        raise InvalidInput(
            f"the input must be a message or a list of input items, not {type(input).__name__}")
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise InvalidInput(f"max_turns must be a positive integer, not {max_turns!r}")
