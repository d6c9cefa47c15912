"""Small CLI output contracts: usage errors named as such, JSON errors under --json, no
"next action" for a finished task, a mapping of non-functions refused as agents, and one
default database in `bench --help`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import orjson

from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, drive, one_error_line
from wal_engine.engine import Engine

REPOSITORY = Path(__file__).resolve().parents[2]

CALLS = {"cli-echo": 3, "cli-waiter": 1}
"""A dict of ints (a counter, say) that a mistyped --agents might name."""


async def test_timeline_into_a_missing_directory_is_a_usage_error(engine: Engine,
                                                                   tmp_path: Path) -> None:
    """The missing directory is named, exit 2, before any database is opened."""
    missing = tmp_path / "missing" / "x.html"
    result = await cli("timeline", "t-1", "--html", str(missing), "--dsn",
                       engine.database.dsn)
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "does not exist" in line and "database error" not in line


async def test_agents_naming_a_dict_of_ints_is_refused(database_dsn: str) -> None:
    """--agents module:CALLS (values are not agent functions) is a usage error."""
    result = await cli("worker", "--agents", "tests.integration.test_cli_output_fixes:CALLS",
                       "--until-idle", "--dsn", database_dsn)
    assert result.exit_code == 2
    assert "values are not agent functions" in one_error_line(result)


async def test_show_of_a_completed_task_has_no_next_action(engine: Engine) -> None:
    """After COMPLETED the human view says no "next action"."""
    agents.register(engine)
    task_id = await engine.submit("cli-echo", {"q": "done"})
    await drive(engine, task_id)
    shown = await cli("show", task_id, "--dsn", engine.database.dsn)
    assert shown.exit_code == 0, shown.output
    assert "COMPLETED" in shown.stdout and "next action" not in shown.stdout


async def test_errors_under_json_are_json(database_dsn: str) -> None:
    """Under --json a refused command and a usage error each print one JSON object on
    standard error with the exit code."""
    unknown = await cli("show", "no-such-task", "--dsn", database_dsn, "--json")
    assert unknown.exit_code == 3
    (error,) = [orjson.loads(line) for line in unknown.stderr.splitlines() if line.strip()]
    assert error["exit_code"] == 3 and "no-such-task" in error["error"]
    usage = await cli("submit", "cli-echo", "--input", "{bad", "--dsn", database_dsn, "--json")
    assert usage.exit_code == 2
    assert orjson.loads(usage.stderr.strip())["exit_code"] == 2
    plain = await cli("show", "no-such-task", "--dsn", database_dsn)
    assert plain.stderr.startswith("error: ")


def test_bench_help_names_one_default_database() -> None:
    """The suite's --dsn help names the database its description names."""
    shown = subprocess.run([sys.executable, "-m", "wal_engine.cli", "bench", "--help"],
                           cwd=REPOSITORY, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    defaults = set(re.findall(r"default: database\s+'(\w+)'", shown.stdout))
    assert defaults == {"wal_bench_suite"}, shown.stdout
