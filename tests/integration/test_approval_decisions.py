"""ctx.approval: a human's decision the agent code branches on, journaled, never acting."""

from __future__ import annotations

from typing import Any

from tests.helpers import drive
from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext


def register(engine: Engine, runs: list[str]) -> None:
    """An agent that asks for a decision, sleeps (so its code runs again after the
    decision is recorded), and reports the decision."""

    @engine.agent("decider")
    async def decider(ctx: AgentContext, amount: int) -> Any:
        runs.append("run")
        decision = await ctx.approval("refund", {"amount": amount})
        await ctx.sleep(0)
        return {"approved": decision.approved, "approver": decision.approver,
                "comment": decision.comment}


async def test_refusal_is_returned_and_replayed_not_fatal(engine: Engine) -> None:
    """A refusal comes back to the code as a decision (the task completes), the re-run
    after the sleep gets the same decision from the journal, and nothing else waits."""
    runs: list[str] = []
    register(engine, runs)
    task_id = await engine.submit("decider", 20)
    await drive(engine, task_id, "WAITING")
    (call_id, request), = (await engine.state(task_id)).approvals.items()
    assert request.tool == "refund" and request.approved is None
    await engine.approve(task_id, call_id, approver="ops", approved=False, comment="no")
    state = await drive(engine, task_id)
    assert str(state.status) == "COMPLETED", state.failure
    assert state.output == {"approved": False, "approver": "ops", "comment": "no"}
    assert len(runs) == 3  # Asked, decided then asleep, woken: the last one replayed.
    values = [call for call in state.calls.values() if call.name == "approval:refund"]
    assert [call.result["approved"] for call in values] == [False]
    assert state.usage.tool_calls == 0
    assert (await engine.store.verify_task(task_id)).ok


async def test_approval_of_other_arguments_is_ignored(engine: Engine) -> None:
    """An answer carrying the hash of other arguments decides nothing; the task keeps
    waiting until the right call is approved."""
    runs: list[str] = []
    register(engine, runs)
    task_id = await engine.submit("decider", 20)
    await drive(engine, task_id, "WAITING")
    (call_id,) = (await engine.state(task_id)).approvals
    await engine.approve(task_id, call_id, approver="ops", args_hash="0" * 64)
    await drive(engine, task_id, "WAITING")
    assert (await engine.state(task_id)).approvals[call_id].approved is None
    await engine.approve(task_id, call_id, approver="ops")
    state = await drive(engine, task_id)
    assert state.output == {"approved": True, "approver": "ops", "comment": None}


async def test_recorded_decision_for_other_arguments_is_a_divergence(engine: Engine) -> None:
    """Code that, on a re-run, asks about other arguments than the recorded decision
    answered fails with a non-determinism diagnosis instead of reusing the decision."""
    amounts = [20, 20, 30]

    @engine.agent("changing-decider")
    async def changing(ctx: AgentContext, _: Any) -> Any:
        decision = await ctx.approval("refund", {"amount": amounts.pop(0)})
        await ctx.sleep(0)
        return decision.approved

    task_id = await engine.submit("changing-decider")
    await drive(engine, task_id, "WAITING")
    (call_id,) = (await engine.state(task_id)).approvals
    await engine.approve(task_id, call_id, approver="ops")
    state = await drive(engine, task_id)
    assert amounts == []
    assert str(state.status) == "FAILED"
    assert state.failure is not None and state.failure.reason == "nondeterminism"
