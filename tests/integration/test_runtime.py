"""The durable runtime end to end on real PostgreSQL, in one process."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import Any

import pytest

from wal_engine import failpoints, limits
from wal_engine.engine import Engine
from wal_engine.events import Budget
from wal_engine.retries import PermanentError, RetryPolicy, TransientError
from wal_engine.runtime.context import AgentContext, LlmResponse, ToolError
from wal_engine.state_machine import Status

FAST: dict[str, Any] = {"lease_ttl_ms": 600, "heartbeat_ms": 150, "poll_ms": 50, "sweep_ms": 100}


async def drive(engine: Engine, task_id: str, *, timeout_s: float = 20.0, **config: Any) -> Any:
    """Run a worker until the task is terminal; return its final state."""
    worker = engine.worker(concurrency=4, **{**FAST, **config})
    running = asyncio.create_task(worker.run())
    try:
        return await engine.wait(task_id, timeout_s=timeout_s)
    finally:
        worker.stop()
        await running


class Effects:
    """Counts how often each tool really ran, by idempotency key."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.keys: list[str | None] = []

    def tool(self, name: str, result: Any = "ok", fail_first: int = 0,
             error: type[Exception] = TransientError) -> Any:
        async def run(args: Any) -> Any:
            from wal_engine.runtime.context import current_call

            claim = current_call()
            self.keys.append(None if claim is None else claim.key)
            self.calls[name] += 1
            if self.calls[name] <= fail_first:
                raise error(f"{name} failure {self.calls[name]}")
            return result
        return run


