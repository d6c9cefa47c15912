"""Changed agent code meets tasks in flight: versions, patches, recovery hooks, and a run
that loses its connection, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from wal_engine.engine import Engine, connect
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.hooks import AgentHooks, HookEvent
from wal_engine.runtime.replayer import check_history, check_tasks
from wal_engine.state_machine import Status
from wal_engine.testing.crash import crash_at
from wal_engine.testing.proxy import FaultProxy

FAST: dict[str, Any] = {"lease_ttl_ms": 900, "heartbeat_ms": 200, "poll_ms": 50,
                        "sweep_ms": 100}


async def wait_for_status(engine: Engine, task_id: str, status: Status,
                          timeout_s: float = 20.0) -> None:
    """Wait (bounded) until the task's head has ``status``."""
    async def reached() -> None:
        while (await engine.head(task_id)).status is not status:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(reached(), timeout_s)


class Running:
    """A worker of ``engine`` running in the background until the block ends."""

    def __init__(self, engine: Engine, **config: Any) -> None:
        self.worker = engine.worker(concurrency=4, **{**FAST, **config})
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Any:
        self.task = asyncio.create_task(self.worker.run())
        return self.worker

    async def __aexit__(self, *_: object) -> None:
        self.worker.stop()
        assert self.task is not None
        await self.task


@pytest.fixture
async def second_engine(database_dsn: str) -> AsyncIterator[Engine]:
    """Another engine on the same database: the next deploy's code."""
    engine = await connect(database_dsn, migrate=False, pool_size_max=5)
    yield engine
    await engine.close()


def event_types(history: list[Any]) -> list[str]:
    return [record.type for record in history]


# ----------------------------------------------------------------------------- versions


async def test_workers_claim_only_tasks_of_versions_they_run(
        engine: Engine, second_engine: Engine) -> None:
    """A v1 task waits for a v1 worker while v2 workers run; code declaring v1 compatible
    takes it; a task submitted without the code is pinned by its first claim."""
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return {"version": ctx.task_version}

    engine.register("versioned", agent, version="1")
    second_engine.register("versioned", agent, version="2")
    old = await engine.submit("versioned", {})
    assert (await engine.head(old)).agent_version == "1"
    async with Running(second_engine):
        fresh = await second_engine.submit("versioned", {})
        assert (await second_engine.wait(fresh, timeout_s=20)).output == {"version": "2"}
        assert (await engine.head(old)).status is Status.QUEUED
    second_engine.register("versioned", agent, version="2", compatible=("1",))
    async with Running(second_engine):
        state = await second_engine.wait(old, timeout_s=20)
    assert state.output == {"version": "1"} and state.agent_version == "1"
    bare = await connect(second_engine.database.dsn, migrate=False, pool_size_max=2)
    try:
        unpinned = await bare.submit("versioned", {})  # No code here: no version recorded.
    finally:
        await bare.close()
    assert (await engine.head(unpinned)).agent_version is None
    async with Running(second_engine):
        state = await second_engine.wait(unpinned, timeout_s=20)
    assert state.agent_version == "2"
    claimed = [r for r in await engine.history(unpinned) if r.type == "task_claimed"]
    assert claimed and claimed[0].decode().agent_version == "2"  # type: ignore[attr-defined]


async def test_invalid_versions_are_refused(engine: Engine) -> None:
    """An empty or oversized version is a typed error at registration."""
    from wal_engine.errors import InvalidInput

    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return None

    with pytest.raises(InvalidInput):
        engine.register("bad", agent, version="")
    with pytest.raises(InvalidInput):
        engine.register("bad", agent, version="x" * 65)


@pytest.mark.parametrize(("name", "version", "compatible"), [
    ("bad", "1\x00", ()), ("bad", "\udc80", ()), ("bad", "2", ("1\x00",)),
    ("bad\x00", "1", ()), ("\udcff", "1", ()),
], ids=["version-nul", "version-surrogate", "compatible-nul", "name-nul", "name-surrogate"])
async def test_versions_and_names_postgresql_cannot_store_are_refused_at_registration(
        engine: Engine, name: str, version: str, compatible: tuple[str, ...]) -> None:
    """A NUL or lone surrogate is a typed error at registration (a worker with such a
    version used to fail its claim statement on every poll and claim nothing)."""
    from wal_engine.errors import InvalidInput

    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return None

    with pytest.raises(InvalidInput, match=r"not valid text|must not contain NUL"):
        engine.register(name, agent, version=version, compatible=compatible)
    assert name not in engine.agents


