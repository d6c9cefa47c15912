"""Durable Pydantic AI agents for the integration tests, also run by worker subprocesses
(``REGISTER``).

``calculator`` is a real Pydantic AI agent on ``FunctionModel``: the model asks for
``add(a, b)``, then ``multiply(sum, factor)``, then answers with a structured ``Answer``
(the output tool). Its replies are a pure function of the conversation, so a process that
resumes the task would get the same replies; on resume they come from the log anyway. The
tools reach the database through the run's ``deps`` (built from the task by the agent
function, in whichever process runs it) and record each execution in ``pa_tool_effects``:
one row per idempotency key (the effect, applied once) with a count of the times the tool
function ran with that key (deliveries) and the pid of the process that applied it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from wal_engine.engine import Engine
from wal_engine.integrations.pydantic_ai import WalDurability, current_context, run_agent
from wal_engine.runtime.context import AgentContext
from wal_engine.store import Database
from wal_engine.testing.processes import wait_until

REGISTER = "tests.integration.pydantic_ai_agents:register"
HOLD_ENV = "PA_TEST_HOLD_UNTIL"
"""A path: a worker process with it set finishes registering (and starts claiming tasks)
only once the file exists, so that a test can start a replacement worker early (its
imports take seconds) without it claiming the task meant for the first one."""
CALCULATOR = "pa-calculator"

CREATE_EFFECTS = """
CREATE TABLE IF NOT EXISTS pa_tool_effects (
    idempotency_key text PRIMARY KEY,
    task_id         text NOT NULL,
    tool            text NOT NULL,
    result          bigint NOT NULL,
    deliveries      integer NOT NULL,
    pid             integer NOT NULL
)
"""
APPLY_EFFECT = """
INSERT INTO pa_tool_effects (idempotency_key, task_id, tool, result, deliveries, pid)
VALUES ($1, $2, $3, $4, 1, $5)
ON CONFLICT (idempotency_key)
DO UPDATE SET deliveries = pa_tool_effects.deliveries + 1
RETURNING result
"""


class Question(msgspec.Struct, frozen=True):
    """The calculator's input: (a + b) * factor."""

    a: int
    b: int
    factor: int


class Answer(BaseModel):
    """The calculator's structured output."""

    value: int
    steps: list[str]


@dataclass
class Effects:
    """The run's dependencies: where the tools record what they do."""

    database: Database
    task_id: str


async def _apply(deps: Effects, tool: str, result: int) -> int:
    """Apply the effect once per idempotency key; a repeat returns the first result."""
    ctx = current_context()
    assert ctx is not None and ctx.idempotency_key is not None
    row = await deps.database.fetchrow(APPLY_EFFECT, ctx.idempotency_key, deps.task_id, tool,
                                       result, os.getpid())
    assert row is not None
    return int(row["result"])


def _returns(messages: list[ModelMessage]) -> dict[str, Any]:
    return {part.tool_name: part.content for message in messages
            if isinstance(message, ModelRequest) for part in message.parts
            if isinstance(part, ToolReturnPart)}


def _question(messages: list[ModelMessage]) -> dict[str, int]:
    first = messages[0]
    assert isinstance(first, ModelRequest)
    prompt = next(str(part.content) for part in first.parts if part.part_kind == "user-prompt")
    a, b, factor = (int(x) for x in prompt.split())
    return {"a": a, "b": b, "factor": factor}


def calculator_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The scripted model: add, then multiply, then the structured answer."""
    question = _question(messages)
    done = _returns(messages)
    if "add" not in done:
        return ModelResponse(parts=[ToolCallPart(
            "add", {"a": question["a"], "b": question["b"]}, tool_call_id="call-add")])
    if "multiply" not in done:
        return ModelResponse(parts=[ToolCallPart(
            "multiply", {"a": done["add"], "b": question["factor"]},
            tool_call_id="call-multiply")])
    output = info.output_tools[0].name
    return ModelResponse(parts=[
        TextPart("done"),
        ToolCallPart(output, {"value": done["multiply"], "steps": ["add", "multiply"]},
                     tool_call_id="call-final")])


def build_calculator() -> Agent[Effects, Answer]:
    """The calculator agent with its two tools, durable on wal-engine."""
    agent = Agent(FunctionModel(calculator_model), name="calculator", deps_type=Effects,
                  output_type=Answer, capabilities=[WalDurability()])

    @agent.tool
    async def add(ctx: RunContext[Effects], a: int, b: int) -> int:
        """Add two integers."""
        return await _apply(ctx.deps, "add", a + b)

    @agent.tool
    async def multiply(ctx: RunContext[Effects], a: int, b: int) -> int:
        """Multiply two integers."""
        return await _apply(ctx.deps, "multiply", a * b)

    return agent


async def register(engine: Engine) -> None:
    """Register the calculator (and create the effects table)."""
    await engine.database.fetch(CREATE_EFFECTS)
    hold = os.environ.get(HOLD_ENV)
    if hold:
        await wait_until(Path(hold).exists, f"{hold} to exist", 120)
    calculator = build_calculator()

    @engine.agent(CALCULATOR)
    async def calculate(ctx: AgentContext, question: Question) -> dict[str, Any]:
        deps = Effects(database=engine.database, task_id=ctx.task_id)
        result = await run_agent(ctx, calculator,
                                 f"{question.a} {question.b} {question.factor}", deps=deps)
        assert isinstance(result.output, Answer)
        return result.output.model_dump(mode="json")
