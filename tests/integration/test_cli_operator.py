"""``wal-engine pending``, ``reconcile`` and ``timer fire``: what waits on a person, with
the call and its arguments; telling an escalated call's outcome; a durable sleep made due."""

from __future__ import annotations

from typing import Any

from tests.integration.test_cli_agents import cli, drive, lines, one_error_line
from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.crash import crash_at, expire_leases, run_worker_until_idle

CHARGES: list[Any] = []


def register(engine: Engine) -> None:
    """A sleeper, a signal waiter, an approval and an unsafe call that may be escalated."""

    async def charge(args: dict[str, Any]) -> dict[str, Any]:
        CHARGES.append(args)
        return {"charged": args["cents"]}

    @engine.agent("op-sleep")
    async def sleeper(ctx: AgentContext, _: Any) -> Any:
        await ctx.sleep(3600)
        return "woke"

    @engine.agent("op-signal")
    async def waiter(ctx: AgentContext, _: Any) -> Any:
        return await ctx.wait_for_signal("go")

    @engine.agent("op-approve")
    async def approver(ctx: AgentContext, _: Any) -> Any:
        return await ctx.tool("wire", charge, {"cents": 7}, approval=True)

    @engine.agent("op-unsafe")
    async def unsafe(ctx: AgentContext, _: Any) -> Any:
        return await ctx.tool("charge", charge, {"cents": 5}, idempotent=False,
                              on_uncertain="wait")


async def test_timer_fire_resumes_a_sleeping_task(engine: Engine) -> None:
    """A task parked on ctx.sleep(3600) finishes once its timer is fired; a task not
    sleeping is a usage error."""
    register(engine)
    dsn = engine.database.dsn
    task = await engine.submit("op-sleep")
    await run_worker_until_idle(engine)
    assert str((await engine.head(task)).status) == "WAITING"
    fired = await cli("timer", "fire", task, "--dsn", dsn)
    assert fired.exit_code == 0, fired.output
    assert (await drive(engine, task)).output == "woke"
    again = await cli("timer", "fire", task, "--dsn", dsn)
    assert again.exit_code == 2 and "not sleeping" in one_error_line(again)


async def test_pending_lists_each_wait_and_reconcile_resolves_one(engine: Engine) -> None:
    """pending names the signal, the approval (tool, arguments and their hash) and the
    escalated call (tool, arguments); reconcile --failed lets the escalated task go on to
    its end."""
    register(engine)
    dsn = engine.database.dsn
    signal_task = await engine.submit("op-signal", task_id="op-1-signal")
    approve_task = await engine.submit("op-approve", task_id="op-2-approve")
    await run_worker_until_idle(engine)
    unsafe_task = await engine.submit("op-unsafe", task_id="op-3-unsafe")
    with crash_at("after_effect_before_result") as crash:
        await run_worker_until_idle(engine)
    assert crash.fired
    await expire_leases(engine)
    await run_worker_until_idle(engine)
    listed = {item["task_id"]: item for item in
              lines((await cli("pending", "--dsn", dsn, "--json")).stdout)}
    assert set(listed) == {signal_task, approve_task, unsafe_task}
    assert listed[signal_task]["waiting_for"] == "signal"
    assert listed[signal_task]["signal"] == "go"
    approval = listed[approve_task]
    assert approval["waiting_for"] == "approval" and approval["tool"] == "wire"
    assert len(approval["args_hash"]) == 64
    assert approval["arguments"] == {"cents": 7}  # what the approver approves, not a hash
    escalated = listed[unsafe_task]
    assert escalated["waiting_for"] == "reconcile" and escalated["tool"] == "charge"
    assert escalated["arguments"] == {"cents": 5}
    human = (await cli("pending", "--dsn", dsn)).stdout
    assert "approval of wire({'cents': 7})" in human
    assert f"wal-engine reconcile {unsafe_task} {escalated['call_id']}" in human
    both = await cli("reconcile", unsafe_task, escalated["call_id"], "--result", "{}",
                     "--failed", "x", "--dsn", dsn)
    assert both.exit_code == 2
    wrong = await cli("reconcile", signal_task, "tool-0", "--failed", "x", "--dsn", dsn)
    assert wrong.exit_code == 2 and "cannot be reconciled" in one_error_line(wrong)
    early = await cli("reconcile", unsafe_task, escalated["call_id"], "--result", "{}",
                      "--dsn", dsn)
    assert early.exit_code == 2 and "cannot be reconciled" in one_error_line(early)
    # The in-process "worker" that made the attempt is gone: --force, as an operator would.
    done = await cli("reconcile", unsafe_task, escalated["call_id"], "--result",
                     '{"charged": 5}', "--force", "--dsn", dsn, "--json")
    assert done.exit_code == 0, done.output
    final = await drive(engine, unsafe_task)
    assert str(final.status) == "COMPLETED" and final.output == {"charged": 5}
