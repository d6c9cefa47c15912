"""``wal-engine worker`` as a real process: runs tasks, logs JSON lines bound to the task,
serves metrics when asked, and stops gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from tests.integration.test_cli_agents import cli, lines, one_error_line
from wal_engine.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
SPEC = "tests.integration.test_cli_agents:register"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_worker(dsn: str, *extra: str, env: dict[str, str] | None = None
                  ) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "wal_engine.cli", "worker", "--agents", SPEC,
               "--concurrency", "2", "--lease-ttl-ms", "900", "--heartbeat-ms", "200",
               "--poll-ms", "50", "--dsn", dsn, *extra]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    environment.pop("WAL_ENGINE_LOG_FORMAT", None)
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


async def _until_terminal(engine: Engine, task_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while str((await engine.head(task_id)).status) not in ("COMPLETED", "FAILED"):
        assert time.monotonic() < deadline, "task did not finish"
        await asyncio.sleep(0.05)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_worker_runs_tasks_logs_json_serves_metrics_and_stops_on_sigterm(
        engine: Engine) -> None:
    """Submit through the CLI; the worker process runs it; SIGTERM ends it with exit 0."""
    pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
    dsn = engine.database.dsn
    port = _free_port()
    process = _start_worker(dsn, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                            env={"WAL_ENGINE_LOG_LEVEL": "info"})
    try:
        submitted = await cli("submit", "cli-echo", "--input", '{"q": "w"}', "--dsn", dsn,
                              "--agents", SPEC, "--json")
        assert submitted.exit_code == 0, submitted.output
        (task,) = lines(submitted.stdout)
        await _until_terminal(engine, task["task_id"])
        assert str((await engine.head(task["task_id"])).status) == "COMPLETED"
        metrics = await asyncio.to_thread(_scrape, port)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=30)
    assert process.returncode == 0, stderr.decode()
    records = [orjson.loads(line) for line in stderr.decode().splitlines()]
    events = [record["event"] for record in records]
    assert events[0] == "worker_started" and events[-1] == "worker_stopped"
    run_lines = [r for r in records if r.get("task_id") == task["task_id"]]
    assert any(r["event"] == "task_completed" for r in run_lines)
    for record in run_lines:
        assert {"task_id", "seq", "epoch", "worker_id", "level", "timestamp"} <= set(record)
    assert metrics["wal_engine_tasks_claimed_total"] >= 1
    assert metrics["wal_engine_events_appended_total"] >= 10
    assert metrics['wal_engine_call_retries_total{kind="tool",reason="failure"}'] >= 1
    assert any(name.startswith("wal_engine_append_seconds_count") for name in metrics)
    assert any(name.startswith("wal_engine_resume_events_folded_count") for name in metrics)


async def test_worker_errors_are_one_line(database_dsn: str) -> None:
    """Missing --agents, an agent module that registers nothing, bad timings."""
    missing = await cli("worker", "--dsn", database_dsn)
    assert missing.exit_code == 2 and "--agents" in one_error_line(missing)
    empty = await cli("worker", "--agents", "tests.integration.test_cli_agents:AGENTS_NONE",
                      "--dsn", database_dsn)
    assert empty.exit_code == 2 and "no attribute" in one_error_line(empty)
    timings = await cli("worker", "--agents", SPEC, "--lease-ttl-ms", "300", "--heartbeat-ms",
                        "200", "--dsn", database_dsn)
    assert timings.exit_code == 2 and "heartbeat_ms" in one_error_line(timings)


async def test_worker_until_idle_drains_the_queue(engine: Engine) -> None:
    """``--until-idle``: run what is due, then return (a batch worker)."""
    from tests.integration import test_cli_agents as agents

    agents.register(engine)
    task_id = await engine.submit("cli-echo", {"q": "idle"})
    result = await cli("worker", "--agents", SPEC, "--until-idle", "--poll-ms", "50",
                       "--dsn", engine.database.dsn, env={"WAL_ENGINE_LOG_LEVEL": "error"})
    assert result.exit_code == 0, result.output
    assert str((await engine.head(task_id)).status) == "COMPLETED"
