"""Budgets of child tasks by policy (issue 24) on real PostgreSQL: with ``share`` a child
is capped at spawn by what its parent has left, and its spend is charged to the parent
when the parent records its outcome, once, even across crashes and replays; a parent
whose budget a child used up fails with ``budget_exceeded`` as for its own spend.
``own`` keeps a child's budget to itself."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from replay.state import ChildSpend
from wal_engine import failpoints
from wal_engine.engine import Engine
from wal_engine.errors import InvalidInput
from wal_engine.events import Budget
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.steps import LlmResponse
from wal_engine.state_machine import Status
from wal_engine.testing.crash import crash_at, expire_leases, run_worker_until_idle

FAST: dict[str, Any] = {"lease_ttl_ms": 600, "heartbeat_ms": 150, "poll_ms": 50,
                        "sweep_ms": 100}


def _priced(cost_usd: float, tokens: int = 10) -> Any:
    def model(request: Any) -> LlmResponse:
        return LlmResponse(content=f"re: {request}", input_tokens=tokens, output_tokens=0,
                           cost_usd=cost_usd)
    return model


def _register(engine: Engine) -> None:
    @engine.agent("spender")
    async def spender(ctx: AgentContext, value: Any) -> float:
        """Makes ``calls`` LLM calls of ``cost`` each; returns what they cost."""
        for n in range(value["calls"]):
            await ctx.llm("m", _priced(value["cost"]), n)
        return float(value["calls"] * value["cost"])


async def _drive(engine: Engine, task_id: str, timeout_s: float = 20.0) -> Any:
    worker = engine.worker(concurrency=8, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        return await engine.wait(task_id, timeout_s=timeout_s)
    finally:
        worker.stop()
        await running


async def _run_until_fired(engine: Engine, point: str, timeout_s: float = 20.0) -> None:
    """Run workers until the armed ``point`` fired: a worker run ends when nothing is due,
    which can be just before a child's ending wakes its parent."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while point not in failpoints.fired:
        assert asyncio.get_running_loop().time() < deadline, f"{point} never reached"
        await run_worker_until_idle(engine, **FAST)


async def _values(engine: Engine, task_id: str, prefix: str) -> list[Any]:
    found = []
    for record in await engine.history(task_id):
        if record.type == "value_recorded":
            event = msgspec.json.decode(record.payload)
            if event["kind"].startswith(prefix):
                found.append(event["value"])
    return found


async def test_a_childs_spend_past_the_parents_budget_fails_the_parent(
        engine: Engine) -> None:
    """The parent (max $1) spends $0.25 and spawns a child, capped at the $0.75 left; the
    child spends $1.00 (its second call starts under its cap, as a task's own calls do);
    recording its outcome charges the parent $1.00, and the parent fails with
    budget_exceeded (max_cost_usd, used $1.25), as for its own spend. The child itself
    completed."""
    _register(engine)
    after: list[str] = []

    @engine.agent("thrifty")
    async def thrifty(ctx: AgentContext, value: Any) -> Any:
        await ctx.llm("m", _priced(0.25), "plan")
        handle = await ctx.spawn("spender", {"calls": 2, "cost": 0.5})
        result = await handle.result()
        after.append("went on")
        return result

    task = await engine.submit("thrifty", None, task_id="thrifty",
                               budget=Budget(max_cost_usd=1.0))
    state = await _drive(engine, task)
    assert state.status is Status.FAILED and state.failure is not None
    assert state.failure.reason == "budget_exceeded"
    assert state.budget_exceeded is not None
    assert (state.budget_exceeded.budget, state.budget_exceeded.limit,
            state.budget_exceeded.used) == ("max_cost_usd", 1.0, 1.25)
    assert state.usage.cost_usd == 0.25 and state.children_spend.cost_usd == 1.0
    assert state.failure.diagnostic["children_spend"]["cost_usd"] == 1.0
    assert after == []
    child = await engine.state("thrifty:child:value-1")
    assert child.status is Status.COMPLETED and child.output == 1.0
    assert child.budget == Budget(max_cost_usd=0.75)
    [outcome] = await _values(engine, task, "child:")
    assert msgspec.convert(outcome["charge"], ChildSpend) == ChildSpend(
        steps=child.step, tokens=20, cost_usd=1.0)
    types = [record.type for record in await engine.history(task)]
    assert types[-2:] == ["budget_exceeded", "task_failed"]