async def test_agent_runs_to_completion_with_every_command(engine: Engine) -> None:
    """Messages, LLM, tools, checkpoints, env, plan, values: all land once, chain verifies."""
    effects = Effects()

    @engine.agent("full")
    async def full(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.message("user", task_input["q"])
        reply = await ctx.llm("m", lambda r: LlmResponse(content="plan", input_tokens=3,
                                                        output_tokens=4, cost_usd=0.01),
                              {"q": task_input["q"]})
        await ctx.set_env(REGION="eu")
        await ctx.checkpoint(next_action="search")
        found = await ctx.tool("search", effects.tool("search", [1, 2]), {"q": reply})
        now = await ctx.now()
        chance = await ctx.random()
        await ctx.checkpoint(next_action="answer")
        await ctx.message("assistant", f"{found}")
        return {"found": found, "now": now, "chance": chance}

    task_id = await engine.submit("full", {"q": "why"})
    state = await drive(engine, task_id)
    assert state.status is Status.COMPLETED
    assert state.output["found"] == [1, 2]
    assert [m.role for m in state.messages] == ["user", "assistant"]
    assert state.usage.input_tokens == 3 and state.usage.cost_usd == pytest.approx(0.01)
    assert state.env == {"REGION": "eu"} and state.commands["step_checkpointed"] == 2
    assert effects.calls == Counter({"search": 1})
    assert effects.keys[0] is not None and effects.keys[0].startswith(f"idem:{task_id}:")
    assert (await engine.store.verify_task(task_id)).ok


async def test_crash_between_effect_and_result_reruns_with_same_key(engine: Engine) -> None:
    """A run abandoned after the effect re-runs the idempotent tool once more, same key."""
    effects = Effects()

    @engine.agent("crashy")
    async def crashy(ctx: AgentContext, task_input: Any) -> Any:
        first = await ctx.tool("a", effects.tool("a", 1), {})
        second = await ctx.tool("b", effects.tool("b", 2), {})
        return first + second

    failpoints.arm("after_effect_before_result", 2, "raise")
    try:
        task_id = await engine.submit("crashy")
        state = await drive(engine, task_id)
    finally:
        failpoints.disarm()
    assert state.output == 3
    assert effects.calls == Counter({"a": 1, "b": 2})
    b_keys = effects.keys[1:]
    assert len(set(b_keys)) == 1
    history = [r.type for r in await engine.history(task_id)]
    assert "task_orphaned" in history and history.count("task_resumed") == 1


async def test_nothing_runs_again_after_the_result_is_recorded(engine: Engine) -> None:
    """Recorded results are returned on resume without calling the tool."""
    effects = Effects()

    @engine.agent("once")
    async def once(ctx: AgentContext, task_input: Any) -> Any:
        value = await ctx.tool("a", effects.tool("a", 5), {})
        await ctx.checkpoint()
        await ctx.tool("b", effects.tool("b", 6), {})
        return value

    failpoints.arm("at_checkpoint", 1, "raise")
    try:
        task_id = await engine.submit("once")
        state = await drive(engine, task_id)
    finally:
        failpoints.disarm()
    assert state.output == 5
    assert effects.calls == Counter({"a": 1, "b": 1})


async def test_transient_errors_are_retried_and_recorded(engine: Engine) -> None:
    """Two transient failures then success: three intents, two failures, one result."""
    effects = Effects()

    @engine.agent("flaky")
    async def flaky(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("f", effects.tool("f", "done", fail_first=2), {},
                              retry=RetryPolicy(max_attempts=5, initial_delay_s=0.01))

    task_id = await engine.submit("flaky")
    state = await drive(engine, task_id)
    assert state.output == "done"
    types = [r.type for r in await engine.history(task_id)]
    assert types.count("tool_call_intended") == 3
    assert types.count("tool_call_failed") == 2
    failures = [r.decode() for r in await engine.history(task_id) if r.type == "tool_call_failed"]
    assert [f.attempt for f in failures] == [1, 2] and all(f.retryable for f in failures)


async def test_permanent_error_fails_at_once(engine: Engine) -> None:
    """A permanent error is not retried; the agent's unhandled ToolError fails the task."""
    effects = Effects()

    @engine.agent("perm")
    async def perm(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("p", effects.tool("p", fail_first=5, error=PermanentError), {})

    task_id = await engine.submit("perm")
    state = await drive(engine, task_id)
    assert state.status is Status.FAILED and state.failure.reason == "agent_error"
    assert effects.calls == Counter({"p": 1})
    assert state.failure.diagnostic["last_events"][-1]["type"] == "tool_call_failed"


@pytest.mark.parametrize(
    ("budget", "name"),
    [
        (Budget(max_tool_calls=2), "max_tool_calls"),
        (Budget(max_steps=2), "max_steps"),
        (Budget(max_tokens=10), "max_tokens"),
        (Budget(max_cost_usd=0.015), "max_cost_usd"),
    ],
)
async def test_each_budget_trips_at_its_limit(engine: Engine, budget: Budget, name: str) -> None:
    """A tripped budget is an event and the task fails with the diagnostic."""
    effects = Effects()

    @engine.agent("loop")
    async def loop(ctx: AgentContext, task_input: Any) -> Any:
        for i in range(10):
            await ctx.llm("m", lambda r: LlmResponse(content=r["i"], input_tokens=4,
                                                    output_tokens=2, cost_usd=0.01), {"i": i})
            await ctx.tool("t", effects.tool("t"), {"i": i})
            await ctx.checkpoint()
        return "never"

    task_id = await engine.submit("loop", budget=budget)
    state = await drive(engine, task_id)
    assert state.status is Status.FAILED and state.failure.reason == "budget_exceeded"
    assert state.budget_exceeded.budget == name
    assert state.failure.diagnostic["tripped"]["budget"] == name
    if name == "max_tool_calls":
        assert effects.calls["t"] == 2


async def test_durable_sleep_releases_the_lease_and_resumes(engine: Engine) -> None:
    """ctx.sleep makes the task WAITING with no lease; it resumes when due."""
    @engine.agent("sleeper")
    async def sleeper(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.sleep(0.3)
        return "woke"

    task_id = await engine.submit("sleeper")
    state = await drive(engine, task_id)
    assert state.output == "woke"
    types = [r.type for r in await engine.history(task_id)]
    assert types[-5:] == ["timer_started", "task_woken", "task_resumed", "timer_fired",
                          "task_completed"]


async def test_signal_sent_before_the_wait_is_delivered(engine: Engine) -> None:
    """A signal in the inbox before the task waits is not lost."""
    @engine.agent("listener")
    async def listener(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.wait_for_signal("go")

    task_id = await engine.submit("listener")
    await engine.signal(task_id, "go", {"n": 1})
    state = await drive(engine, task_id)
    assert state.output == {"n": 1}


async def test_signal_wakes_a_waiting_task(engine: Engine) -> None:
    """A task waiting for a signal becomes RESUMING when it arrives, then completes."""
    @engine.agent("listener")
    async def listener(ctx: AgentContext, task_input: Any) -> Any:
        first = await ctx.wait_for_signal("go")
        second = await ctx.wait_for_signal("go")
        return [first, second]

    task_id = await engine.submit("listener")
    worker = engine.worker(concurrency=2, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        for n in (1, 2):
            await _until(engine, task_id, Status.WAITING)
            await engine.signal(task_id, "go", n)
        state = await engine.wait(task_id, timeout_s=10)
    finally:
        worker.stop()
        await running
    assert state.output == [1, 2]


async def test_signal_wait_times_out(engine: Engine) -> None:
    """A wait with a timeout and no signal raises SignalTimeout inside the agent."""
    from wal_engine.runtime.context import SignalTimeout

    @engine.agent("impatient")
    async def impatient(ctx: AgentContext, task_input: Any) -> Any:
        try:
            await ctx.wait_for_signal("never", timeout_s=0.2)
        except SignalTimeout:
            return "timed out"
        return "signalled"

    task_id = await engine.submit("impatient")
    state = await drive(engine, task_id)
    assert state.output == "timed out"


async def test_cancel_stops_a_waiting_task(engine: Engine) -> None:
    """A cancelled task becomes FAILED and nothing runs after."""
    effects = Effects()

    @engine.agent("cancellable")
    async def cancellable(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.wait_for_signal("go")
        await ctx.tool("after", effects.tool("after"), {})

    task_id = await engine.submit("cancellable")
    worker = engine.worker(concurrency=2, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        await _until(engine, task_id, Status.WAITING)
        assert await engine.cancel(task_id, requested_by="test")
        await engine.signal(task_id, "go")
        state = await engine.wait(task_id, timeout_s=5)
    finally:
        worker.stop()
        await running
    assert state.status is Status.FAILED and state.failure.cancelled
    assert effects.calls["after"] == 0
    assert not await engine.cancel(task_id)


async def test_approval_must_name_the_exact_call(engine: Engine) -> None:
    """An approval for other arguments is rejected; the matching one lets the call run."""
    effects = Effects()

    @engine.agent("guarded")
    async def guarded(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("wire", effects.tool("wire", "sent"), {"amount": 10},
                              approval=True)

    task_id = await engine.submit("guarded")
    worker = engine.worker(concurrency=2, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        await _until(engine, task_id, Status.WAITING)
        await engine.approve(task_id, "tool-0", approver="mallory", args_hash="0" * 64)
        await _until_event(engine, task_id, "signal_received")
        await _until(engine, task_id, Status.WAITING)
        assert effects.calls["wire"] == 0
        await engine.approve(task_id, "tool-0", approver="alice")
        state = await engine.wait(task_id, timeout_s=10)
    finally:
        worker.stop()
        await running
    assert state.output == "sent" and effects.calls["wire"] == 1
    assert state.approvals["tool-0"].approver == "alice"


@pytest.mark.parametrize(
    "result",
    # Too large: over the 64 MiB a value may hold (decision 61; 1 MiB is stored).
    [math.nan, {"x": math.inf}, "nul\x00", "\ud800", "x" * (limits.payload_bytes_max + 10)],
    ids=["nan", "inf", "nul", "surrogate", "too-large"],
)
async def test_unstorable_result_is_recorded_as_failure_not_looped(
    engine: Engine, result: Any
) -> None:
    """A tool returning what PostgreSQL cannot store acts once; a typed failure is recorded."""
    effects = Effects()

    @engine.agent("poison")
    async def poison(ctx: AgentContext, task_input: Any) -> Any:
        try:
            await ctx.tool("bad", effects.tool("bad", result), {})
        except ToolError as error:
            return error.error_type
        return "stored"

    task_id = await engine.submit("poison")
    state = await drive(engine, task_id)
    assert state.output == "UnstorableResult"
    assert effects.calls["bad"] == 1


@pytest.mark.parametrize("output", [math.nan, "o" * (limits.payload_bytes_max + 10),
                                    {"x": "nul\x00"}],
                         ids=["nan", "too-large", "nul"])
async def test_unstorable_agent_output_fails_the_task_once(engine: Engine, output: Any) -> None:
    """An agent returning what the log cannot store fails with agent_error on its first
    run (the run used to crash, and every later claim re-ran the agent and crashed again)."""
    runs = Counter[str]()

    @engine.agent("poison-output")
    async def poison_output(ctx: AgentContext, task_input: Any) -> Any:
        runs["agent"] += 1
        return output

    task_id = await engine.submit("poison-output")
    state = await drive(engine, task_id)
    assert state.status is Status.FAILED
    assert state.failure is not None and state.failure.reason == "agent_error"
    assert "invalid payload" in (state.failure.error or "")
    assert runs["agent"] == 1


@pytest.mark.parametrize("usage", [{"input_tokens": -1000}, {"output_tokens": -1},
                                   {"cost_usd": -5.0}, {"cost_usd": math.nan},
                                   {"cost_usd": math.inf}],
                         ids=["input", "output", "cost", "nan-cost", "inf-cost"])
async def test_llm_usage_that_cannot_be_counted_is_a_failure_not_a_credit(
        engine: Engine, usage: dict[str, Any]) -> None:
    """Negative or non-finite usage is recorded as an InvalidUsage failure and leaves the
    task's totals alone (it used to be added: -3,000 tokens let a task overrun max_tokens)."""

    @engine.agent("credit")
    async def credit(ctx: AgentContext, task_input: Any) -> Any:
        try:
            await ctx.llm("m", lambda _: LlmResponse(content="x", **usage), {})
        except ToolError as error:
            return error.error_type
        return "counted"

    task_id = await engine.submit("credit", budget=Budget(max_tokens=100))
    state = await drive(engine, task_id)
    assert state.output == "InvalidUsage"
    assert (state.usage.input_tokens, state.usage.output_tokens) == (0, 0)
    assert state.usage.cost_usd == 0.0


async def test_deeply_nested_result_is_recorded_as_failure(engine: Engine) -> None:
    """JSON nested 20,000 deep from a tool acts once and is recorded as a typed failure."""
    effects = Effects()
    deep: Any = 1
    for _ in range(20_000):
        deep = [deep]

    @engine.agent("deep")
    async def deep_agent(ctx: AgentContext, task_input: Any) -> Any:
        try:
            await ctx.tool("deep", effects.tool("deep", deep), {})
        except ToolError as error:
            return error.error_type
        return "stored"

    task_id = await engine.submit("deep")
    state = await drive(engine, task_id)
    assert state.output == "UnstorableResult" and effects.calls["deep"] == 1


async def test_non_idempotent_call_in_doubt_is_escalated_not_rerun(engine: Engine) -> None:
    """A crash after a non-idempotent effect fails the task as uncertain; no second effect."""
    effects = Effects()

    @engine.agent("unsafe")
    async def unsafe(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("charge", effects.tool("charge"), {}, idempotent=False)

    failpoints.arm("after_effect_before_result", 1, "raise")
    try:
        task_id = await engine.submit("unsafe")
        state = await drive(engine, task_id)
    finally:
        failpoints.disarm()
    assert state.status is Status.FAILED and state.failure.reason == "uncertain_side_effect"
    assert effects.calls["charge"] == 1


async def test_nondeterminism_fails_the_task_with_the_fork_point(engine: Engine) -> None:
    """Changed code that calls another tool on resume is caught, not silently diverged."""
    effects = Effects()
    version = {"n": 1}

    @engine.agent("changing")
    async def changing(ctx: AgentContext, task_input: Any) -> Any:
        name = "old" if version["n"] == 1 else "new"
        await ctx.tool(name, effects.tool(name), {})
        await ctx.checkpoint()
        await ctx.tool("next", effects.tool("next"), {})

    failpoints.arm("at_checkpoint", 1, "raise")
    try:
        task_id = await engine.submit("changing")
        worker = engine.worker(concurrency=1, **FAST)
        await worker.run(until_idle=True)
        version["n"] = 2
        state = await drive(engine, task_id)
    finally:
        failpoints.disarm()
    assert state.status is Status.FAILED and state.failure.reason == "nondeterminism"
    assert effects.calls["new"] == 0 and effects.calls["next"] == 0


async def test_bad_input_never_reaches_the_log(engine: Engine) -> None:
    """Input that does not match the agent's declared type is refused before any write."""
    import msgspec

    from wal_engine.errors import InvalidInput

    class Order(msgspec.Struct):
        item: str
        quantity: int

    @engine.agent("orders", input_type=Order)
    async def orders(ctx: AgentContext, task_input: Any) -> Any:
        return task_input

    with pytest.raises(InvalidInput):
        await engine.submit("orders", {"item": "x", "quantity": "many"})
    assert await engine.store.list_tasks() == []
    task_id = await engine.submit("orders", {"item": "x", "quantity": 2})
    assert (await drive(engine, task_id)).output == {"item": "x", "quantity": 2}


async def _until(engine: Engine, task_id: str, status: Status, timeout_s: float = 10) -> None:
    async def reached() -> None:
        while (await engine.head(task_id)).status is not status:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(reached(), timeout_s)


async def _until_event(engine: Engine, task_id: str, kind: str, timeout_s: float = 10) -> None:
    async def seen() -> None:
        while kind not in [r.type for r in await engine.history(task_id)]:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(seen(), timeout_s)


async def test_a_task_that_keeps_crashing_is_dead_lettered(engine: Engine) -> None:
    """After the recovery-attempt bound, a task that kills every run fails with the reason."""
    from wal_engine.failpoints import SimulatedCrash

    runs = Counter[str]()

    @engine.agent("doomed")
    async def doomed(ctx: AgentContext, task_input: Any) -> Any:
        runs["doomed"] += 1
        raise SimulatedCrash("every run dies here")

    engine.recovery_attempts_max = 3
    task_id = await engine.submit("doomed")
    state = await drive(engine, task_id)
    assert state.status is Status.FAILED and state.budget_exceeded.budget == "max_attempts"
    assert runs["doomed"] == 3 and state.attempts == 4


async def test_long_retry_delay_becomes_a_durable_timer(engine: Engine) -> None:
    """A backoff longer than durable_after_s releases the lease (WAITING) instead of sleeping."""
    effects = Effects()

    @engine.agent("patient")
    async def patient(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("slow", effects.tool("slow", "ok", fail_first=1), {},
                              retry=RetryPolicy(max_attempts=3, initial_delay_s=0.4,
                                                multiplier=1.0, durable_after_s=0.0))

    task_id = await engine.submit("patient")
    state = await drive(engine, task_id)
    assert state.output == "ok" and effects.calls["slow"] == 2
    types = [r.type for r in await engine.history(task_id)]
    waits = [t for t in types if t in ("timer_started", "task_woken", "timer_fired")]
    assert waits == ["timer_started", "task_woken", "timer_fired"]


async def test_runtime_budget_counts_across_claims(engine: Engine) -> None:
    """max_runtime_s trips from the database's first-claim time, across workers and sleeps."""
    @engine.agent("slowpoke")
    async def slowpoke(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.sleep(0.3)
        await ctx.tool("after", lambda a: "late", {})
        return "finished"

    task_id = await engine.submit("slowpoke", budget=Budget(max_runtime_s=0.2))
    state = await drive(engine, task_id)
    assert state.status is Status.FAILED and state.budget_exceeded.budget == "max_runtime_s"
