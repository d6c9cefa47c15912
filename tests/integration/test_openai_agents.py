"""The OpenAI Agents SDK on the log: a durable run with tools and a handoff, killed and
resumed in a new process, a tool call approved or rejected by a human, and bad input."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip(
    "agents", reason="the [openai-agents] extra is not installed: pip install"
    " 'wal-engine[openai-agents]'")

from agents import Agent, RunConfig, Runner, handoff
from agents.models.interface import Model, ModelProvider
from agents.run_config import ToolExecutionConfig
from agents.testing import ScriptedModel, assistant_message, function_call
from agents.tool import LocalShellTool

from tests.helpers import drive
from tests.integration import openai_agents_app as app
from wal_engine.engine import Engine
from wal_engine.errors import InvalidInput
from wal_engine.integrations.openai_agents import DurableModel, DurableRunner
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.crash import crash_at, expire_leases, run_worker_until_idle
from wal_engine.testing.processes import WorkerPool

REPO = Path(__file__).resolve().parents[2]
ANSWER = {"output": "Done: refund of 30 issued for A17", "last_agent": "refunds"}


@pytest.fixture
def effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the tools append their effects to (read back by the test)."""
    path = tmp_path / "effects.txt"
    monkeypatch.setenv(app.EFFECTS_ENV, str(path))
    return path


def lines(path: Path) -> list[str]:
    """The effect lines recorded so far."""
    return path.read_text().splitlines() if path.exists() else []


def acted(path: Path) -> list[str]:
    """The effects recorded so far, without the process ids."""
    return [line.rsplit(" pid=", 1)[0] for line in lines(path)]


def calls(events: list[Any]) -> list[tuple[str, str]]:
    """(kind, name) of each intent in a history: the model and tool calls, in order."""
    found = []
    for record in events:
        if record.type in ("llm_call_intended", "tool_call_intended"):
            payload = msgspec.json.decode(record.payload)
            kind = "llm" if record.type == "llm_call_intended" else "tool"
            found.append((kind, payload["model"] if kind == "llm" else payload["tool"]))
    return found


async def test_agent_with_tools_and_handoff_runs_to_completion(engine: Engine,
                                                               effects: Path) -> None:
    """Two tools, a handoff and a third tool on the second agent: the output is the
    SDK's, each tool acted once, and the history shows every model and tool call."""
    app.register(engine)
    task_id = await engine.submit(app.AGENT, "I want my money back for A17")
    state = await drive(engine, task_id)
    assert str(state.status) == "COMPLETED", state.failure
    assert state.output == ANSWER
    assert acted(effects) == ["lookup_order A17", "add_note wants a refund",
                              "issue_refund A17 30"]
    assert calls(await engine.history(task_id)) == [
        ("llm", "scripted-desk"), ("tool", "lookup_order"), ("tool", "add_note"),
        ("llm", "scripted-desk"), ("llm", "scripted-desk"), ("tool", "issue_refund"),
        ("llm", "scripted-desk")]
    assert (state.usage.input_tokens, state.usage.output_tokens) == (400, 80)
    history = await engine.history(task_id)
    # A step boundary before each model call.
    assert [r.type for r in history].count("step_checkpointed") == 4
    assert (await engine.store.verify_task(task_id)).ok


DEEP = pytest.mark.skipif(os.environ.get("RELIABILITY_DEEP") != "1",
                          reason="deep tier: set RELIABILITY_DEEP=1 to run it")


@pytest.mark.parametrize("resumer", [
    "test-process",
    pytest.param("worker-process", marks=[pytest.mark.deep, DEEP]),
])
async def test_worker_killed_after_first_tool_resumes_in_another_process(
        engine: Engine, database_dsn: str, effects: Path, tmp_path: Path,
        resumer: str) -> None:
    """SIGKILL of the worker process right after the first tool's result committed;
    another process (this test's worker, or in the deep tier a fresh worker process)
    finishes the run from the log: each tool acted once, the output is a crash-free run's,
    and the processes split the effects at the kill."""
    app.register(engine)
    pool = WorkerPool(database_dsn, "tests.integration.openai_agents_app:register",
                      tmp_path, cwd=REPO, lease_ttl_ms=600, heartbeat_ms=150, poll_ms=50,
                      env={app.EFFECTS_ENV: str(effects), "PYTHONPATH": str(REPO)})
    try:
        crashing = pool.start("crashing", failpoint="after_result_commit:1:sigkill")
        task_id = await engine.submit(app.AGENT, "I want my money back for A17")
        assert await crashing.exited(90) == -9, crashing.output()
        assert acted(effects) == ["lookup_order A17"]
        if resumer == "test-process":
            state = await drive(engine, task_id)
        else:
            await pool.spawn("resuming", env={app.EFFECTS_ENV: str(effects),
                                              "PYTHONPATH": str(REPO)})
            state = await engine.wait(task_id, timeout_s=90)
    finally:
        pool.close()
    assert str(state.status) == "COMPLETED", state.failure
    assert state.output == ANSWER
    assert acted(effects) == ["lookup_order A17", "add_note wants a refund",
                              "issue_refund A17 30"]
    pids = [line.rsplit(" pid=", 1)[1] for line in lines(effects)]
    assert pids[0] == str(crashing.process.pid) != pids[1] == pids[2]
    history = await engine.history(task_id)
    assert calls(history) == [
        ("llm", "scripted-desk"), ("tool", "lookup_order"), ("tool", "add_note"),
        ("llm", "scripted-desk"), ("llm", "scripted-desk"), ("tool", "issue_refund"),
        ("llm", "scripted-desk")]
    claims = [r.epoch for r in history if r.type == "task_claimed"]
    assert len(claims) == 1 and "task_resumed" in [r.type for r in history]
    assert (await engine.store.verify_task(task_id)).ok


