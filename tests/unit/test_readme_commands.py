"""The README's two set-up commands: exactly two, and CI runs the test command as written
(so the command a new user copies is the one CI proves)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one() -> None:
    """Two bash blocks (demo, tests); .ci/run contains the test command's pytest part."""
    commands = _setup_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "wal-engine demo" in demo and "pip install" in demo
    install, separator, test_command = tests.partition(" && ")
    assert separator and install.startswith("pip install -e '.[test]'"), tests
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, (test_command, ci_lines)