# ----------------------------------------------------------------------------- patches


def _v1(calls: list[str]) -> Any:
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.tool("a", lambda args: calls.append("a") or "a", {})
        go = await ctx.wait_for_signal("go")
        b = await ctx.tool("b", lambda args: calls.append(f"b{args['n']}") or "b", {"n": 1})
        return {"go": go, "b": b}
    return agent


def _v2(calls: list[str]) -> Any:
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.tool("a", lambda args: calls.append("a") or "a", {})
        if await ctx.patched("add-c"):
            await ctx.tool("c", lambda args: calls.append("c") or "c", {})
        go = await ctx.wait_for_signal("go")
        n = 2 if await ctx.patched("b-args") else 1
        b = await ctx.tool("b", lambda args: calls.append(f"b{args['n']}") or "b", {"n": n})
        return {"go": go, "b": b}
    return agent


async def test_patched_keeps_old_branches_for_old_histories(
        engine: Engine, second_engine: Engine) -> None:
    """A task started on v1 and waiting across the deploy replays v1's branch up to its
    history's end and takes the patched branch after it; a new task takes every patch;
    both histories replay against v2, and v1's code no longer matches the patched one."""
    old_calls: list[str] = []
    new_calls: list[str] = []
    engine.register("flow", _v1(old_calls), version="1")
    second_engine.register("flow", _v2(new_calls), version="2", compatible=("1",))
    old = await engine.submit("flow", {})
    async with Running(engine):
        await wait_for_status(engine, old, Status.WAITING)
    new = await second_engine.submit("flow", {})
    async with Running(second_engine):
        await wait_for_status(second_engine, new, Status.WAITING)
        await second_engine.signal(old, "go", "yes")
        await second_engine.signal(new, "go", "yes")
        await second_engine.wait(old, timeout_s=20)
        await second_engine.wait(new, timeout_s=20)
    old_history = event_types(await engine.history(old))
    assert "tool_call_intended" in old_history
    # The old task: a on v1; then, past its history's end on v2, b with v2's arguments.
    assert old_calls == ["a"] and sorted(new_calls) == ["a", "b2", "b2", "c"]
    assert old_history.count("patch_marked") == 1  # b-args only: add-c was in its past.
    assert event_types(await engine.history(new)).count("patch_marked") == 2
    for task_id in (old, new):
        assert (await check_history(second_engine, task_id)).ok
    assert not (await check_history(engine, new)).ok  # v1's code: no c, other b args.
    check = await check_tasks(second_engine, finished_sample=10)
    assert check.ok and check.checked == 2


async def test_deprecate_patch_replays_histories_with_the_marker(
        engine: Engine, second_engine: Engine) -> None:
    """Once the old branch is gone, deprecate_patch lets marked histories replay."""
    calls: list[str] = []

    async def patched(ctx: AgentContext, task_input: Any) -> Any:
        if await ctx.patched("fix"):
            return await ctx.tool("new", lambda args: calls.append("new") or 1, {})
        return await ctx.tool("old", lambda args: calls.append("old") or 0, {})

    async def cleaned(ctx: AgentContext, task_input: Any) -> Any:
        ctx.deprecate_patch("fix")
        return await ctx.tool("new", lambda args: calls.append("new") or 1, {})

    engine.register("p", patched)
    second_engine.register("p", cleaned)
    task_id = await engine.submit("p", {})
    async with Running(engine):
        assert (await engine.wait(task_id, timeout_s=20)).output == 1
    assert (await check_history(second_engine, task_id)).ok


# ----------------------------------------------------------------------------- hooks


