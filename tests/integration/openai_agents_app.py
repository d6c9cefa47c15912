"""An OpenAI Agents SDK support desk for the durable-runner tests, with a scripted model.

Two agents: ``triage`` looks an order up and notes the request (two tools), then hands off
to ``refunds``, which issues the refund (a tool that may need approval) and answers. The
model is a real implementation of the SDK's ``Model`` interface that answers from what is
in its input (which agent asks, which tool outputs are there), never from a counter, so a
new process answers a resumed run exactly as the first one would have. Each tool appends
one line to the file named by ``OPENAI_AGENTS_EFFECTS`` when it acts: the tests count the
effects outside the worker process.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

from agents import Agent, RunConfig, function_tool
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from wal_engine.integrations.openai_agents import DurableRunner
from wal_engine.runtime.context import AgentContext

EFFECTS_ENV: Final = "OPENAI_AGENTS_EFFECTS"
AGENT: Final = "support-desk"
APPROVAL_AGENT: Final = "support-desk-approval"


def record_effect(line: str) -> None:
    """Append one effect line to the effects file (flushed before the tool returns)."""
    path = os.environ.get(EFFECTS_ENV)
    if path:
        with Path(path).open("a") as effects:
            effects.write(f"{line} pid={os.getpid()}\n")


@function_tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up."""
    record_effect(f"lookup_order {order_id}")
    return {"order_id": order_id, "total": 30, "status": "delivered"}


@function_tool
def add_note(text: str) -> str:
    """Note the customer's request on the ticket."""
    record_effect(f"add_note {text}")
    return f"noted: {text}"


def refund(order_id: str, amount: int) -> str:
    """Issue a refund."""
    record_effect(f"issue_refund {order_id} {amount}")
    return f"refund of {amount} issued for {order_id}"


issue_refund = function_tool(refund, name_override="issue_refund")
issue_refund_approved = function_tool(refund, name_override="issue_refund", needs_approval=True)


def _call(name: str, arguments: dict[str, Any], call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(type="function_call", name=name, call_id=call_id,
                                    arguments=json.dumps(arguments), id=f"fc_{call_id}")


def _message(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        type="message", id="msg_final", role="assistant", status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])])


def _outputs(items: str | list[Any]) -> dict[str, str]:
    """Tool outputs in the input, by call id."""
    if isinstance(items, str):
        return {}
    return {item["call_id"]: str(item["output"]) for item in items
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


class ScriptedModel(Model):
    """A support-desk model: its answer is a function of who asks and what it was told."""

    model = "scripted-desk"

    async def get_response(self, system_instructions: str | None, input: Any,
                           model_settings: Any, tools: Any, output_schema: Any,
                           handoffs: Any, tracing: Any, *, previous_response_id: Any,
                           conversation_id: Any, prompt: Any) -> ModelResponse:
        """The next step of the script."""
        outputs = _outputs(input)
        if system_instructions == "triage":
            if "c-lookup" not in outputs:
                output: list[Any] = [_call("lookup_order", {"order_id": "A17"}, "c-lookup"),
                                     _call("add_note", {"text": "wants a refund"}, "c-note")]
            else:
                output = [_call("transfer_to_refunds", {}, "c-handoff")]
        elif "c-refund" not in outputs:
            output = [_call("issue_refund", {"order_id": "A17", "amount": 30}, "c-refund")]
        else:
            output = [_message(f"Done: {outputs['c-refund']}")]
        usage = Usage(requests=1, input_tokens=100, output_tokens=20, total_tokens=120)
        return ModelResponse(output=output, usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Not used by these tests (the runner's non-streamed path)."""
        raise NotImplementedError("the scripted model answers get_response only")


def desk(*, approval: bool) -> Agent[Any]:
    """The triage agent, with its handoff to the refunds agent."""
    model = ScriptedModel()
    refunds = Agent(name="refunds", instructions="refunds", model=model,
                    tools=[issue_refund_approved if approval else issue_refund])
    return Agent(name="triage", instructions="triage", model=model,
                 tools=[lookup_order, add_note], handoffs=[refunds])


RUN_CONFIG: Final = RunConfig(tracing_disabled=True)


def register(engine: Any) -> None:
    """Register the two support-desk agents (plain and with an approved refund)."""

    @engine.agent(AGENT)
    async def support_desk(ctx: AgentContext, question: str) -> Any:
        result = await DurableRunner(ctx).run(desk(approval=False), question,
                                              run_config=RUN_CONFIG)
        return {"output": result.final_output, "last_agent": result.last_agent.name}

    @engine.agent(APPROVAL_AGENT)
    async def support_desk_approval(ctx: AgentContext, question: str) -> Any:
        result = await DurableRunner(ctx).run(desk(approval=True), question,
                                              run_config=RUN_CONFIG)
        return {"output": result.final_output, "last_agent": result.last_agent.name}
