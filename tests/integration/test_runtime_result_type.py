"""ctx.tool and ctx.llm with result_type: converted through msgspec, live and on replay."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from wal_engine import limits
from wal_engine.engine import Engine
from wal_engine.errors import ResultTypeError, ToolError
from wal_engine.events import ToolCallFailed
from wal_engine.runtime.context import AgentContext, LlmResponse
from wal_engine.runtime.replayer import check_history
from wal_engine.state_machine import Status

from .test_runtime import FAST, drive


class Charge(msgspec.Struct, frozen=True):
    """What the payment tool returns, as the agent wants it."""

    charge_id: str
    amount_cents: int


class Verdict(msgspec.Struct, frozen=True):
    label: str
    confidence: float


async def test_a_tool_result_converts_to_its_result_type(engine: Engine) -> None:
    """The agent gets a Charge (not a dict) live, and a re-check of the history against
    the same code gets the same Charge from the log."""
    seen: list[Any] = []
    calls = {"n": 0}

    async def charge(args: Any) -> dict[str, Any]:
        calls["n"] += 1
        return {"charge_id": "ch_1", "amount_cents": args["cents"]}

    @engine.agent("typed")
    async def typed(ctx: AgentContext, _: Any) -> Any:
        result = await ctx.tool("charge", charge, {"cents": 1250}, result_type=Charge)
        seen.append(result)
        return {"type": type(result).__name__, "amount": result.amount_cents}

    task_id = await engine.submit("typed")
    state = await drive(engine, task_id)
    assert state.status is Status.COMPLETED
    assert state.output == {"type": "Charge", "amount": 1250}
    report = await check_history(engine, task_id)
    assert report.ok and report.outcome == "completed" and report.output_matches
    assert seen == [Charge("ch_1", 1250), Charge("ch_1", 1250)] and calls["n"] == 1


async def test_a_mismatch_is_recorded_as_the_calls_failure(engine: Engine) -> None:
    """A result that does not fit is recorded as a non-retryable ResultTypeError failure
    (the tool ran once), and the agent catches the same typed error live and on replay."""
    calls = {"n": 0}
    caught: list[str] = []

    def charge(_: Any) -> dict[str, Any]:
        calls["n"] += 1
        return {"charge_id": "ch_1", "amount_cents": "twelve"}

    @engine.agent("mismatch")
    async def mismatch(ctx: AgentContext, _: Any) -> Any:
        try:
            await ctx.tool("charge", charge, None, result_type=Charge)
        except ResultTypeError as error:
            caught.append(error.call_id)
            return {"error_type": error.error_type, "error": error.error}
        return "converted"

    task_id = await engine.submit("mismatch")
    state = await drive(engine, task_id)
    assert state.status is Status.COMPLETED and calls["n"] == 1
    assert state.output["error_type"] == "ResultTypeError"
    assert "amount_cents" in state.output["error"]
    failed = [r.decode() for r in await engine.history(task_id) if r.type == "tool_call_failed"]
    assert len(failed) == 1 and isinstance(failed[0], ToolCallFailed)
    assert failed[0].error_type == "ResultTypeError" and not failed[0].retryable
    report = await check_history(engine, task_id)
    assert report.ok and report.output_matches
    assert caught == [failed[0].call_id] * 2


async def test_a_mismatch_is_not_retried_and_fails_an_uncaught_task(engine: Engine) -> None:
    """Uncaught, the mismatch fails the task like any permanent failure of a call."""

    async def model(_: Any) -> LlmResponse:
        return LlmResponse(content={"label": "spam"}, input_tokens=3, output_tokens=2)

    @engine.agent("classify")
    async def classify(ctx: AgentContext, _: Any) -> Any:
        return await ctx.llm("m", model, {"text": "buy now"}, result_type=Verdict)

    task_id = await engine.submit("classify")
    state = await drive(engine, task_id)
    assert state.status is Status.FAILED and state.failure is not None
    assert state.failure.reason == "agent_error"
    assert state.failure.error is not None and "ResultTypeError" in state.failure.error
    assert state.usage.llm_calls == 1


async def test_an_llm_response_converts_and_replays(engine: Engine) -> None:
    """An LLM response's content converts to its result_type; the replay gets the same."""

    async def model(_: Any) -> LlmResponse:
        return LlmResponse(content={"label": "spam", "confidence": 0.9}, input_tokens=3)

    @engine.agent("verdict")
    async def verdict(ctx: AgentContext, _: Any) -> Any:
        result = await ctx.llm("m", model, {"text": "buy now"}, result_type=Verdict)
        assert isinstance(result, Verdict)
        return msgspec.to_builtins(result)

    task_id = await engine.submit("verdict")
    state = await drive(engine, task_id)
    assert state.status is Status.COMPLETED
    assert state.output == {"label": "spam", "confidence": 0.9}
    report = await check_history(engine, task_id)
    assert report.ok and report.output_matches


async def test_a_recorded_result_that_no_longer_fits_raises_on_replay(engine: Engine) -> None:
    """Code changed to a type the recorded result does not fit gets ResultTypeError from
    the log (nothing is called again), without result_type the plain value as before."""

    async def charge(_: Any) -> dict[str, Any]:
        return {"charge_id": "ch_1", "amount_cents": 5}

    @engine.agent("evolving")
    async def evolving(ctx: AgentContext, _: Any) -> Any:
        return await ctx.tool("charge", charge)

    task_id = await engine.submit("evolving")
    state = await drive(engine, task_id)
    assert state.output == {"charge_id": "ch_1", "amount_cents": 5}

    async def strict(ctx: AgentContext, _: Any) -> Any:
        return await ctx.tool("charge", charge, result_type=Verdict)

    report = await check_history(engine, task_id, agents={"evolving": strict})
    assert report.outcome == "diverged" and report.divergence is not None
    assert report.divergence.kind == "ending"
    assert "today's code raises ResultTypeError" in report.divergence.detail