async def test_hooks_run_at_each_moment_and_a_failing_hook_is_recorded(
        engine: Engine) -> None:
    """claim, checkpoint, orphaned + resume (after a crash), escalation and complete run
    with their reasons; a raising hook is recorded as hook_failed and the task finishes."""
    seen: list[tuple[str, str]] = []

    def note(event: HookEvent) -> None:
        seen.append((event.hook, event.reason))

    async def broken(event: HookEvent) -> None:
        seen.append((event.hook, event.reason))
        raise RuntimeError("the sandbox did not open")

    hooks = AgentHooks(on_claim=note, on_resume=broken, on_orphaned=note, on_checkpoint=note,
                       on_escalation=note, on_complete=note)

    @engine.agent("hooked", hooks=hooks)
    async def hooked(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.checkpoint(next_action="charge")

        def charge(args: Any) -> Any:
            raise ConnectionResetError("charged, then the answer was lost")

        return await ctx.tool("charge", charge, {}, idempotent=False)

    task_id = await engine.submit("hooked", {})
    # The first claim's run is abandoned at once; the lease expires and the task resumes.
    with crash_at("after_claim") as crash:
        async with Running(engine):
            state = await engine.wait(task_id, timeout_s=20)
    assert crash.fired
    assert state.status is Status.FAILED and state.failure is not None
    assert state.failure.reason == "uncertain_side_effect"
    assert ("on_orphaned", "orphaned") in seen and ("on_resume", "orphaned") in seen
    assert ("on_checkpoint", "checkpoint") in seen
    assert ("on_escalation", "connection_lost") in seen
    assert ("on_complete", "failed") in seen
    failed = [r.decode() for r in await engine.history(task_id) if r.type == "hook_failed"]
    assert [f.hook for f in failed] == ["on_resume"]  # type: ignore[attr-defined]
    # The failure is one more event of the chain: the log verifies, hashes and semantics.
    assert (await engine.store.verify_task(task_id)).ok


async def _until(condition: Any) -> None:
    """Poll ``condition`` (callers bound the wait with ``asyncio.wait_for``)."""
    while not condition():
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------- lost connections


async def test_a_run_that_loses_its_connection_goes_on_under_its_lease(
        database_dsn: str) -> None:
    """Every connection of the engine is reset while a tool runs: the run reads the log
    back, records run_interrupted, keeps its lease (one claim) and the tool acts once."""
    proxy = await FaultProxy.for_dsn(database_dsn).start()
    engine = await connect(proxy.dsn(database_dsn), migrate=False, pool_size_max=4)
    acted: list[int] = []
    release = asyncio.Event()
    try:
        @engine.agent("steady")
        async def steady(ctx: AgentContext, task_input: Any) -> Any:
            async def pay(args: Any) -> Any:
                acted.append(1)
                await release.wait()
                return "paid"

            paid = await ctx.tool("pay", pay, {}, idempotent=False)
            await ctx.checkpoint(next_action="done")
            return paid

        task_id = await engine.submit("steady", {})
        async with Running(engine, lease_ttl_ms=6000, heartbeat_ms=1000):
            await asyncio.wait_for(_until(lambda: bool(acted)), 20)
            proxy.reset()  # Every engine connection through the proxy breaks.
            release.set()
            state = await engine.wait(task_id, timeout_s=30)
    finally:
        await engine.close()
        await proxy.close()
    assert state.status is Status.COMPLETED and state.output == "paid"
    assert acted == [1] and state.attempts == 1
    assert state.interruptions >= 1


async def test_unsettled_outcome_is_recorded_after_reconnect(database_dsn: str) -> None:
    """An outcome whose append broke with the connection is recorded after the read-back
    (the effect is not run again, nor escalated)."""
    admin = await asyncpg.connect(database_dsn)
    engine = await connect(database_dsn, migrate=False, pool_size_max=4)
    acted: list[int] = []
    try:
        @engine.agent("settle")
        async def settle(ctx: AgentContext, task_input: Any) -> Any:
            async def pay(args: Any) -> Any:
                acted.append(1)
                # Kill every pooled session of the engine: the result's append breaks.
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name LIKE 'wal-engine:%:pool' AND pid <> pg_backend_pid()")
                return "paid"

            return await ctx.tool("pay", pay, {}, idempotent=False)

        task_id = await engine.submit("settle", {})
        async with Running(engine, lease_ttl_ms=6000, heartbeat_ms=1000):
            state = await engine.wait(task_id, timeout_s=30)
    finally:
        await engine.close()
        await admin.close()
    assert state.status is Status.COMPLETED and state.output == "paid" and acted == [1]
    assert "tool_call_uncertain" not in event_types(await _history(database_dsn, task_id))


async def _history(dsn: str, task_id: str) -> list[Any]:
    engine = await connect(dsn, migrate=False, pool_size_max=2)
    try:
        return await engine.history(task_id)
    finally:
        await engine.close()