async def test_tool_needing_approval_waits_and_resumes_on_approve(engine: Engine,
                                                                  effects: Path) -> None:
    """The refund needs approval: the task waits (WAITING) with the refund not done,
    engine.approve resumes it, and the refund acts once."""
    app.register(engine)
    task_id = await engine.submit(app.APPROVAL_AGENT, "I want my money back for A17")
    await drive(engine, task_id, status="WAITING")
    assert acted(effects) == ["lookup_order A17", "add_note wants a refund"]
    (call_id, request), = (await engine.state(task_id)).approvals.items()
    assert request.tool == "issue_refund" and request.approved is None
    await engine.approve(task_id, call_id, approver="ops@example.com")
    state = await drive(engine, task_id)
    assert str(state.status) == "COMPLETED", state.failure
    assert state.output == ANSWER
    assert acted(effects) == ["lookup_order A17", "add_note wants a refund",
                              "issue_refund A17 30"]
    assert state.approvals[call_id].approver == "ops@example.com"


async def test_rejected_tool_call_gives_the_model_the_sdk_rejection(engine: Engine,
                                                                    effects: Path) -> None:
    """A rejected refund never acts; the model is told the SDK's rejection and answers,
    and the task completes."""
    app.register(engine)
    task_id = await engine.submit(app.APPROVAL_AGENT, "I want my money back for A17")
    await drive(engine, task_id, status="WAITING")
    (call_id,) = (await engine.state(task_id)).approvals
    await engine.approve(task_id, call_id, approver="ops@example.com", approved=False,
                         comment="over the limit")
    state = await drive(engine, task_id)
    assert str(state.status) == "COMPLETED", state.failure
    assert state.output == {"output": "Done: Tool execution was not approved.",
                            "last_agent": "refunds"}
    assert acted(effects) == ["lookup_order A17", "add_note wants a refund"]
    assert state.approvals[call_id].approved is False


async def test_bad_input_gets_a_typed_error_and_writes_nothing(engine: Engine) -> None:
    """Bad arguments to the durable runner raise InvalidInput inside the task, before any
    call is journaled; a submission of the wrong input type is refused before the log."""
    problems: dict[str, str] = {}

    async def attempt(name: str, ctx: AgentContext, **run: Any) -> None:
        try:
            await DurableRunner(ctx).run(**run)
        except InvalidInput as error:
            problems[name] = str(error)

    @engine.agent("bad-openai-agents")
    async def bad(ctx: AgentContext, _: Any) -> int:
        shell = Agent(name="shell", tools=[LocalShellTool(executor=lambda _: "")])
        serial = RunConfig(tool_execution=ToolExecutionConfig(max_function_tool_concurrency=4))
        await attempt("agent", ctx, starting_agent="triage", input="hi")
        await attempt("input", ctx, starting_agent=app.desk(approval=False), input=42)
        await attempt("turns", ctx, starting_agent=app.desk(approval=False), input="hi",
                      max_turns=0)
        await attempt("tool", ctx, starting_agent=shell, input="hi")
        await attempt("concurrency", ctx, starting_agent=app.desk(approval=False),
                      input="hi", run_config=serial)
        return len(problems)

    with pytest.raises(InvalidInput):
        DurableRunner("not a ctx")  # type: ignore[arg-type]
    app.register(engine)
    with pytest.raises(InvalidInput):
        await engine.submit(app.AGENT, {"question": "not a string"})
    task_id = await engine.submit("bad-openai-agents")
    state = await drive(engine, task_id)
    assert state.output == 5, problems
    assert "LocalShellTool" in problems["tool"] and "one at a time" in problems["concurrency"]
    assert calls(await engine.history(task_id)) == []
    assert os.environ.get(app.EFFECTS_ENV) is None