async def test_a_child_is_capped_by_what_its_parent_has_left(engine: Engine) -> None:
    """At spawn each limit the parent sets caps the child's: the tokens left (100 - 30),
    the tool calls left, the lower of the child's own cost limit and the parent's; a limit
    the parent has not set stays the child's own, and the runtime limit is the child's.
    A parent whose tokens are used up fails at the spawn, creating no child."""
    _register(engine)

    @engine.agent("capper")
    async def capper(ctx: AgentContext, value: Any) -> Any:
        await ctx.llm("m", _priced(0.0, tokens=value["tokens"]), "plan")
        handle = await ctx.spawn("spender", {"calls": 0, "cost": 0},
                                 budget=Budget(max_tokens=1000, max_cost_usd=0.1,
                                               max_runtime_s=60, max_steps=7))
        return await handle.result()

    task = await engine.submit("capper", {"tokens": 30}, task_id="capper",
                               budget=Budget(max_tokens=100, max_tool_calls=5,
                                             max_cost_usd=2.0, max_runtime_s=5))
    state = await _drive(engine, task)
    assert state.status is Status.COMPLETED, state.failure
    child = await engine.state("capper:child:value-1")
    assert child.budget == Budget(max_tokens=70, max_tool_calls=5, max_cost_usd=0.1,
                                  max_runtime_s=60, max_steps=7)
    assert await _values(engine, task, "spawn:") == [
        {"task_id": "capper:child:value-1", "budget_policy": "share"}]

    broke = await engine.submit("capper", {"tokens": 100}, task_id="broke",
                                budget=Budget(max_tokens=100))
    state = await _drive(engine, broke)
    assert state.status is Status.FAILED and state.budget_exceeded is not None
    assert (state.budget_exceeded.budget, state.budget_exceeded.used) == ("max_tokens", 100.0)
    assert "broke:child:value-1" not in await _tasks(engine)
    assert await _values(engine, broke, "spawn:") == []


@pytest.mark.parametrize("point", ["after_child_submit", "after_child_outcome"])
async def test_crashes_and_replays_never_charge_twice(engine: Engine, point: str) -> None:
    """The parent dies after creating its child, or after recording its charged outcome;
    the next run (which re-runs the code from the top, and once more after a durable
    sleep) records one outcome and is charged the child's $1.50 once. The parent's own
    later call sees the charge: $1.50 + $0.20 of $5."""
    _register(engine)

    @engine.agent("careful")
    async def careful(ctx: AgentContext, value: Any) -> Any:
        handle = await ctx.spawn("spender", {"calls": 3, "cost": 0.5})
        result = await handle.result()
        await ctx.sleep(0.05)
        await ctx.llm("m", _priced(0.2), "summary")
        return result

    task = await engine.submit("careful", None, task_id="careful",
                               budget=Budget(max_cost_usd=5.0))
    with crash_at(point) as crash:
        await _run_until_fired(engine, point)
    assert crash.fired
    assert await expire_leases(engine, [task]) == 1
    state = await _drive(engine, task)
    assert state.status is Status.COMPLETED, state.failure
    assert state.output == 1.5
    assert state.children_spend.cost_usd == 1.5
    assert state.usage.cost_usd == pytest.approx(0.2)
    outcomes = await _values(engine, task, "child:")
    assert len(outcomes) == 1 and outcomes[0]["charge"]["cost_usd"] == 1.5
    assert [t for t in await _tasks(engine) if t != task] == ["careful:child:value-0"]


async def test_a_crash_after_the_charge_fails_the_parent_at_its_next_claim(
        engine: Engine) -> None:
    """The charge that used the parent's budget up is recorded, and the worker dies before
    checking it: the next claim's budget check fails the parent, once."""
    _register(engine)

    @engine.agent("overrun")
    async def overrun(ctx: AgentContext, value: Any) -> Any:
        return await (await ctx.spawn("spender", {"calls": 2, "cost": 0.75})).result()

    task = await engine.submit("overrun", None, task_id="overrun",
                               budget=Budget(max_cost_usd=1.0))
    with crash_at("after_child_outcome") as crash:
        await _run_until_fired(engine, "after_child_outcome")
    assert crash.fired
    assert await expire_leases(engine, [task]) == 1
    state = await _drive(engine, task)
    assert state.status is Status.FAILED and state.budget_exceeded is not None
    assert state.budget_exceeded.budget == "max_cost_usd"
    assert state.budget_exceeded.used == 1.5
    types = [record.type for record in await engine.history(task)]
    assert types.count("budget_exceeded") == 1 and types[-1] == "task_failed"


