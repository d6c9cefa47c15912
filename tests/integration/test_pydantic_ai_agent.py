"""Durable Pydantic AI agents (WalDurability): journaled model and tool calls, a worker
process SIGKILLed mid-run and resumed in another, structured output, typed errors."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip(
    "pydantic_ai.durable_exec",
    reason="the [pydantic-ai] extra is not installed: pip install 'wal-engine[pydantic-ai]'",
)

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import AgentStreamEvent
from pydantic_ai.models.test import TestModel

from tests.integration import pydantic_ai_agents as agents
from wal_engine.engine import Engine
from wal_engine.errors import ConfigurationError, InvalidInput
from wal_engine.integrations.pydantic_ai import CONFIG_KEY, WalDurability, run_agent
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.crash import (
    crash_at,
    expire_leases,
    run_crash_free,
    run_worker_until_idle,
)
from wal_engine.testing.processes import WorkerPool, wait_until
from wal_engine.testing.replay import assert_replay_equivalent

REPO = Path(__file__).resolve().parents[2]
QUESTION = {"a": 2, "b": 3, "factor": 7}
ANSWER = {"value": 35, "steps": ["add", "multiply"]}


@pytest.fixture
def pool(database_dsn: str, tmp_path: Path) -> Iterator[WorkerPool]:
    """Worker processes running the calculator, lease 1 s."""
    workers = WorkerPool(database_dsn, agents.REGISTER, tmp_path, cwd=REPO,
                         lease_ttl_ms=1000, heartbeat_ms=200, poll_ms=50)
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture
async def calculator(engine: Engine) -> Engine:
    """The test's engine with the calculator registered."""
    await agents.register(engine)
    return engine


async def _effects(engine: Engine, task_id: str) -> list[dict[str, Any]]:
    rows = await engine.database.fetch(
        "SELECT tool, result, deliveries, pid FROM pa_tool_effects WHERE task_id = $1"
        " ORDER BY tool", task_id)
    return [dict(row) for row in rows]


async def _calls(engine: Engine, task_id: str) -> list[tuple[str, str]]:
    """The journaled calls in order: (event type, model or tool name)."""
    calls = []
    for record in await engine.history(task_id):
        if record.type in ("llm_call_intended", "tool_call_intended"):
            payload = orjson.loads(record.payload)
            calls.append((record.type, payload.get("model") or payload["tool"]))
    return calls


async def test_agent_with_two_tools_journals_model_and_tool_calls(calculator: Engine) -> None:
    """A FunctionModel agent with two tools completes; the history holds its three model
    requests as llm calls and its two tool calls as tool calls, each tool acted once."""
    state = await run_crash_free(calculator, agents.CALCULATOR, QUESTION)
    assert str(state.status) == "COMPLETED"
    assert state.output == ANSWER
    model = "calculator__model.request"
    tools = "calculator__function_toolset__<agent>.call_tool"
    assert await _calls(calculator, state.task_id) == [
        ("llm_call_intended", model), ("tool_call_intended", f"{tools}:add"),
        ("llm_call_intended", model), ("tool_call_intended", f"{tools}:multiply"),
        ("llm_call_intended", model)]
    assert [(row["tool"], row["result"], row["deliveries"])
            for row in await _effects(calculator, state.task_id)] == [
        ("add", 5, 1), ("multiply", 35, 1)]
    assert state.usage.input_tokens > 0 and state.usage.output_tokens > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("failpoint", "add_deliveries", "multiplied_by"), [
    # The add tool (tool call 1) applied its effect; the worker dies before the result is
    # recorded: the resumed run calls add again under the same idempotency key, which the
    # tool dedups on, and multiply runs in the new process.
    ("after_effect_before_result:1:sigkill", 2, "survivor"),
    # The multiply result (tool call 2) is committed; the worker dies right after: the
    # resumed run gets both tool results and the model responses before them from the log
    # and runs neither tool again.
    pytest.param("after_result_commit:2:sigkill", 1, "doomed", marks=[
        pytest.mark.deep, pytest.mark.skipif(
            os.environ.get("RELIABILITY_DEEP") != "1",
            reason="deep tier (RELIABILITY_DEEP=1): two more worker processes, ~10 s")]),
])
async def test_worker_killed_mid_run_resumes_in_a_new_process(
        calculator: Engine, pool: WorkerPool, tmp_path: Path, failpoint: str,
        add_deliveries: int, multiplied_by: str) -> None:
    """SIGKILL of the worker process mid-run; a new process finishes the task: each tool's
    effect applied once, the output equal to a crash-free run's, the takeover recorded."""
    crash_free = await run_crash_free(calculator, agents.CALCULATOR, QUESTION)
    gate = tmp_path / "survivor-may-claim"
    doomed = pool.start("doomed", failpoint=failpoint)
    survivor = pool.start("survivor", env={agents.HOLD_ENV: str(gate)})
    await doomed.ready()
    task_id = await calculator.submit(agents.CALCULATOR, QUESTION)
    assert await doomed.exited() == -9, doomed.output()
    gate.touch()
    head = await wait_until(lambda: _finished(calculator, task_id), "the resumed task", 60)
    assert str(head.status) == "COMPLETED", survivor.output()

    state = await calculator.state(task_id)
    assert state.output == crash_free.output
    effects = await _effects(calculator, task_id)
    assert [(row["tool"], row["result"]) for row in effects] == [("add", 5), ("multiply", 35)]
    assert [row["deliveries"] for row in effects] == [add_deliveries, 1]
    pids = {"doomed": doomed.process.pid, "survivor": survivor.process.pid}
    assert [row["pid"] for row in effects] == [pids["doomed"], pids[multiplied_by]]
    types = [record.type for record in await calculator.history(task_id)]
    assert types.count("task_orphaned") == 1 and types.count("task_claimed") == 1
    assert types.count("tool_call_completed") == 2
    assert (await calculator.store.verify_task(task_id)).ok


