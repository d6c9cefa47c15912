"""Time skipped through the engine's injected clock: backoffs and sleeps take no waiting."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from wal_engine.engine import Engine
from wal_engine.events import LlmCallFailed, TimerStarted, ToolCallFailed
from wal_engine.retries import RetryPolicy, TransientError
from wal_engine.runtime.context import AgentContext, LlmResponse
from wal_engine.state_machine import Status
from wal_engine.testing import ManualClock, advance_timers

from .test_runtime import FAST, drive

HOUR_S = 3600.0
SLOW_RETRY = RetryPolicy(max_attempts=3, initial_delay_s=HOUR_S, multiplier=1.0,
                         max_delay_s=HOUR_S, durable_after_s=10 * HOUR_S)
"""Backoffs of up to an hour, all waited in memory (below durable_after_s)."""


async def test_an_hour_of_backoff_is_skipped_by_a_manual_clock(engine: Engine) -> None:
    """Two tool failures with hour-long backoffs complete at once under a manual clock, and
    ctx.now() and the recorded due times moved by exactly the backoff slept."""
    clock = ManualClock()
    engine.clock = clock
    failures = {"left": 2}

    def flaky(_: Any) -> str:
        if failures["left"]:
            failures["left"] -= 1
            raise TransientError("try again later")
        return "done"

    @engine.agent("patient")
    async def patient(ctx: AgentContext, _: Any) -> Any:
        before = await ctx.now()
        result = await ctx.tool("flaky", flaky, retry=SLOW_RETRY)
        return {"before": before, "after": await ctx.now(), "result": result}

    started = time.monotonic()
    task_id = await engine.submit("patient")
    state = await drive(engine, task_id)
    assert time.monotonic() - started < 15  # Two real hours would not fit.
    assert state.status is Status.COMPLETED and state.output["result"] == "done"
    failed = [r.decode() for r in await engine.history(task_id) if r.type == "tool_call_failed"]
    assert [type(e) for e in failed] == [ToolCallFailed, ToolCallFailed]
    last_due_s = max(e.retry_at_ms for e in failed if isinstance(e, ToolCallFailed)
                     and e.retry_at_ms is not None) / 1000
    before_ms = state.output["before"] * 1000
    first = failed[0]
    assert isinstance(first, ToolCallFailed) and first.retry_at_ms is not None
    # Full jitter: each backoff is a draw below the hour's cap, counted from the failure.
    assert before_ms <= first.retry_at_ms <= before_ms + HOUR_S * 1000
    assert clock.slept_s > 0
    assert state.output["before"] == pytest.approx(clock.time_s() - clock.slept_s, abs=1e-3)
    assert state.output["after"] - state.output["before"] == pytest.approx(clock.slept_s,
                                                                          abs=1e-3)
    # The clock stopped at the second retry's due time: nothing else moved it.
    assert last_due_s == pytest.approx(state.output["after"], abs=2e-3)


async def test_a_durable_sleep_records_the_manual_clock(engine: Engine) -> None:
    """ctx.sleep(3600) records its wake time on the manual clock; advanced by an hour (and
    the database's timer made due), the task finishes promptly an hour later by ctx.now()."""
    clock = ManualClock()
    engine.clock = clock

    @engine.agent("sleeper")
    async def sleeper(ctx: AgentContext, _: Any) -> Any:
        before = await ctx.now()
        await ctx.sleep(HOUR_S)
        return {"before": before, "after": await ctx.now()}

    task_id = await engine.submit("sleeper")
    worker = engine.worker(concurrency=1, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(15):
            while (await engine.head(task_id)).status is not Status.WAITING:
                await asyncio.sleep(0.02)
            clock.advance(HOUR_S)
            await advance_timers(engine)
            state = await engine.wait(task_id, timeout_s=15)
    finally:
        worker.stop()
        await running
    started = [r.decode() for r in await engine.history(task_id) if r.type == "timer_started"]
    assert isinstance(started[0], TimerStarted)
    assert started[0].wake_at_ms == round(state.output["before"] * 1000) + 3_600_000
    assert state.output["after"] - state.output["before"] == pytest.approx(HOUR_S, abs=1e-3)


async def test_an_llm_backoff_is_skipped_too(engine: Engine) -> None:
    """An LLM call's in-memory backoff goes through the same clock as a tool's."""
    clock = ManualClock()
    engine.clock = clock
    failures = {"left": 1}

    async def model(_: Any) -> LlmResponse:
        if failures["left"]:
            failures["left"] -= 1
            raise TransientError("overloaded")
        return LlmResponse(content="hi", input_tokens=1, output_tokens=1)

    @engine.agent("chat")
    async def chat(ctx: AgentContext, _: Any) -> Any:
        return await ctx.llm("m", model, {"q": 1}, retry=SLOW_RETRY)

    started = time.monotonic()
    task_id = await engine.submit("chat")
    state = await drive(engine, task_id)
    assert time.monotonic() - started < 15
    assert state.status is Status.COMPLETED and state.output == "hi"
    failed = [r.decode() for r in await engine.history(task_id) if r.type == "llm_call_failed"]
    assert len(failed) == 1 and isinstance(failed[0], LlmCallFailed) and failed[0].retryable
    assert 0 < clock.slept_s <= HOUR_S
