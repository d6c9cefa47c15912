"""Child tasks (issue 24) on real PostgreSQL, in one process: spawn, result, gather,
typed failures, cancellation by policy, bad input refused with nothing written, and a
parent crashed between creating a child and recording it never spawns twice."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import msgspec

from wal_engine.engine import Engine, connect
from wal_engine.errors import (
    ChildTaskFailed,
    InvalidInput,
    NotAChild,
    TaskCycle,
    UnknownAgent,
    UnknownTask,
)
from wal_engine.runtime.context import AgentContext
from wal_engine.state_machine import Status
from wal_engine.testing.crash import crash_at, expire_leases, run_worker_until_idle

FAST: dict[str, Any] = {"lease_ttl_ms": 600, "heartbeat_ms": 150, "poll_ms": 50,
                        "sweep_ms": 100}


class Square(msgspec.Struct):
    """The child agent's input."""

    n: int


def _register_children(engine: Engine, runs: Counter[str]) -> None:
    @engine.agent("square")
    async def square(ctx: AgentContext, value: Square) -> int:
        runs[ctx.task_id] += 1
        if value.n < 0:
            raise ValueError(f"negative {value.n}")
        return value.n * value.n

    @engine.agent("forever")
    async def forever(ctx: AgentContext, value: Any) -> None:
        await ctx.wait_for_signal("never")