async def test_a_second_result_of_one_child_is_not_charged_again(engine: Engine) -> None:
    """``result()`` twice (and ``ctx.child`` for the same id) records two outcomes; only
    the first carries the charge."""
    _register(engine)

    @engine.agent("twice")
    async def twice(ctx: AgentContext, value: Any) -> Any:
        handle = await ctx.spawn("spender", {"calls": 1, "cost": 0.5})
        first = await handle.result()
        again = await (await ctx.child(handle.task_id)).result()
        return [first, again]

    task = await engine.submit("twice", None, task_id="twice", budget=Budget(max_cost_usd=3))
    state = await _drive(engine, task)
    assert state.output == [0.5, 0.5]
    assert state.children_spend == ChildSpend(steps=state.children_spend.steps, tokens=10,
                                              cost_usd=0.5)
    outcomes = await _values(engine, task, "child:")
    assert ["charge" in outcome for outcome in outcomes] == [True, False]


async def test_grandchildren_are_charged_up_the_tree(engine: Engine) -> None:
    """A child's charge holds what its own ``share`` children cost it: the root is
    charged the grandchild's $0.50 and the child's $0.25."""
    _register(engine)

    @engine.agent("middle")
    async def middle(ctx: AgentContext, value: Any) -> Any:
        await ctx.llm("m", _priced(0.25), "own")
        return await (await ctx.spawn("spender", {"calls": 1, "cost": 0.5})).result()

    @engine.agent("root")
    async def root(ctx: AgentContext, value: Any) -> Any:
        return await (await ctx.spawn("middle", None)).result()

    task = await engine.submit("root", None, task_id="root", budget=Budget(max_cost_usd=2))
    state = await _drive(engine, task)
    assert state.status is Status.COMPLETED, state.failure
    assert state.output == 0.5
    grandchild = await engine.state("root:child:value-0:child:value-1")
    assert grandchild.budget == Budget(max_cost_usd=1.75)  # $2 less the $0.25 spent.
    assert state.children_spend.cost_usd == 0.75 and state.children_spend.tokens == 20


async def test_own_keeps_todays_behaviour(engine: Engine) -> None:
    """``own``: the child gets only its own budget (none here), its $5 is not charged, the
    parent (max $1) completes, and the values recorded are as before policies existed."""
    _register(engine)

    @engine.agent("apart")
    async def apart(ctx: AgentContext, value: Any) -> Any:
        handle = await ctx.spawn("spender", {"calls": 2, "cost": 2.5}, budget_policy="own")
        return await handle.result()

    task = await engine.submit("apart", None, task_id="apart", budget=Budget(max_cost_usd=1))
    state = await _drive(engine, task)
    assert state.status is Status.COMPLETED, state.failure
    assert state.output == 5.0
    assert state.children_spend == ChildSpend()
    assert (await engine.state("apart:child:value-0")).budget == Budget()
    assert await _values(engine, task, "spawn:") == [{"task_id": "apart:child:value-0"}]
    [outcome] = await _values(engine, task, "child:")
    assert outcome == {"task_id": "apart:child:value-0", "status": "COMPLETED",
                       "output": 5.0}


async def test_bad_budget_policy_or_budget_is_refused_with_nothing_written(
        engine: Engine) -> None:
    """An unknown policy or a non-positive budget is InvalidInput at the spawn, before the
    journal moves: the next spawn is the first call."""
    _register(engine)
    seen: list[str] = []

    @engine.agent("picky")
    async def picky(ctx: AgentContext, value: Any) -> Any:
        for call in (ctx.spawn("spender", {"calls": 0, "cost": 0}, budget_policy="pool"),  # type: ignore[arg-type]
                     ctx.spawn("spender", {"calls": 0, "cost": 0},
                               budget=Budget(max_cost_usd=-1))):
            try:
                await call
            except InvalidInput as error:
                seen.append(str(error))
        return (await ctx.spawn("spender", {"calls": 0, "cost": 0})).task_id

    task = await engine.submit("picky", None, task_id="picky")
    state = await _drive(engine, task)
    assert state.output == "picky:child:value-0"
    assert len(seen) == 2 and "budget_policy" in seen[0] and "max_cost_usd" in seen[1]
    assert sorted(await _tasks(engine)) == ["picky", "picky:child:value-0"]


async def _tasks(engine: Engine) -> list[str]:
    rows = await engine.database.fetch(
        "SELECT task_id FROM wal_tasks WHERE tenant = current_setting('wal.tenant', true)"
        " ORDER BY task_id")
    return [row["task_id"] for row in rows]