async def _finished(engine: Engine, task_id: str) -> Any:
    head = await engine.head(task_id)
    return head if str(head.status) in ("COMPLETED", "FAILED") else None


async def test_structured_output_round_trips_through_the_log(calculator: Engine) -> None:
    """The structured Answer comes back equal when today's code replays the recorded history,
    with no model request and no tool call made."""
    async def deliveries() -> int:
        row = await calculator.database.fetchrow(
            "SELECT coalesce(sum(deliveries), 0) AS n FROM pa_tool_effects")
        return int(row["n"])

    report = await assert_replay_equivalent(calculator, agents.CALCULATOR, QUESTION,
                                            count_effects=deliveries)
    # The agent function asserts that result.output is an Answer, live and in the replay.
    assert (report.outcome, report.output_matches) == ("completed", True)
    assert report.calls_replayed == report.calls_recorded == 5
    output = (await calculator.state(report.task_id)).output
    assert agents.Answer.model_validate(output) == agents.Answer(**ANSWER)


async def test_bad_input_is_refused_before_anything_is_written(calculator: Engine) -> None:
    """A submission that does not fit the agent's input type raises InvalidInput and leaves
    no task behind."""
    with pytest.raises(InvalidInput):
        await calculator.submit(agents.CALCULATOR, {"a": "two", "b": 3, "factor": 7})
    rows = await calculator.database.fetch("SELECT count(*) AS n FROM wal_tasks")
    assert rows[0]["n"] == 0


async def test_an_agent_without_wal_durability_fails_with_a_typed_error(engine: Engine) -> None:
    """run_agent refuses an agent whose calls would not be journaled (ConfigurationError),
    and the task fails with that error before any model request."""
    plain = Agent(TestModel(), name="plain")

    @engine.agent("plain")
    async def run_plain(ctx: AgentContext, prompt: str) -> str:
        return str((await run_agent(ctx, plain, prompt)).output)

    with pytest.raises(ConfigurationError):
        await run_agent(_NoContext(), plain, "hi")  # type: ignore[arg-type]
    state = await run_crash_free(engine, "plain", "hi")
    assert str(state.status) == "FAILED"
    assert state.failure is not None and "WalDurability" in str(state.failure)
    assert await _calls(engine, state.task_id) == []


