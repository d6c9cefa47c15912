"""Issue 16's smaller findings, through the command line as a tenant's runtime role.

The probe met them at the shell: ``verify --anchor /dev/zero`` read without bound, a signal
name holding byte 0xff was a "database error" (exit 4), a 3,000-byte dedup key raised a raw
``ProgramLimitExceededError``, ``--budget max_tokens=-1`` was accepted, ``..`` was a valid
task id, and ``cancel --reason`` took 50 MiB. Each is now a usage error (exit 2, one line on
stderr, no traceback) and leaves the log as it was. The Python API's side of the same
inputs is in ``test_security_caps.py`` and ``tests/unit/test_history_checks.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from tests.helpers import log_snapshot
from tests.integration.test_cli_agents import cli, one_error_line
from wal_engine import limits
from wal_engine.engine import Engine

USAGE_ERROR = 2


async def test_issue16_shell_inputs_are_usage_errors(app_engine: Engine, app_dsn: str) -> None:
    """As the tenant's own role: each input the probe tried is exit 2 with one error line
    naming the input, and nothing is written."""
    await app_engine.submit("agent", None, task_id="t1")
    before = await log_snapshot(app_engine.database)
    too_long = "x" * (limits.cancel_text_bytes_max + 1)
    cases = [
        (["verify", "--anchor", "/dev/zero"], "not an anchor"),
        (["signal", "t1", "ok", "--dedup-key", "k" * 3000], "dedup key"),
        (["submit", "agent", "--budget", "max_tokens=-1"], "max_tokens"),
        (["submit", "agent", "--budget", "max_cost_usd=inf"], "max_cost_usd"),
        (["submit", "agent", "--task-id", ".."], "task id"),
        (["cancel", "t1", "--reason", too_long], "reason"),
        (["cancel", "t1", "--by", too_long], "requester"),
    ]
    for command, named in cases:
        result = await cli(*command, "--dsn", app_dsn)
        assert result.exit_code == USAGE_ERROR, (command[:3], result.output[:500])
        assert named in one_error_line(result), (command[:3], result.stderr[:500])
        assert result.stdout == "", command[:3]
    assert await log_snapshot(app_engine.database) == before


async def test_issue16_signal_name_with_an_undecodable_byte_is_a_usage_error(
        app_engine: Engine, app_dsn: str, tmp_path: Path) -> None:
    """The real entry point given the raw byte 0xff in a signal name (the shell passes bytes;
    Python decodes them with surrogateescape): exit 2, one error line, not a database error."""
    await app_engine.submit("agent", None, task_id="t1")
    before = await log_snapshot(app_engine.database)
    argv = [sys.executable.encode(), b"-m", b"wal_engine.cli", b"signal", b"t1", b"bad\xff",
            b"--dsn", app_dsn.encode()]
    result = await asyncio.to_thread(subprocess.run, argv, capture_output=True, timeout=120,
                                     check=False, cwd=tmp_path)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == USAGE_ERROR, stderr
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error: "), stderr
    assert "Traceback" not in stderr and result.stdout == b""
    assert await log_snapshot(app_engine.database) == before
