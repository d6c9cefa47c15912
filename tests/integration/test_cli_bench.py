"""``wal-engine bench``: the benchmark suite (``python -m benchmarks``) behind the CLI.

Nothing here runs a workload (``test_benchmark_suite_smoke.py`` runs the suite in --quick):
these check that the arguments reach the suite's own parser and its exit code comes back.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_cli_agents import cli, one_error_line

REPOSITORY = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 60.0


def _wal_engine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wal_engine.cli", *args], cwd=REPOSITORY,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def test_bench_help_is_the_suites_help() -> None:
    """`wal-engine bench --help` prints the suite's options and exits 0; the command is
    listed in `wal-engine --help`."""
    shown = _wal_engine("bench", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "usage: python -m benchmarks" in shown.stdout
    for option in ("--quick", "--dsn", "--peers", "--sizes", "--keep"):
        assert option in shown.stdout
    assert "bench" in _wal_engine("--help").stdout


def test_bench_hands_arguments_to_the_real_suite() -> None:
    """The suite itself rejects what it does not know, before touching a database: an
    unknown option (argparse, exit 2) and an unknown workload (exit 1)."""
    unknown_option = _wal_engine("bench", "--quick", "--no-such-option")
    assert unknown_option.returncode == 2
    assert "unrecognized arguments: --no-such-option" in unknown_option.stderr
    unknown_workload = _wal_engine("bench", "--quick", "--only", "bogus")
    assert unknown_workload.returncode == 1
    assert "unknown workload(s) bogus" in unknown_workload.stderr


async def test_bench_forwards_every_argument_and_the_exit_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What `python -m benchmarks ARGS` would parse is what the suite's main gets; its
    return value is the exit code."""
    from benchmarks import suite

    parsed: list[argparse.Namespace] = []

    async def main() -> int:
        parsed.append(suite.argument_parser().parse_args())
        return 3

    monkeypatch.setattr(suite, "main", main)
    result = await cli("bench", "--quick", "--dsn", "postgresql://u@h/db", "--peers", "dbos",
                       "--sizes", "10,20", "--no-json", "--keep")
    assert result.exit_code == 3, result.output
    [args] = parsed
    assert (args.quick, args.dsn, args.peers, args.sizes, args.no_json, args.keep) == (
        True, "postgresql://u@h/db", ["dbos"], (10, 20), True, True)
    assert sys.argv[0] != "wal-engine bench", "sys.argv is restored"


async def test_bench_without_the_suite_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed without the repository (no benchmarks package), bench says so in one line."""
    monkeypatch.setitem(sys.modules, "benchmarks.suite", None)
    result = await cli("bench", "--quick")
    assert result.exit_code == 4
    assert "cannot import benchmarks.suite" in one_error_line(result)