async def test_a_result_that_cannot_be_journaled_fails_the_call_once(engine: Engine) -> None:
    """A tool returning a value Pydantic AI's JSON codec cannot encode fails its call with
    UnserializableValue, recorded once and not retried, and the task fails."""
    agent = Agent(TestModel(), name="opaque", capabilities=[WalDurability()])
    runs: list[int] = []

    @agent.tool_plain
    def handle() -> Any:
        """Return something that is not JSON."""
        runs.append(1)
        return object()

    @engine.agent("opaque")
    async def opaque(ctx: AgentContext, prompt: str) -> str:
        return str((await run_agent(ctx, agent, prompt)).output)

    state = await run_crash_free(engine, "opaque", "go")
    assert str(state.status) == "FAILED"
    failed = [orjson.loads(r.payload) for r in await engine.history(state.task_id)
              if r.type == "tool_call_failed"]
    assert [f["error_type"] for f in failed] == ["UnserializableValue"]
    assert runs == [1]


class _NoContext:
    """Stands where an agent context goes: run_agent must refuse before touching it."""


class Reply(BaseModel):
    """A structured reply with a nested model."""

    title: str
    scores: list[float]


async def test_event_stream_handler_gets_each_tool_event_once(engine: Engine) -> None:
    """TestModel with a tool and an event stream handler: model events arrive live from the
    journaled model call, each tool event in a journaled call of its own; a replay of the
    history delivers none again."""
    seen: list[str] = []

    async def handler(_ctx: Any, events: Any) -> None:
        async for event in events:
            seen.append(_kind(event))

    agent = Agent(TestModel(), name="streamer", output_type=Reply,
                  capabilities=[WalDurability(event_stream_handler=handler)])

    @agent.tool_plain
    def lookup(key: str) -> str:
        """Look a key up."""
        return f"value of {key}"

    @engine.agent("streamer")
    async def stream(ctx: AgentContext, prompt: str) -> dict[str, Any]:
        result = await run_agent(ctx, agent, prompt)
        return result.output.model_dump(mode="json")

    report = await assert_replay_equivalent(engine, "streamer", "go")
    assert (report.outcome, report.output_matches) == ("completed", True)
    output = (await engine.state(report.task_id)).output
    assert Reply.model_validate(output).scores == output["scores"]
    # Live and replay together: every event once (the replay delivered none again).
    assert seen == ["part_start", "part_end", "function_tool_call", "function_tool_result",
                    "part_start", "final_result", "part_end", "output_tool_call",
                    "output_tool_result"]
    tools = [name for kind, name in await _calls(engine, report.task_id)
             if kind == "tool_call_intended"]
    handled = [name for name in tools if name.endswith("__event_stream_handler")]
    assert len(handled) == 4  # the run's tool events; model events came with the model call
    assert any(name.endswith(".call_tool:lookup") for name in tools)


def _kind(event: AgentStreamEvent) -> str:
    return str(getattr(event, "event_kind", type(event).__name__))



async def test_a_non_idempotent_tool_interrupted_mid_call_is_escalated_not_rerun(
        engine: Engine) -> None:
    """A tool marked non-idempotent in its metadata is journaled so; a crash after it acted
    and before its result was recorded escalates it on resume (tool_call_uncertain), and it
    does not run again; the idempotent tool before it is not run again either."""
    agent = Agent(TestModel(), name="payments", capabilities=[WalDurability()])
    runs: list[str] = []

    @agent.tool_plain
    def quote(amount: int) -> int:
        """Quote a fee."""
        runs.append("quote")
        return amount // 10

    @agent.tool_plain(metadata={CONFIG_KEY: {"idempotent": False}})
    def charge(amount: int) -> str:
        """Charge a card."""
        runs.append("charge")
        return f"charged {amount}"

    @engine.agent("payments")
    async def pay(ctx: AgentContext, prompt: str) -> str:
        return str((await run_agent(ctx, agent, prompt)).output)

    task_id = await engine.submit("payments", "pay")
    with crash_at("after_effect_before_result", 2) as crash:
        await run_worker_until_idle(engine)
    assert crash.fired
    await expire_leases(engine)
    await run_worker_until_idle(engine)

    history = await engine.history(task_id)
    intents = {orjson.loads(r.payload)["tool"].rsplit(":", 1)[1]:
               orjson.loads(r.payload)["idempotent"]
               for r in history if r.type == "tool_call_intended"}
    assert intents == {"quote": True, "charge": False}
    assert runs == ["quote", "charge"]
    assert [r.type for r in history].count("tool_call_uncertain") == 1
    assert str((await engine.head(task_id)).status) == "FAILED"


