"""Rate limiters against real PostgreSQL: grants, waits (in process and durable), settlement
to the recorded usage, a provider's 429, crashes that must not count a call twice, bad
input, a tenant's runtime role, and the CLI."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import pytest

from tests.integration.tenant_roles import TenantRoles
from tests.integration.test_cli_agents import cli, lines, one_error_line
from wal_engine.engine import Engine, connect
from wal_engine.errors import InvalidLimiter, RateLimited, UnknownLimiter
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import LlmResponse
from wal_engine.testing.crash import (
    advance_timers,
    crash_at,
    expire_leases,
    run_worker_until_idle,
)

FAST_RETRY = RetryPolicy(max_attempts=5, initial_delay_s=0.01, max_delay_s=0.05)


def _llm(input_tokens: int = 30, output_tokens: int = 20) -> Any:
    async def call(request: Any) -> LlmResponse:
        return LlmResponse(content=f"answer to {request}", input_tokens=input_tokens,
                           output_tokens=output_tokens)
    return call


async def _count(engine: Engine, table: str) -> int:
    return int((await engine.database.fetchrow(f"SELECT count(*) AS n FROM {table}"))["n"])


async def _types(engine: Engine, task_id: str) -> list[str]:
    return [event.type for event in await engine.history(task_id)]


async def test_define_list_delete_and_bad_definitions_write_nothing(engine: Engine) -> None:
    bad: list[dict[str, Any]] = [
        {"requests_per_period": 0}, {"requests_per_period": -5}, {"tokens_per_period": 0},
        {"tokens_per_period": -1}, {}, {"requests_per_period": 1.5},
        {"requests_per_period": True}, {"requests_per_period": 1, "period_s": 0},
        {"requests_per_period": 1, "period_s": float("nan")},
        {"requests_per_period": 1, "period_s": 86401},
        {"requests_per_period": 1, "tokens": "all"},
    ]
    for options in bad:
        with pytest.raises(InvalidLimiter):
            await engine.limiter("openai:gpt-x", **options)
    with pytest.raises(InvalidLimiter, match="name"):
        await engine.limiter("bad name!", requests_per_period=1)
    assert await _count(engine, "wal_limiters") == 0
    info = await engine.limiter("openai:gpt-x", requests_per_period=60,
                                tokens_per_period=90_000, period_s=60, tokens="output")
    assert (info.requests_per_period, info.tokens_per_period, info.token_kind,
            info.period_s, info.requests_in_window) == (60, 90_000, "output", 60.0, 0)
    changed = await engine.limiter("openai:gpt-x", requests_per_period=30, period_s=10)
    assert (changed.requests_per_period, changed.tokens_per_period) == (30, None)
    assert [i.name for i in await engine.limiters()] == ["openai:gpt-x"]
    await engine.delete_limiter("openai:gpt-x")
    with pytest.raises(UnknownLimiter):
        await engine.limiter_info("openai:gpt-x")
    with pytest.raises(UnknownLimiter):
        await engine.delete_limiter("openai:gpt-x")


async def test_llm_calls_take_grants_and_settle_to_the_recorded_usage(engine: Engine) -> None:
    await engine.limiter("model", requests_per_period=100, tokens_per_period=10_000,
                         period_s=60)
    await engine.limiter("model-in", tokens_per_period=10_000, period_s=60, tokens="input")

    @engine.agent("ask")
    async def ask(ctx: Any, _: Any) -> Any:
        first = await ctx.llm("m", _llm(30, 20), "a", limiter="model", estimate_tokens=900)
        second = await ctx.llm("m", _llm(7, 5), "b", limiter="model-in", estimate_tokens=900)
        return [first, second]

    task_id = await engine.submit("ask", None)
    await run_worker_until_idle(engine)
    assert (await engine.state(task_id)).output == ["answer to a", "answer to b"]
    both, inputs = await engine.limiter_info("model"), await engine.limiter_info("model-in")
    assert (both.requests_in_window, both.tokens_in_window, both.requests_reserved,
            both.tokens_reserved) == (1, 50, 0, 0)
    assert (inputs.requests_in_window, inputs.tokens_in_window) == (1, 7)


async def test_a_call_over_the_limit_waits_in_process_and_never_exceeds_it(
        engine: Engine) -> None:
    """Two requests per second, six calls from two tasks: no second-long window holds more
    than two call starts (the ledger), and the calls waited rather than failed."""
    await engine.limiter("tight", requests_per_period=2, period_s=1.0)
    starts: list[float] = []

    async def record(request: Any) -> LlmResponse:
        starts.append(time.monotonic())
        return LlmResponse(content=request)

    @engine.agent("burst")
    async def burst(ctx: Any, n: int) -> int:
        for i in range(3):
            await ctx.llm("m", record, f"{n}-{i}", limiter="tight", estimate_tokens=0)
        return n

    ids = [await engine.submit("burst", n) for n in range(2)]
    await run_worker_until_idle(engine)
    assert [(await engine.state(i)).output for i in ids] == [0, 1]
    starts.sort()
    assert len(starts) == 6
    # Any 3 consecutive starts span at least the period (less the grant-to-start latency).
    spans = [starts[i + 2] - starts[i] for i in range(len(starts) - 2)]
    assert min(spans) >= 0.95, spans


async def test_a_long_wait_parks_the_task_on_a_durable_timer(engine: Engine) -> None:
    await engine.limiter("hourly", requests_per_period=1, period_s=3600)

    @engine.agent("slow")
    async def slow(ctx: Any, n: int) -> int:
        await ctx.llm("m", _llm(), n, limiter="hourly", estimate_tokens=0,
                      retry=RetryPolicy(durable_after_s=1.0))
        return n

    first, second = await engine.submit("slow", 1), await engine.submit("slow", 2)
    await run_worker_until_idle(engine, concurrency=1)
    heads = {i: await engine.head(i) for i in (first, second)}
    done = [i for i, head in heads.items() if head.status.value == "COMPLETED"]
    parked = [i for i, head in heads.items() if head.status.value == "WAITING"]
    assert len(done) == 1 and len(parked) == 1, heads
    types = await _types(engine, parked[0])
    assert "timer_started" in types and "llm_call_intended" not in types
    # More capacity, and the timer comes due: the parked call is granted and made.
    await engine.limiter("hourly", requests_per_period=2, period_s=3600)
    await advance_timers(engine)
    await run_worker_until_idle(engine)
    assert (await engine.head(parked[0])).status.value == "COMPLETED"
    assert (await engine.limiter_info("hourly")).requests_in_window == 2


async def test_a_429_with_retry_after_blocks_the_limiter_for_every_call(engine: Engine) -> None:
    await engine.limiter("api", requests_per_period=100, tokens_per_period=10_000, period_s=60)
    attempts: list[float] = []

    async def flaky(request: Any) -> LlmResponse:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise RateLimited(retry_after_s=1.0)
        return LlmResponse(content="ok", input_tokens=10, output_tokens=10)

    @engine.agent("once")
    async def once(ctx: Any, _: Any) -> Any:
        return await ctx.llm("m", flaky, "q", limiter="api", estimate_tokens=500,
                             retry=FAST_RETRY)

    task_id = await engine.submit("once", None)
    await run_worker_until_idle(engine)
    assert (await engine.state(task_id)).output == "ok"
    assert len(attempts) == 2 and attempts[1] - attempts[0] >= 0.95, attempts
    info = await engine.limiter_info("api")
    # Both requests count; the refused one with no tokens, the other with its usage.
    assert (info.requests_in_window, info.tokens_in_window, info.tokens_reserved) == (2, 20, 0)
    failed = [e for e in await engine.history(task_id) if e.type == "llm_call_failed"]
    assert b'"error_type":"RateLimited"' in failed[0].payload


async def test_unknown_limiter_and_bad_estimates_are_typed_with_nothing_of_the_call_written(
        engine: Engine) -> None:
    await engine.limiter("small", tokens_per_period=100, period_s=60)
    seen: list[str] = []

    @engine.agent("wrong")
    async def wrong(ctx: Any, _: Any) -> list[str]:
        for limiter, estimate in (("nope", 1), ("bad name!", 1), ("small", 101),
                                  ("small", -1)):
            try:
                await ctx.llm("m", _llm(), "q", limiter=limiter, estimate_tokens=estimate)
            except (UnknownLimiter, InvalidLimiter) as error:
                seen.append(type(error).__name__)
        try:
            await ctx.tool("t", lambda _: 1, None, limiter="nope")
        except UnknownLimiter as error:
            seen.append(type(error).__name__)
        return seen

    task_id = await engine.submit("wrong", None)
    await run_worker_until_idle(engine)
    assert (await engine.state(task_id)).output == [
        "UnknownLimiter", "InvalidLimiter", "InvalidLimiter", "InvalidLimiter",
        "UnknownLimiter"]
    types = await _types(engine, task_id)
    assert not [t for t in types if t.endswith("_intended")], types
    assert await _count(engine, "wal_limiter_reservations") == 0


async def _crash_then_finish(engine: Engine, point: str, agent: str) -> str:
    task_id = await engine.submit(agent, None)
    with crash_at(point) as report:
        await run_worker_until_idle(engine)
    assert report.fired
    await expire_leases(engine)
    await run_worker_until_idle(engine)
    assert (await engine.head(task_id)).status.value == "COMPLETED"
    return task_id


@pytest.mark.parametrize(("point", "counted"), [
    ("after_limiter_grant", 1),   # granted, crashed before the intent: the grant is found
    ("after_result_commit", 1),   # recorded: the re-run takes no grant
    ("after_intent_commit", 2),   # in doubt: sent again, the provider may see it twice
])
async def test_a_crashed_call_is_counted_once_unless_it_is_sent_again(
        engine: Engine, point: str, counted: int) -> None:
    await engine.limiter("calls", requests_per_period=10, period_s=60)
    sent: list[int] = []

    def tool(_: Any) -> int:
        sent.append(1)
        return len(sent)

    @engine.agent("one")
    async def one(ctx: Any, _: Any) -> Any:
        return await ctx.tool("t", tool, None, limiter="calls")

    await _crash_then_finish(engine, point, "one")
    info = await engine.limiter_info("calls")
    assert info.requests_in_window == counted
    assert len(sent) <= counted


async def test_a_recorded_llm_call_replayed_after_a_crash_is_not_counted_again(
        engine: Engine) -> None:
    await engine.limiter("model", tokens_per_period=10_000, period_s=60)

    @engine.agent("two")
    async def two(ctx: Any, _: Any) -> Any:
        a = await ctx.llm("m", _llm(100, 50), "a", limiter="model", estimate_tokens=1000)
        await ctx.checkpoint()
        b = await ctx.llm("m", _llm(10, 5), "b", limiter="model", estimate_tokens=1000)
        return [a, b]

    await _crash_then_finish(engine, "at_checkpoint", "two")
    info = await engine.limiter_info("model")
    assert (info.requests_in_window, info.tokens_in_window, info.tokens_reserved) == (2, 165, 0)


async def test_a_tenants_runtime_role_uses_limiters_and_sees_only_its_own(
        app_engine: Engine, tenant_roles: TenantRoles) -> None:
    await app_engine.limiter("shared", requests_per_period=5, period_s=60)

    @app_engine.agent("ask")
    async def ask(ctx: Any, _: Any) -> Any:
        return await ctx.llm("m", _llm(), "q", limiter="shared", estimate_tokens=0)

    task_id = await app_engine.submit("ask", None)
    await run_worker_until_idle(app_engine)
    assert (await app_engine.state(task_id)).output == "answer to q"
    assert (await app_engine.limiter_info("shared")).requests_in_window == 1
    other = await connect(await tenant_roles.dsn("tenant-b"), migrate=False, pool_size_max=2,
                          development=False)
    try:  # Another tenant's role: not there, and its own of the same name is its own.
        with pytest.raises(UnknownLimiter):
            await other.limiter_info("shared")
        await other.limiter("shared", requests_per_period=1, period_s=60)
        assert (await other.limiter_info("shared")).requests_in_window == 0
    finally:
        await other.close()
    async with app_engine.database.pool.acquire() as connection:
        for statement in ("DELETE FROM wal_limiter_reservations",
                          "UPDATE wal_limiter_reservations SET tokens = 0",
                          "INSERT INTO wal_limiter_reservations (name, task_id, call_key, "
                          "tokens, reserved_at) VALUES ('shared', 'x', 'y', 0, now())",
                          "UPDATE wal_limiters SET blocked_until = NULL"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await connection.execute(statement)
    await app_engine.delete_limiter("shared")
    assert await app_engine.limiters() == []


async def test_cli_lists_limiters_and_refuses_bad_ones(engine: Engine,
                                                       database_dsn: str) -> None:
    env = {"WAL_ENGINE_DSN": database_dsn}
    saved = await cli("limiter", "set", "openai:gpt-x", "--requests", "3", "--tokens", "900",
                      "--period", "30", "--development", "--json", env=env)
    assert saved.exit_code == 0, saved.output
    listed = await cli("limiters", "--development", "--json", env=env)
    assert listed.exit_code == 0, listed.output
    [row] = lines(listed.stdout)
    assert (row["name"], row["requests_per_period"], row["tokens_per_period"],
            row["period_s"], row["requests_in_window"]) == ("openai:gpt-x", 3, 900, 30.0, 0)
    table = await cli("limiters", "--development", env=env)
    assert "openai:gpt-x" in table.stdout
    refused = await cli("limiter", "set", "x", "--requests", "0", "--development", env=env)
    assert refused.exit_code != 0
    assert "requests_per_period" in one_error_line(refused)