async def test_streamed_run_is_journaled_and_replayed_from_the_log(engine: Engine) -> None:
    """Runner.run_streamed over a DurableModel: the stream events are recorded whole, and
    the run's re-run (after a durable sleep) replays them without calling the model, whose
    script is used up by then."""
    scripted = ScriptedModel([
        [function_call("add_note", {"text": "streamed"}, call_id="c-stream")],
        [assistant_message("noted it")],
    ])
    streamed: list[list[str]] = []

    @engine.agent("streamed-desk")
    async def streamed_desk(ctx: AgentContext, _: Any) -> Any:
        desk = Agent(name="desk", instructions="desk", model=DurableModel(ctx, scripted),
                     tools=[DurableRunner(ctx).durable_tool(app.add_note)])
        run = Runner.run_streamed(desk, "note this", run_config=app.RUN_CONFIG)
        kinds = [event.type async for event in run.stream_events()]
        streamed.append(kinds)
        await ctx.sleep(0)
        return run.final_output

    task_id = await engine.submit("streamed-desk")
    state = await drive(engine, task_id)
    assert str(state.status) == "COMPLETED", state.failure
    assert state.output == "noted it"
    assert scripted.remaining_steps == 0 and len(scripted.calls) == 2
    assert len(streamed) == 2 and streamed[0] == streamed[1]
    assert "raw_response_event" in streamed[0]
    assert calls(await engine.history(task_id)) == [
        ("llm", "ScriptedModel"), ("tool", "add_note"), ("llm", "ScriptedModel")]


async def test_crash_inside_a_non_idempotent_tool_escalates_without_rerunning_it(
        engine: Engine, effects: Path) -> None:
    """A crash after a tool declared non-idempotent acted, before its result was
    recorded: the resumed run escalates the call (the task fails with the tool named)
    instead of running it again, and the tools before it are not run again either."""
    @engine.agent("careful-desk")
    async def careful_desk(ctx: AgentContext, question: str) -> Any:
        runner = DurableRunner(ctx, non_idempotent_tools={"add_note"})
        result = await runner.run(app.desk(approval=False), question,
                                  run_config=app.RUN_CONFIG)
        return result.final_output

    task_id = await engine.submit("careful-desk", "I want my money back for A17")
    with crash_at("after_effect_before_result", 2) as crash:
        await run_worker_until_idle(engine)
    assert crash.fired
    assert acted(effects) == ["lookup_order A17", "add_note wants a refund"]
    await expire_leases(engine)
    state = await drive(engine, task_id)
    assert str(state.status) == "FAILED"
    assert state.failure is not None and state.failure.reason == "uncertain_side_effect"
    assert "add_note" in str(state.failure.diagnostic)
    assert acted(effects) == ["lookup_order A17", "add_note wants a refund"]


async def test_handoff_object_continues_on_the_journaled_copy_of_its_target(
        engine: Engine) -> None:
    """A handoff made with the SDK's handoff() (its callback included) lands on the
    journaled copy of the target: the target's model call is in the history too."""
    triage_model = ScriptedModel([[function_call("transfer_to_refunds", {}, call_id="h1")]])
    refunds_model = ScriptedModel([[assistant_message("refunds here")]])
    handed: list[str] = []

    @engine.agent("handoff-desk")
    async def handoff_desk(ctx: AgentContext, _: Any) -> Any:
        refunds = Agent(name="refunds", instructions="refunds", model=refunds_model)
        triage = Agent(name="triage", instructions="triage", model=triage_model,
                       handoffs=[handoff(refunds, on_handoff=lambda _: handed.append("h"))])
        result = await DurableRunner(ctx).run(triage, "hi", run_config=app.RUN_CONFIG)
        return {"output": result.final_output, "last_agent": result.last_agent.name}

    task_id = await engine.submit("handoff-desk")
    state = await drive(engine, task_id)
    assert state.output == {"output": "refunds here", "last_agent": "refunds"}
    assert handed == ["h"]
    assert calls(await engine.history(task_id)) == [("llm", "ScriptedModel")] * 2


async def test_models_named_by_string_are_resolved_and_journaled(engine: Engine) -> None:
    """Agents that name their model are resolved through the run config's provider, and
    those models' calls are journaled under the name."""
    scripted = ScriptedModel([[assistant_message("by name")]])

    class Provider(ModelProvider):
        def get_model(self, model_name: str | None) -> Model:
            assert model_name == "desk-model"
            return scripted

    @engine.agent("named-model-desk")
    async def named(ctx: AgentContext, _: Any) -> Any:
        desk = Agent(name="desk", instructions="desk", model="desk-model")
        config = RunConfig(model_provider=Provider(), tracing_disabled=True)
        return (await DurableRunner(ctx).run(desk, "hi", run_config=config)).final_output

    task_id = await engine.submit("named-model-desk")
    state = await drive(engine, task_id)
    assert state.output == "by name"
    assert calls(await engine.history(task_id)) == [("llm", "desk-model")]
