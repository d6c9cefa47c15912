"""Ctrl-C on ``wal-engine worker``: the first drains with a countdown on standard error,
the second stops at once (exit 130), handing the running task back; or, while a def tool's
thread runs, dying with that thread and leaving the task to lease expiry."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext

ROOT = Path(__file__).resolve().parents[2]
SPEC = "tests.integration.test_cli_worker_stop:register"
SLOW_TOOL_S = 120.0
DRAIN_TIMEOUT_S = 60


def register(engine: Engine) -> None:
    """An agent whose one tool takes a minute (no durable point to hand back at)."""

    async def slow(args: dict[str, Any]) -> str:
        await asyncio.sleep(args["seconds"])
        return "done"

    @engine.agent("slow-one")
    async def slow_one(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("slow", slow, {"seconds": task_input["seconds"]})

    def blocking(args: dict[str, Any]) -> str:
        time.sleep(args["seconds"])
        Path(args["marker"]).write_text("acted")  # The effect, after the block.
        return "done"

    @engine.agent("blocking-one")
    async def blocking_one(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("blocking", blocking, task_input, idempotent=False)


def _start_worker(dsn: str, stderr: IO[bytes],
                  drain_timeout_s: float = DRAIN_TIMEOUT_S) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WAL_ENGINE_LOG_FORMAT": "json"}
    return subprocess.Popen(
        [sys.executable, "-m", "wal_engine.cli", "worker", "--agents", SPEC,
         "--lease-ttl-ms", "900", "--heartbeat-ms", "200", "--poll-ms", "50",
         "--drain-timeout-s", str(drain_timeout_s), "--dsn", dsn],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)


async def _until(check: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_second_ctrl_c_forces_the_exit(engine: Engine, tmp_path: Path) -> None:
    """Ctrl-C once: 'draining ... Ctrl-C again' lines while the slow tool runs; Ctrl-C
    twice: exit 130 well before the 60 s drain timeout."""
    register(engine)
    task_id = await engine.submit("slow-one", {"seconds": SLOW_TOOL_S})
    log_path = tmp_path / "worker.err"
    with log_path.open("wb") as log:
        process = _start_worker(engine.database.dsn, log)
        try:
            async def running() -> bool:  # Inside the slow tool: no durable point ahead.
                return any(record.type == "tool_call_intended"
                           for record in await engine.history(task_id))

            async def counting_down() -> bool:
                return "Ctrl-C again to stop now" in log_path.read_text()

            await _until(running, "the worker to start the slow tool")
            process.send_signal(signal.SIGINT)
            await _until(counting_down, "the drain countdown")
            process.send_signal(signal.SIGINT)
            started = time.monotonic()
            await asyncio.to_thread(process.wait, DRAIN_TIMEOUT_S)
            took_s = time.monotonic() - started
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    text = log_path.read_text()
    assert process.returncode == 130, text
    assert "stopping now: cancelling 1 task run(s)" in text
    assert took_s < DRAIN_TIMEOUT_S / 2, took_s
    assert str((await engine.head(task_id)).status) == "RESUMING"  # handed back


@pytest.mark.parametrize(("drain_timeout_s", "first_sign"), [
    (0.5, "drain_waiting_on_thread"), (DRAIN_TIMEOUT_S, "Ctrl-C again to stop now"),
], ids=["past-the-drain", "within-the-drain"])
async def test_second_ctrl_c_during_a_def_tool_dies_with_its_thread(
        engine: Engine, tmp_path: Path, drain_timeout_s: float, first_sign: str) -> None:
    """A non-idempotent def tool blocking its thread for two minutes: after the first
    Ctrl-C the worker keeps the task while the thread runs (past a 0.5 s drain timeout it
    logs drain_waiting_on_thread); the second, past or within the drain, exits 130 at
    once, with the thread (Python would wait for it at exit), so it never acts; the task is
    not handed back: it waits for its lease to expire, as after a crash."""
    register(engine)
    marker = tmp_path / "acted"
    task_id = await engine.submit("blocking-one", {"seconds": SLOW_TOOL_S,
                                                   "marker": str(marker)})
    log_path = tmp_path / "worker.err"
    with log_path.open("wb") as log:
        process = _start_worker(engine.database.dsn, log, drain_timeout_s=drain_timeout_s)
        try:
            async def running() -> bool:
                return any(record.type == "tool_call_intended"
                           for record in await engine.history(task_id))

            async def draining() -> bool:
                return first_sign in log_path.read_text()

            await _until(running, "the worker to start the blocking tool")
            process.send_signal(signal.SIGINT)
            await _until(draining, f"{first_sign!r} in the worker's log")
            process.send_signal(signal.SIGINT)
            started = time.monotonic()
            await asyncio.to_thread(process.wait, SLOW_TOOL_S / 4)
            took_s = time.monotonic() - started
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    text = log_path.read_text()
    assert process.returncode == 130, text
    assert "still running end with the process" in text
    assert took_s < SLOW_TOOL_S / 8, took_s
    assert not marker.exists()
    types = [record.type for record in await engine.history(task_id)]
    assert "task_released" not in types and "tool_call_completed" not in types, types