async def test_mcp_server_calls_are_journaled_as_tools(engine: Engine) -> None:
    """An MCP server's discovery and tool calls are journaled as tool calls; a replay of the
    history answers them from the log and the server sees no call again."""
    fastmcp = pytest.importorskip("fastmcp", reason="MCPToolset needs fastmcp")
    from pydantic_ai.mcp import MCPToolset

    server = fastmcp.FastMCP("weather")
    served: list[str] = []

    @server.tool
    def forecast(city: str) -> str:
        """Tomorrow's weather in a city."""
        served.append(city)
        return f"sunny in {city}"

    agent = Agent(TestModel(), name="weather",
                  toolsets=[MCPToolset(server, id="weather-mcp")],
                  capabilities=[WalDurability()])

    @engine.agent("weather")
    async def weather(ctx: AgentContext, prompt: str) -> str:
        return str((await run_agent(ctx, agent, prompt)).output)

    report = await assert_replay_equivalent(engine, "weather", "tomorrow?")
    assert (report.outcome, report.output_matches) == ("completed", True)
    assert len(served) == 1
    names = [name for _kind, name in await _calls(engine, report.task_id)]
    assert "weather__mcp_server__weather-mcp.get_tools" in names
    assert names.count("weather__mcp_server__weather-mcp.call_tool") == 1


async def test_a_worker_stopping_mid_run_hands_the_task_back_through_pydantic_ai(
        engine: Engine) -> None:
    """A graceful stop during a run unwinds the agent through Pydantic AI at its next call
    (task_released, not a failure); another worker finishes it without running the tool
    again."""
    agent = Agent(TestModel(), name="drained", capabilities=[WalDurability()])
    workers: list[Any] = []
    runs: list[int] = []

    @agent.tool_plain
    async def step(x: int) -> int:
        """Take a step; the first worker is asked to stop while it runs."""
        runs.append(x)
        workers[0].stop()
        return x

    @engine.agent("drained")
    async def drained(ctx: AgentContext, prompt: str) -> str:
        return str((await run_agent(ctx, agent, prompt)).output)

    task_id = await engine.submit("drained", "go")
    workers.append(engine.worker(poll_ms=20))
    await asyncio.wait_for(workers[0].run(), 60)
    assert str((await engine.head(task_id)).status) == "RESUMING"
    await run_worker_until_idle(engine)
    types = [record.type for record in await engine.history(task_id)]
    # Released at least once (a claim statement already in flight when the stop came can
    # take the released task back; the draining worker then hands it back again at once),
    # never failed, and the tool ran once.
    assert "task_released" in types and "task_failed" not in types
    assert types[-1] == "task_completed"
    assert types.count("tool_call_intended") == 1 and runs == [0]


async def test_model_errors_named_in_the_retry_policy_are_retried_in_the_journal(
        engine: Engine) -> None:
    """A model request failing with ModelHTTPError (named in retry_on) is retried as the
    same journaled call, and the run completes; its failed attempt is in the log."""
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    attempts: list[int] = []

    def flaky(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        attempts.append(1)
        if len(attempts) == 1:
            raise ModelHTTPError(503, "flaky-model", "overloaded")
        return ModelResponse(parts=[TextPart("fine")])

    policy = RetryPolicy(max_attempts=3, initial_delay_s=0.01, retry_on=("ModelHTTPError",))
    agent = Agent(FunctionModel(flaky), name="flaky",
                  capabilities=[WalDurability(model_options={"retry": policy})])

    @engine.agent("flaky")
    async def run_flaky(ctx: AgentContext, prompt: str) -> str:
        return str((await run_agent(ctx, agent, prompt)).output)

    state = await run_crash_free(engine, "flaky", "hello")
    assert (str(state.status), state.output) == ("COMPLETED", "fine")
    assert len(attempts) == 2
    types = [record.type for record in await engine.history(state.task_id)]
    assert types.count("llm_call_intended") == 2 and types.count("llm_call_completed") == 1
