"""Agents and helpers the CLI tests share; the CLI loads the agents by ``module:attr``.

No tests here. Each ``register*`` function is a version of "today's code": the same agents,
changed in one way, so that ``wal-engine replay`` has something to find.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import orjson
import structlog
from click.testing import CliRunner, Result

from wal_engine.cli import main
from wal_engine.engine import Engine
from wal_engine.observability import logs
from wal_engine.retries import RetryPolicy, TransientError
from wal_engine.runtime.context import AgentContext, LlmResponse

__test__ = False  # Helpers, not tests.

CALLS: Counter[str] = Counter()
"""How often each tool really ran in this process (a replay must not add to it)."""

FAST: dict[str, Any] = {"lease_ttl_ms": 600, "heartbeat_ms": 150, "poll_ms": 50, "sweep_ms": 100}


KEYS: Counter[str] = Counter()
"""Real calls per idempotency key (a retry reuses its call's key)."""


def tool(name: str, result: Any, fail_first: int = 0) -> Any:
    """A tool counting its real calls; the first ``fail_first`` attempts of each call (per
    idempotency key) fail transiently."""
    async def run(args: Any) -> Any:
        from wal_engine.runtime.context import current_call

        CALLS[name] += 1
        claim = current_call()
        key = f"{name}:{None if claim is None else claim.key}"
        KEYS[key] += 1
        if KEYS[key] <= fail_first:
            raise TransientError(f"{name} is down (attempt {KEYS[key]})")
        return result
    return run


def scripted_llm(request: Any) -> LlmResponse:
    """A deterministic stand-in for an LLM."""
    return LlmResponse(content=f"plan for {request['q']}", input_tokens=30, output_tokens=12,
                       cost_usd=0.002)


async def echo(ctx: AgentContext, task_input: Any) -> Any:
    """Message, LLM call, checkpoint, two tools, a checkpoint, a journaled value."""
    await ctx.message("user", task_input["q"])
    plan = await ctx.llm("scripted", scripted_llm, {"q": task_input["q"]})
    await ctx.checkpoint(next_action="search")
    found = await ctx.tool("search", tool("search", ["a", "b"]), {"q": plan})
    await ctx.checkpoint(next_action="fetch")
    page = await ctx.tool("fetch", tool("fetch", {"title": "A"}, fail_first=1), {"url": found[0]},
                          retry=RetryPolicy(max_attempts=3, initial_delay_s=0.01))
    chance = await ctx.random()
    await ctx.message("assistant", page["title"])
    return {"title": page["title"], "chance": chance}


async def echo_changed(ctx: AgentContext, task_input: Any) -> Any:
    """Today's code asks for another tool at the second call."""
    await ctx.message("user", task_input["q"])
    plan = await ctx.llm("scripted", scripted_llm, {"q": task_input["q"]})
    await ctx.checkpoint(next_action="search")
    await ctx.tool("search-v2", tool("search-v2", ["a"]), {"q": plan})
    return {"title": "never"}


async def echo_extra(ctx: AgentContext, task_input: Any) -> Any:
    """Today's code makes one more call after the recorded ones."""
    output = await echo(ctx, task_input)
    await ctx.tool("notify", tool("notify", "sent"), {"to": "ops"})
    return output


async def echo_output(ctx: AgentContext, task_input: Any) -> Any:
    """Today's code returns another output from the same recorded results."""
    output = await echo(ctx, task_input)
    return {**output, "title": output["title"].lower()}


async def waiter(ctx: AgentContext, task_input: Any) -> Any:
    """Checks in, then waits for the signal ``go`` and returns its payload."""
    await ctx.message("user", "waiting")
    await ctx.tool("prepare", tool("prepare", "ready"), {"n": task_input})
    payload = await ctx.wait_for_signal("go")
    return {"got": payload}


def register(engine: Engine) -> None:
    """Today's code, unchanged."""
    engine.register("cli-echo", echo)
    engine.register("cli-waiter", waiter)


def register_changed(engine: Engine) -> None:
    """``cli-echo`` changed: another tool at the second call."""
    engine.register("cli-echo", echo_changed)
    engine.register("cli-waiter", waiter)


def register_extra(engine: Engine) -> None:
    """``cli-echo`` changed: one more call at the end."""
    engine.register("cli-echo", echo_extra)
    engine.register("cli-waiter", waiter)


def register_output(engine: Engine) -> None:
    """``cli-echo`` changed: another output."""
    engine.register("cli-echo", echo_output)
    engine.register("cli-waiter", waiter)


async def register_async(engine: Engine) -> None:
    """The async form of a register function."""
    await asyncio.sleep(0)
    register(engine)


async def register_and_write(engine: Engine) -> None:
    """A register function that tries to write (a replay's session refuses it)."""
    register(engine)
    await engine.database.fetch("CREATE TABLE replay_must_not_write (a int)")


def register_broken(engine: Engine) -> None:
    """A register function with a bug."""
    raise RuntimeError("agent module misconfigured")


AGENTS = {"cli-echo": echo, "cli-waiter": waiter}
"""The mapping form of a registry."""

NOT_AN_AGENT_REGISTRY = 42


# ----------------------------------------------------------------------------- helpers


async def drive(engine: Engine, task_id: str, *, timeout_s: float = 20.0) -> Any:
    """Run an in-process worker until the task is terminal; return its final state."""
    worker = engine.worker(concurrency=4, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        return await engine.wait(task_id, timeout_s=timeout_s)
    finally:
        worker.stop()
        await running


async def drive_until(engine: Engine, task_id: str, status: str, *,
                      timeout_s: float = 20.0) -> None:
    """Run an in-process worker until the task reaches ``status``."""
    worker = engine.worker(concurrency=4, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        async def reached() -> None:
            while str((await engine.head(task_id)).status) != status:
                await asyncio.sleep(0.02)
        await asyncio.wait_for(reached(), timeout_s)
    finally:
        worker.stop()
        await running


async def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    """Invoke ``wal-engine ARGS`` through click's runner, in a thread (it runs its own loop).

    The command configures logging for its process, as an entry point does; the test
    process gets its own configuration back afterwards.
    """
    runner = CliRunner()
    saved = structlog.get_config()
    try:
        return await asyncio.to_thread(runner.invoke, main, list(args), env=env,
                                       catch_exceptions=False)
    finally:
        logs.reset_logging()
        structlog.configure(**saved)


def lines(text: str) -> list[dict[str, Any]]:
    """Parse JSON lines (every non-empty line must be one JSON object)."""
    parsed = [orjson.loads(line) for line in text.splitlines() if line.strip()]
    assert all(isinstance(item, dict) for item in parsed)
    return parsed


def one_error_line(result: Result) -> str:
    """The error a failing command printed: exactly one line, no traceback."""
    error_lines = result.stderr.strip().splitlines()
    assert len(error_lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert error_lines[0].startswith("error: ")
    return error_lines[0]