def test_convert_result_refuses_a_mismatch_with_a_typed_error() -> None:
    """The conversion itself: a value that fits converts, one that does not raises."""
    from wal_engine.runtime.steps import convert_result

    assert convert_result("tool-1", {"charge_id": "c", "amount_cents": 1}, Charge) == \
        Charge("c", 1)
    assert convert_result("tool-1", [1, 2], tuple[int, ...]) == (1, 2)
    with pytest.raises(ResultTypeError) as raised:
        convert_result("tool-9", {"charge_id": "c"}, Charge)
    assert raised.value.call_id == "tool-9" and "amount_cents" in raised.value.error


async def test_a_blocking_def_tool_with_a_result_type_acts_once(engine: Engine) -> None:
    """A plain ``def`` tool that blocks for three leases, run by two workers: it runs on the
    worker's thread pool, the lease is kept, it acts once, and its result converts."""
    acted = {"n": 0}

    def charge(args: Any) -> dict[str, Any]:
        acted["n"] += 1
        time.sleep(3.0)  # A blocking client call (requests, boto3): not the loop's to wait.
        return {"charge_id": "ch_9", "amount_cents": args["cents"]}

    @engine.agent("blocking_typed")
    async def blocking_typed(ctx: AgentContext, _: Any) -> Any:
        charged = await ctx.tool("charge", charge, {"cents": 700}, idempotent=False,
                                 result_type=Charge)
        return {"type": type(charged).__name__, "amount": charged.amount_cents}

    task_id = await engine.submit("blocking_typed")
    timing = {**FAST, "lease_ttl_ms": 1000, "heartbeat_ms": 200}
    workers = [engine.worker(concurrency=2, **timing) for _ in range(2)]
    running = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        state = await engine.wait(task_id, timeout_s=30)
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*running)
    assert state.status is Status.COMPLETED, state.failure
    assert state.output == {"type": "Charge", "amount": 700} and acted["n"] == 1
    assert not [r for r in await engine.history(task_id) if r.type == "task_orphaned"]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE_RESULTS: dict[str, tuple[Any, Any, str]] = {
    "nested 2,000 deep": (_nested(2000), list[Any], "UnstorableResult"),
    # Over the per-value limit of large values (64 MiB, decision 61); 5 MB is stored (below).
    "a string over 64 MiB": ({"charge_id": "x" * (limits.payload_bytes_max + 1),
                              "amount_cents": 1}, Charge, "UnstorableResult"),
    "integer of 400 digits": ({"charge_id": "c", "amount_cents": 10**400}, Charge,
                              "UnstorableResult"),
    "NaN for an int": ({"charge_id": "c", "amount_cents": float("nan")}, Charge,
                       "ResultTypeError"),
}
"""Results a hostile or broken API returns: each a typed failure of the call, recorded."""


@pytest.mark.parametrize("case", list(HOSTILE_RESULTS))
async def test_a_hostile_result_is_a_typed_recorded_failure(engine: Engine, case: str) -> None:
    """The tool acts once; the agent catches a ToolError naming why; the failure is in the
    log, which verifies, and a re-check of the history against the code agrees."""
    value, result_type, error_type = HOSTILE_RESULTS[case]
    acted = {"n": 0}

    def api(_: Any) -> Any:
        acted["n"] += 1
        return value

    @engine.agent("hostile")
    async def hostile(ctx: AgentContext, _: Any) -> Any:
        try:
            await ctx.tool("api", api, None, idempotent=False, result_type=result_type)
        except ToolError as error:
            return {"error_type": error.error_type}
        return "accepted"

    task_id = await engine.submit("hostile")
    state = await drive(engine, task_id)
    assert state.status is Status.COMPLETED and acted["n"] == 1
    assert state.output == {"error_type": error_type}
    failed = [r.decode() for r in await engine.history(task_id) if r.type == "tool_call_failed"]
    assert len(failed) == 1 and isinstance(failed[0], ToolCallFailed)
    assert failed[0].error_type == error_type and not failed[0].retryable
    assert (await engine.store.verify_task(task_id)).ok
    assert (await check_history(engine, task_id)).ok


LARGE_RESULTS: dict[str, Any] = {
    "5 MB string": {"charge_id": "x" * 5_000_000, "amount_cents": 1},
    "200,000 extra keys": {"charge_id": "c", "amount_cents": 1,
                           **{f"k{i}": i for i in range(200_000)}},
}
"""Results that a 1 MiB payload cap refused before large values (decision 61): now stored in
wal_blobs and converted like any other, live and on replay."""


@pytest.mark.parametrize("case", list(LARGE_RESULTS))
async def test_a_large_result_is_stored_and_converted(engine: Engine, case: str) -> None:
    value = LARGE_RESULTS[case]
    acted = {"n": 0}

    def api(_: Any) -> Any:
        acted["n"] += 1
        return value

    @engine.agent("large")
    async def large(ctx: AgentContext, _: Any) -> Any:
        charge = await ctx.tool("api", api, None, idempotent=False, result_type=Charge)
        return {"id_length": len(charge.charge_id), "amount": charge.amount_cents}

    task_id = await engine.submit("large")
    state = await drive(engine, task_id)
    assert state.status is Status.COMPLETED and acted["n"] == 1
    assert state.output == {"id_length": len(value["charge_id"]), "amount": 1}
    assert (await engine.store.verify_task(task_id)).ok
    report = await check_history(engine, task_id)
    assert report.ok and report.output_matches