async def _drive(engine: Engine, task_id: str, timeout_s: float = 20.0) -> Any:
    worker = engine.worker(concurrency=8, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        return await engine.wait(task_id, timeout_s=timeout_s)
    finally:
        worker.stop()
        await running


async def _tasks(engine: Engine) -> dict[str, str]:
    rows = await engine.database.fetch(
        "SELECT task_id, status FROM wal_tasks WHERE tenant = current_setting('wal.tenant',"
        " true) ORDER BY task_id")
    return {row["task_id"]: row["status"] for row in rows}


async def test_spawn_and_result_returns_the_childs_output(engine: Engine) -> None:
    """A parent spawns one child, waits durably for it (the child is held until the parent
    is WAITING, so the wait is certain), and gets its output."""
    release = asyncio.Event()

    @engine.agent("held-square")
    async def held_square(ctx: AgentContext, value: Square) -> int:
        await release.wait()
        return value.n * value.n

    @engine.agent("parent")
    async def parent(ctx: AgentContext, value: Any) -> Any:
        handle = await ctx.spawn("held-square", {"n": 7})
        return {"child": handle.task_id, "result": await handle.result()}

    task = await engine.submit("parent", None, task_id="p1")
    worker = engine.worker(concurrency=8, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        async def parked() -> None:
            while (await engine.head(task)).status is not Status.WAITING:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(parked(), 20)
        release.set()
        state = await engine.wait(task, timeout_s=20)
    finally:
        release.set()
        worker.stop()
        await running
    assert state.status is Status.COMPLETED
    assert state.output == {"child": "p1:child:value-0", "result": 49}
    types = [record.type for record in await engine.history(task)]
    assert "signal_awaited" in types  # It waited with its lease dropped, not in memory.
    child = await engine.head("p1:child:value-0")
    assert (child.status, child.parent_task_id, child.parent_seq) == (
        Status.COMPLETED, "p1", None)


async def test_gather_of_five_children(engine: Engine) -> None:
    """Fan-out of five children and fan-in of their results, in order, each run once."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)

    @engine.agent("fan")
    async def fan(ctx: AgentContext, value: Any) -> Any:
        handles = [await ctx.spawn("square", {"n": n}) for n in range(1, 6)]
        return await ctx.gather(*handles)

    task = await engine.submit("fan", None, task_id="fan")
    state = await _drive(engine, task)
    assert state.output == [1, 4, 9, 16, 25]
    assert len(runs) == 5 and set(runs.values()) == {1}


async def test_child_failure_reaches_the_parent_typed(engine: Engine) -> None:
    """A failed child raises ChildTaskFailed in its parent, with the child's id and error;
    gather with return_exceptions puts it in the list instead."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)

    @engine.agent("careful")
    async def careful(ctx: AgentContext, value: Any) -> Any:
        bad = await ctx.spawn("square", {"n": -3})
        good = await ctx.spawn("square", {"n": 2})
        mixed = await ctx.gather(bad, good, return_exceptions=True)
        try:
            await bad.result()
        except ChildTaskFailed as failed:
            return {"id": failed.task_id, "error": failed.error, "cancelled": failed.cancelled,
                    "mixed": [type(item).__name__ for item in mixed]}
        return "no error"

    task = await engine.submit("careful", None, task_id="careful")
    state = await _drive(engine, task)
    assert state.output["id"] == "careful:child:value-0"
    assert "negative -3" in state.output["error"]
    assert state.output["cancelled"] is False
    assert state.output["mixed"] == ["ChildTaskFailed", "int"]


async def test_cancelling_the_parent_cancels_children_by_policy(engine: Engine) -> None:
    """Cancelling a waiting parent cancels its 'cancel' child and leaves its 'abandon'
    child running, in the same transaction as the parent's cancellation."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)

    @engine.agent("boss")
    async def boss(ctx: AgentContext, value: Any) -> Any:
        kept = await ctx.spawn("forever", None, on_parent_end="cancel")
        await ctx.spawn("forever", None, on_parent_end="abandon")
        return await kept.result()

    task = await engine.submit("boss", None, task_id="boss")
    await run_worker_until_idle(engine, **FAST)
    assert (await engine.head(task)).status is Status.WAITING
    assert await engine.cancel(task, reason="stop it")
    tasks = await _tasks(engine)
    assert tasks == {"boss": "FAILED", "boss:child:value-0": "FAILED",
                     "boss:child:value-1": "WAITING"}
    cancelled = await engine.state("boss:child:value-0")
    assert cancelled.failure is not None and cancelled.failure.cancelled
    assert cancelled.failure.requested_by == "boss"


async def test_a_cancelled_child_is_a_typed_failure_in_its_parent(engine: Engine) -> None:
    """A child cancelled from outside wakes its parent with ChildTaskFailed(cancelled)."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)

    @engine.agent("watcher")
    async def watcher(ctx: AgentContext, value: Any) -> Any:
        handle = await ctx.spawn("forever", None)
        try:
            return await handle.result()
        except ChildTaskFailed as failed:
            return {"cancelled": failed.cancelled, "reason": failed.reason}

    task = await engine.submit("watcher", None, task_id="watcher")
    await run_worker_until_idle(engine, **FAST)
    await engine.cancel("watcher:child:value-0", reason="operator")
    state = await _drive(engine, task)
    assert state.output == {"cancelled": True, "reason": "operator"}


async def test_parent_crashed_between_spawn_and_record_never_spawns_twice(
        engine: Engine) -> None:
    """The parent dies after creating its child and before recording the spawn: the next
    run finds the same child and records it; the child ran once and one child exists."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)

    @engine.agent("crashy")
    async def crashy(ctx: AgentContext, value: Any) -> Any:
        handle = await ctx.spawn("square", {"n": 5})
        return await handle.result()

    task = await engine.submit("crashy", None, task_id="crashy")
    with crash_at("after_child_submit") as crash:
        await run_worker_until_idle(engine, **FAST)
    assert crash.fired
    assert await expire_leases(engine, [task]) == 1
    state = await _drive(engine, task)
    assert state.output == 25
    children = [t for t in await _tasks(engine) if t != task]
    assert children == ["crashy:child:value-0"]
    assert runs == Counter({"crashy:child:value-0": 1})
    spawns = [r for r in await engine.history(task)
              if r.type == "value_recorded" and b'"kind":"spawn:' in r.payload]
    assert len(spawns) == 1


async def test_resumed_parent_replays_spawns_without_creating_children(
        engine: Engine) -> None:
    """A parent that sleeps durably between spawning and gathering re-runs its code from
    the top when it wakes, its spawns answered from the log: no child is created again and
    each ran once."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)

    @engine.agent("replayer")
    async def replayer(ctx: AgentContext, value: Any) -> Any:
        handles = [await ctx.spawn("square", {"n": n}) for n in (2, 3)]
        await ctx.sleep(0.2)
        return await ctx.gather(*handles)

    task = await engine.submit("replayer", None, task_id="replayer")
    state = await _drive(engine, task)
    assert state.output == [4, 9]
    assert sorted(await _tasks(engine)) == [
        "replayer", "replayer:child:value-0", "replayer:child:value-1"]
    assert set(runs.values()) == {1}


async def test_bad_spawns_are_typed_errors_with_nothing_written(engine: Engine) -> None:
    """An unknown agent, a bad input or policy, an ancestor's id (a cycle), a handle of
    a task that is not a child: each a typed error at the call, nothing written."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)
    await engine.submit("square", {"n": 1}, task_id="stranger")
    seen: dict[str, str] = {}

    async def refused(name: str, call: Any) -> None:
        try:
            await call
        except InvalidInput as error:
            seen[name] = type(error).__name__

    @engine.agent("reckless")
    async def reckless(ctx: AgentContext, value: Any) -> Any:
        await refused("agent", ctx.spawn("nobody", None))
        await refused("input", ctx.spawn("square", {"n": "x"}))
        await refused("policy", ctx.spawn("square", {"n": 1}, on_parent_end="maybe"))  # type: ignore[arg-type]
        await refused("self", ctx.spawn("square", {"n": 1}, task_id=ctx.task_id))
        await refused("handle_self", ctx.child(ctx.task_id))
        await refused("stranger", ctx.child("stranger"))
        try:
            await ctx.child("nowhere")
        except UnknownTask:
            seen["nowhere"] = "UnknownTask"
        # The journal did not move: the next spawn is the first call.
        handle = await ctx.spawn("square", {"n": 4})
        return {"child": handle.task_id, "result": await handle.result()}

    task = await engine.submit("reckless", None, task_id="reckless")
    state = await _drive(engine, task)
    assert seen == {"agent": UnknownAgent.__name__, "input": "InvalidInput",
                    "policy": "InvalidInput", "self": TaskCycle.__name__,
                    "handle_self": TaskCycle.__name__, "stranger": NotAChild.__name__,
                    "nowhere": "UnknownTask"}
    assert state.output == {"child": "reckless:child:value-0", "result": 16}
    assert sorted(await _tasks(engine)) == ["reckless", "reckless:child:value-0", "stranger"]


async def test_a_child_cannot_await_its_parent(engine: Engine) -> None:
    """A child asking for a handle of its parent (a cycle: each would wait for the
    other) gets TaskCycle at that call."""
    outcome: dict[str, str] = {}

    @engine.agent("kid")
    async def kid(ctx: AgentContext, value: Any) -> str:
        try:
            await ctx.child(value["parent"])
        except TaskCycle as error:
            outcome["error"] = error.awaited
        return "done"

    @engine.agent("mum")
    async def mum(ctx: AgentContext, value: Any) -> Any:
        return await (await ctx.spawn("kid", {"parent": ctx.task_id})).result()

    task = await engine.submit("mum", None, task_id="mum")
    state = await _drive(engine, task)
    assert state.output == "done"
    assert outcome == {"error": "mum"}


async def test_a_parent_cannot_await_another_tenants_task(database_dsn: str) -> None:
    """A task id of another tenant is invisible: asking for its handle is UnknownTask,
    and a spawn under that id creates a task of the parent's own tenant."""
    other = await connect(database_dsn, migrate=False, tenant="tenant-b", pool_size_max=2)
    mine = await connect(database_dsn, migrate=False, tenant="tenant-a", pool_size_max=4)
    try:
        @other.agent("secret")
        async def secret(ctx: AgentContext, value: Any) -> str:
            return "b's data"

        await other.submit("secret", None, task_id="b-task")
        await run_worker_until_idle(other, **FAST)
        seen: dict[str, Any] = {}

        @mine.agent("secret")
        async def own(ctx: AgentContext, value: Any) -> str:
            return "a's data"

        @mine.agent("snoop")
        async def snoop(ctx: AgentContext, value: Any) -> Any:
            try:
                await ctx.child("b-task")
            except UnknownTask as error:
                seen["error"] = error.task_id
            return await (await ctx.spawn("secret", None, task_id="b-task")).result()

        task = await mine.submit("snoop", None, task_id="snoop")
        state = await _drive(mine, task)
        assert seen == {"error": "b-task"}
        assert state.output == "a's data"
        b_state = await other.state("b-task")
        assert b_state.output == "b's data" and b_state.parent_task_id is None
    finally:
        await mine.close()
        await other.close()


async def test_child_ending_wakes_the_parent_in_the_same_transaction(engine: Engine) -> None:
    """The wake-up is written with the child's terminal event: the moment the child is
    COMPLETED, its parent is already RESUMING with the signal in its inbox."""
    runs: Counter[str] = Counter()
    _register_children(engine, runs)

    @engine.agent("waiter")
    async def waiter(ctx: AgentContext, value: Any) -> Any:
        return await (await ctx.spawn("forever", None)).result()

    task = await engine.submit("waiter", None, task_id="waiter")
    await run_worker_until_idle(engine, **FAST)
    assert (await engine.head(task)).status is Status.WAITING
    # The child ends by cancellation (no worker runs now): one statement, one transaction.
    await engine.cancel("waiter:child:value-0")
    assert (await engine.head(task)).status is Status.RESUMING
    rows = await engine.database.fetch(
        "SELECT name, dedup_key FROM wal_signals WHERE tenant = current_setting("
        "'wal.tenant', true) AND task_id = 'waiter'")
    assert [(r["name"], r["dedup_key"]) for r in rows] == [
        ("~child:waiter:child:value-0", "child:waiter:child:value-0")]


async def test_children_under_a_tenants_runtime_role(tenant_roles: Any) -> None:
    """As a tenant's own login role (no superuser rights): a spawn writes its policy, a
    child's ending wakes its parent and a parent's cancellation cancels its child."""
    credentials = await tenant_roles.create("tenant-kids")
    engine = await connect(credentials.dsn, migrate=False, pool_size_max=4)
    try:
        runs: Counter[str] = Counter()
        _register_children(engine, runs)

        @engine.agent("family")
        async def family(ctx: AgentContext, value: Any) -> Any:
            doubled = await (await ctx.spawn("square", {"n": 3})).result()
            waiting = await ctx.spawn("forever", None)
            return [doubled, await waiting.result()]

        task = await engine.submit("family", None, task_id="family")

        async def parked_on_the_second_child() -> None:
            # A worker run until idle can end just as the first child's ending wakes the
            # parent (RESUMING): run again until the parent waits on the second child.
            while not ((await engine.head(task)).status is Status.WAITING
                       and "family:child:value-2" in await _tasks(engine)):
                await run_worker_until_idle(engine, **FAST)

        await asyncio.wait_for(parked_on_the_second_child(), 30)
        assert await engine.cancel(task)
        assert await _tasks(engine) == {"family": "FAILED", "family:child:value-0": "COMPLETED",
                                        "family:child:value-2": "FAILED"}
    finally:
        await engine.close()
