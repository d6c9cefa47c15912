"""The ``wal-engine`` commands through their real entry point, against real PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, drive, drive_until, lines, one_error_line
from wal_engine.engine import Engine, connect
from wal_engine.errors import SchemaMismatch
from wal_engine.store.connection import SCHEMA_VERSION
from wal_engine.testing.postgres import TestServer

SPEC = "tests.integration.test_cli_agents:register"
FUNCTIONS = ("SELECT p.oid::regprocedure::text, md5(p.prosrc) FROM pg_proc p"
             " WHERE p.proname LIKE 'wal\\_%' ORDER BY 1")


@pytest_asyncio.fixture
async def empty_dsn(pg_server: TestServer) -> AsyncIterator[str]:
    """A database with no wal-engine schema at all."""
    name = "walt_cli_empty"
    admin = await asyncpg.connect(pg_server.admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield pg_server.dsn(name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def test_submit_tasks_history_and_show_in_json(engine: Engine) -> None:
    """Submit through the CLI, run, then list, print and fold the task as JSON lines."""
    dsn = engine.database.dsn
    submitted = await cli("submit", "cli-echo", "--input", '{"q": "why"}', "--task-id",
                          "cli-1", "--budget", "max_steps=20,max_tokens=5000", "--dsn", dsn,
                          "--json")
    assert submitted.exit_code == 0, submitted.output
    assert lines(submitted.stdout) == [{"task_id": "cli-1", "agent": "cli-echo",
                                        "status": "QUEUED", "head_seq": 1}]
    agents.register(engine)
    await drive(engine, "cli-1")
    listed = lines((await cli("tasks", "--dsn", dsn, "--json", "--status", "completed")).stdout)
    assert [(t["task_id"], t["status"], t["budget"]) for t in listed] == [
        ("cli-1", "COMPLETED", {"max_steps": 20, "max_tokens": 5000})]
    assert lines((await cli("tasks", "--dsn", dsn, "--json", "--agent", "other")).stdout) == []
    history = lines((await cli("history", "cli-1", "--dsn", dsn, "--json")).stdout)
    assert [e["seq"] for e in history] == list(range(1, len(history) + 1))
    assert history[0]["type"] == "task_submitted" and history[-1]["type"] == "task_completed"
    assert history[0]["payload"]["input"] == {"q": "why"}
    assert set(history[0]) == {"task_id", "seq", "type", "version", "epoch", "recorded_at",
                               "idempotency_key", "hash", "payload"}
    window = lines((await cli("history", "cli-1", "--from", "3", "--to", "4", "--dsn", dsn,
                              "--json")).stdout)
    assert [e["seq"] for e in window] == [3, 4]
    (shown,) = lines((await cli("show", "cli-1", "--dsn", dsn, "--json")).stdout)
    assert shown["status"] == "COMPLETED" and shown["last_seq"] == len(history)
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant"]
    assert shown["usage"]["input_tokens"] == 30 and shown["pending_calls"] == []
    assert shown["output"]["title"] == "A"


async def test_human_output_is_tables_and_lines(engine: Engine) -> None:
    """Without --json: a table of tasks, the history, the folded state, verification."""
    agents.register(engine)
    task_id = await engine.submit("cli-echo", {"q": "why"})
    await drive(engine, task_id)
    dsn = engine.database.dsn
    listed = await cli("tasks", "--dsn", dsn)
    assert task_id in listed.stdout and "COMPLETED" in listed.stdout
    history = await cli("history", task_id, "--dsn", dsn)
    assert "tool_call_intended" in history.stdout and "tool=fetch" in history.stdout
    shown = await cli("show", task_id, "--dsn", dsn)
    assert "status COMPLETED" in shown.stdout and "30 input + 12 output tokens" in shown.stdout
    verified = await cli("verify", task_id, "--dsn", dsn)
    assert verified.exit_code == 0 and f"task {task_id}: ok" in verified.stdout


async def test_signal_approve_cancel_and_fork(engine: Engine) -> None:
    """Steering commands write what the engine API writes, and answer in JSON."""
    agents.register(engine)
    dsn = engine.database.dsn
    task_id = await engine.submit("cli-waiter", 7)
    await drive_until(engine, task_id, "WAITING")
    (sent,) = lines((await cli("signal", task_id, "go", "--payload", '{"ok": true}', "--dsn",
                               dsn, "--json")).stdout)
    assert sent["task_id"] == task_id and sent["name"] == "go" and sent["signal_id"] > 0
    state = await drive(engine, task_id)
    assert state.output == {"got": {"ok": True}}
    history = await engine.history(task_id)
    (forked,) = lines((await cli("fork", task_id, "--at", "4", "--dsn", dsn,
                                 "--json")).stdout)
    assert forked["parent_task_id"] == task_id and forked["parent_seq"] == 4
    assert (await engine.head(forked["task_id"])).parent_seq == 4
    (cancelled,) = lines((await cli("cancel", forked["task_id"], "--by", "ops", "--dsn", dsn,
                                    "--json")).stdout)
    assert cancelled == {"task_id": forked["task_id"], "cancelled": True, "status": "FAILED"}
    (again,) = lines((await cli("cancel", task_id, "--dsn", dsn, "--json")).stdout)
    assert again["cancelled"] is False and again["status"] == "COMPLETED"
    assert len(await engine.history(task_id)) == len(history)


async def test_approve_answers_an_approval_request(engine: Engine) -> None:
    """``approve`` resolves the call id the task waits on; the task then acts and finishes."""
    async def careful(ctx: Any, task_input: Any) -> Any:
        return await ctx.tool("send", agents.tool("send", "sent"), {"to": "x"}, approval=True)

    engine.register("careful", careful)
    task_id = await engine.submit("careful", None)
    await drive_until(engine, task_id, "WAITING")
    (call_id,) = (await engine.state(task_id)).approvals
    (approved,) = lines((await cli("approve", task_id, call_id, "--approver", "ana", "--dsn",
                                   engine.database.dsn, "--json")).stdout)
    assert approved["approved"] is True and approved["approver"] == "ana"
    assert (await drive(engine, task_id)).output == "sent"


async def test_errors_are_one_line_with_a_non_zero_exit(engine: Engine) -> None:
    """Unknown task, bad JSON, bad budget, a bad option: one line on stderr, never a traceback."""
    dsn = engine.database.dsn
    for command in (["history", "nope"], ["show", "nope"], ["verify", "nope"],
                    ["cancel", "nope"], ["signal", "nope", "go"], ["fork", "nope", "--at", "1"],
                    ["timeline", "nope", "--html", "/tmp/wal-engine-nope.html"]):
        result = await cli(*command, "--dsn", dsn)
        assert result.exit_code == 3, (command, result.output)
        assert one_error_line(result) == "error: unknown task 'nope'"
    bad_json = await cli("submit", "cli-echo", "--input", "{not json", "--dsn", dsn)
    assert bad_json.exit_code == 2
    assert one_error_line(bad_json).startswith("error: --input is not valid JSON")
    bad_payload = await cli("signal", "x", "go", "--payload", "[1,", "--dsn", dsn)
    assert bad_payload.exit_code == 2 and "--payload is not valid JSON" in bad_payload.stderr
    bad_budget = await cli("submit", "a", "--budget", "max_sheep=3", "--dsn", dsn)
    assert bad_budget.exit_code == 2 and "max_sheep" in one_error_line(bad_budget)
    bad_option = await cli("tasks", "--bogus", "--dsn", dsn)
    assert bad_option.exit_code == 2 and "--bogus" in one_error_line(bad_option)
    both = await cli("verify", "x", "--all", "--dsn", dsn)
    assert both.exit_code == 2 and "--all" in one_error_line(both)
    await engine.submit("cli-echo", {"q": 1}, task_id="taken")
    taken = await cli("submit", "cli-echo", "--input", '{"q": 2}', "--task-id", "taken",
                      "--dsn", dsn)
    assert taken.exit_code == 3 and "already exists" in one_error_line(taken)
    invalid = await cli("submit", "cli-echo", "--task-id", "bad id!", "--dsn", dsn)
    assert invalid.exit_code == 2 and "invalid task id" in one_error_line(invalid)


async def test_unreachable_database_is_named_without_its_password() -> None:
    """A refused connection names the DSN with the password masked."""
    dsn = "postgresql://auditor:s3cr3t-pw@127.0.0.1:1/wal"
    for command in (["tasks"], ["migrate"], ["verify", "--all"], ["history", "t"]):
        result = await cli(*command, "--dsn", dsn)
        assert result.exit_code == 4, result.output
        line = one_error_line(result)
        assert "127.0.0.1:1" in line and "auditor:***@" in line
        assert "s3cr3t-pw" not in result.output
    from_env = await cli("tasks", env={"WAL_ENGINE_DSN": dsn})
    assert from_env.exit_code == 4 and "s3cr3t-pw" not in from_env.output


async def test_missing_schema_then_migrate_then_another_version(empty_dsn: str) -> None:
    """No schema: a clear error naming `migrate`; migrate applies it; a newer one is refused."""
    missing = await cli("tasks", "--dsn", empty_dsn)
    assert missing.exit_code == 4
    assert "no wal-engine schema found" in one_error_line(missing)
    assert "wal-engine migrate" in missing.stderr
    (migrated,) = lines((await cli("migrate", "--dsn", empty_dsn, "--json")).stdout)
    assert migrated["schema_version_before"] is None
    assert migrated["schema_version"] == SCHEMA_VERSION and migrated["applied"] is True
    (again,) = lines((await cli("migrate", "--dsn", empty_dsn, "--json")).stdout)
    assert again["applied"] is False
    assert (await cli("tasks", "--dsn", empty_dsn, "--json")).exit_code == 0
    connection = await asyncpg.connect(empty_dsn)
    try:
        await connection.execute("INSERT INTO wal_schema_version (version) VALUES ($1)",
                                 SCHEMA_VERSION + 1)
    finally:
        await connection.close()
    newer = await cli("show", "x", "--dsn", empty_dsn)
    assert newer.exit_code == 4
    line = one_error_line(newer)
    assert f"schema version {SCHEMA_VERSION + 1}" in line and "upgrade wal-engine" in line
    refused = await cli("migrate", "--dsn", empty_dsn)
    assert refused.exit_code == 4 and "upgrade wal-engine" in one_error_line(refused)
    # An engine connecting with migrate=True applies nothing over the newer schema either
    # (its older functions would replace the newer ones): refused before any DDL.
    connection = await asyncpg.connect(empty_dsn)
    try:
        await connection.execute("UPDATE wal_schema_version SET checksum = 'newer'")
        functions = await connection.fetch(FUNCTIONS)
        with pytest.raises(SchemaMismatch):
            await connect(empty_dsn, migrate=True)
        assert await connection.fetch(FUNCTIONS) == functions
        assert await connection.fetchval(
            "SELECT count(*) FROM wal_schema_version WHERE checksum <> 'newer'") == 0
    finally:
        await connection.close()


def test_console_script_entry_point_runs(database_dsn: str) -> None:
    """``python -m wal_engine.cli`` (what the console script calls) lists tasks as JSON."""
    result = subprocess.run([sys.executable, "-m", "wal_engine.cli", "tasks", "--json",
                             "--dsn", database_dsn], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_demo_runs_through_the_cli(database_dsn: str) -> None:
    """``wal-engine demo``: a worker SIGKILLed mid-task, another finishes it exactly once."""
    result = subprocess.run([sys.executable, "-m", "wal_engine.cli", "demo", "--dsn",
                             database_dsn], capture_output=True, text=True, timeout=240,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout and "each exactly once" in result.stdout
    # The history names the tools and their keys, and the counts are explained.
    assert "tool=send_report" in result.stdout and "idempotency_key=idem:" in result.stdout
    assert "'reached' counts deliveries" in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["replay", "--help"]])
async def test_help_and_version_exit_zero(args: list[str]) -> None:
    """Help and version are not errors."""
    result = await cli(*args)
    assert result.exit_code == 0 and result.stdout
