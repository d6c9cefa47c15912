"""The README's Python examples run as written: the agent module (its ``main()``, then the
shell steps the README gives, through to COMPLETED) and the crash test of your own agent
(run by pytest in a project directory of its own)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from wal_engine.testing.postgres import TestServer

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 120
CRASH_TEST_TIMEOUT_S = 280
"""The crash-quick run's bound: 12 s on a quiet machine, over 120 s at load average 15 (a
deadline for a hung run, under pytest-timeout's 300 s, not a speed assertion)."""


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _block_with(marker: str) -> str:
    (block,) = [text for text in _python_blocks() if marker in text]
    return block


def test_every_python_block_compiles() -> None:
    """No README example has a syntax error (top-level await included)."""
    blocks = _python_blocks()
    assert len(blocks) >= 3
    for number, block in enumerate(blocks):
        compile(block, f"README.md python block {number + 1}", "exec")


def _run(args: list[str], cwd: Path, env: dict[str, str],
         timeout_s: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done


def test_the_agent_example_runs_as_written(database_dsn: str, tmp_path: Path) -> None:
    """triage.py's main() parks the task on its sleep; timer fire, a worker, the signal,
    pending and approve (the README's shell steps) take it to COMPLETED."""
    (tmp_path / "triage.py").write_text(_block_with("async def main()"))
    env = {**os.environ, "WAL_ENGINE_DSN": database_dsn, "WAL_ENGINE_LOG_LEVEL": "warning"}
    printed = _run([sys.executable, "triage.py"], tmp_path, env).stdout
    task_id, status = printed.strip().splitlines()[-1].split(": ")
    assert status == "WAITING"
    cli = [sys.executable, "-m", "wal_engine.cli"]
    worker = [*cli, "worker", "--agents", "triage:register", "--until-idle", "--poll-ms", "50"]
    _run([*cli, "timer", "fire", task_id], tmp_path, env)
    _run(worker, tmp_path, env)
    _run([*cli, "signal", task_id, "manager_ok", "--payload", '{"ok": true}'], tmp_path, env)
    _run(worker, tmp_path, env)
    (waiting,) = [orjson.loads(line) for line in
                  _run([*cli, "pending", "--json"], tmp_path, env).stdout.splitlines()]
    assert waiting["task_id"] == task_id and waiting["tool"] == "refund"
    _run([*cli, "approve", task_id, waiting["call_id"], "--approver", "ops"], tmp_path, env)
    _run(worker, tmp_path, env)
    (shown,) = [orjson.loads(line) for line in
                _run([*cli, "show", task_id, "--json"], tmp_path, env).stdout.splitlines()]
    assert shown["status"] == "COMPLETED"
    assert shown["output"]["refund"] == {"refunded": 20}


def test_the_crash_test_example_runs_as_written(pg_server: TestServer, tmp_path: Path) -> None:
    """The README's crash test of a one-tool agent passes under pytest in a new project
    (the plugin autoloaded, the pyproject docs/testing.md gives)."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\nasyncio_mode = "auto"\n'
        'asyncio_default_fixture_loop_scope = "function"\n')
    (tmp_path / "test_billing.py").write_text(_block_with("wal_crash_machine"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("WAL_ENGINE_CRASH_PROFILE", "RELIABILITY_DEEP", "PYTEST_ADDOPTS")}
    env["WAL_ENGINE_TEST_DSN"] = pg_server.admin_dsn
    done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], tmp_path,
                env, timeout_s=CRASH_TEST_TIMEOUT_S)
    assert "1 passed" in done.stdout


async def test_the_openai_agents_example_runs_as_written(
        database_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """desk.py's run_desk() hands off, waits for the refund's approval, approves it and
    prints the refund the model reports (skipped without the [openai-agents] extra). It
    runs in this process: a new one would spend seconds importing the SDK again."""
    pytest.importorskip("agents", reason="the [openai-agents] extra is not installed")
    path = tmp_path / "desk.py"
    path.write_text(_block_with("DurableRunner(ctx).run(triage"))
    monkeypatch.setenv("WAL_ENGINE_DSN", database_dsn)
    spec = importlib.util.spec_from_file_location("readme_desk", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    await module.run_desk()
    assert capsys.readouterr().out.strip().splitlines()[-1] == "refunded 20 on A17"


def test_the_pydantic_ai_example_runs_as_written(database_dsn: str, tmp_path: Path) -> None:
    """weather.py runs its durable Pydantic AI agent to COMPLETED; the printed history shows
    the model requests as LLM calls and both tools as tool calls."""
    pytest.importorskip("pydantic_ai.durable_exec", reason="the [pydantic-ai] extra")
    (tmp_path / "weather.py").write_text(_block_with("WalDurability()"))
    env = {**os.environ, "WAL_ENGINE_DSN": database_dsn, "WAL_ENGINE_LOG_LEVEL": "warning"}
    output, history = _run([sys.executable, "weather.py"], tmp_path, env).stdout.splitlines()[-2:]
    assert "'city'" in output and "'summary'" in output
    events = history.split()
    assert events[0] == "task_submitted" and events[-1] == "task_completed"
    assert events.count("llm_call_completed") == 2
    assert events.count("tool_call_completed") == 2
