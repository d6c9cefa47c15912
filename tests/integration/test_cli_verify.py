"""``wal-engine verify``: a payload altered by hand in SQL is found, named by task and seq."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import asyncpg

from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, drive, lines
from wal_engine.engine import Engine

TAMPER = """
ALTER TABLE wal_events DISABLE TRIGGER wal_events_append_only;
UPDATE wal_events SET payload = convert_to('{"result":"forged"}', 'UTF8')
 WHERE task_id = '{task}' AND seq = {seq};
ALTER TABLE wal_events ENABLE TRIGGER wal_events_append_only;
"""


async def _tamper(dsn: str, task_id: str, seq: int) -> None:
    """Rewrite one stored payload as a superuser would, around the append-only trigger."""
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(TAMPER.replace("{task}", task_id).replace("{seq}", str(seq)))
    finally:
        await connection.close()


async def _three_tasks(engine: Engine) -> list[str]:
    agents.register(engine)
    task_ids = [await engine.submit("cli-echo", {"q": str(n)}, task_id=f"v-{n}")
                for n in range(3)]
    for task_id in task_ids:
        await drive(engine, task_id)
    return task_ids


async def test_verify_all_reports_the_altered_task_and_seq_and_exits_1(engine: Engine) -> None:
    """One payload changed by hand: verify --all names that task and seq, others are ok."""
    task_ids = await _three_tasks(engine)
    dsn = engine.database.dsn
    clean = await cli("verify", "--all", "--dsn", dsn)
    assert clean.exit_code == 0 and "verified 3 task(s)" in clean.stdout
    history = await engine.history("v-1")
    seq = next(r.seq for r in history if r.type == "tool_call_completed")
    await _tamper(dsn, "v-1", seq)
    result = await cli("verify", "--all", "--dsn", dsn)
    assert result.exit_code == 1
    assert f"task v-1: FAILED at seq {seq} (hash)" in result.stdout
    assert "1 failed" in result.stdout
    as_json = await cli("verify", "--all", "--dsn", dsn, "--json")
    assert as_json.exit_code == 1
    reports = {r["task_id"]: r for r in lines(as_json.stdout)}
    assert set(reports) == set(task_ids)
    assert reports["v-1"]["ok"] is False
    assert reports["v-1"]["violation"] == {"seq": seq, "kind": "hash",
                                           "detail": "stored hash does not match content"}
    assert reports["v-0"]["ok"] and reports["v-2"]["ok"]
    single = await cli("verify", "v-1", "--dsn", dsn)
    assert single.exit_code == 1 and f"FAILED at seq {seq}" in single.stdout


def test_progress_bar_on_a_terminal_and_none_when_piped(database_dsn: str) -> None:
    """verify --all draws a bar on a terminal's stderr; piped, stderr stays empty."""
    command = [sys.executable, "-m", "wal_engine.cli", "verify", "--all", "--dsn", database_dsn]
    piped = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert piped.returncode == 0 and piped.stderr == ""
    controller, terminal = pty.openpty()
    try:
        on_tty = subprocess.run(command, stdout=subprocess.PIPE, stderr=terminal, timeout=60,
                                check=False, env={**os.environ, "COLUMNS": "100"})
        os.close(terminal)
        drawn = _read_all(controller)
    finally:
        os.close(controller)
    assert on_tty.returncode == 0
    assert "verifying tasks" in drawn


def _read_all(descriptor: int) -> str:
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(descriptor, 65536)
        except OSError:  # EIO once the other end is closed.
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")
