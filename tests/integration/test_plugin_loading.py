"""The pytest plugin in a user's project: it loads with plain pytest alone (and says what
to install when an async fixture is used), and the documented set-up runs warning-free
under pytest-asyncio's strict mode as well as its auto mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wal_engine.testing.postgres import TestServer

# pytest run with pytest-asyncio and Hypothesis made unimportable, as in a project that
# installed wal-engine without its test extra (None in sys.modules blocks an import).
WITHOUT_EXTRA = (
    "import sys\n"
    "sys.modules['pytest_asyncio'] = None\n"
    "sys.modules['hypothesis'] = None\n"
    "import pytest\n"
    "sys.exit(pytest.main(sys.argv[1:]))\n"
)

PLAIN_TESTS = '''
def test_plain():
    assert 1 + 1 == 2


def test_wants_the_engine(wal_test_engine):
    pass


def test_wants_the_machine(wal_crash_machine):
    pass
'''

# The pyproject.toml that docs/testing.md gives a new project.
USER_CONFIG = '''
[tool.pytest.ini_options]
asyncio_mode = "{mode}"
asyncio_default_fixture_loop_scope = "function"
'''

# docs/testing.md's style: each async test marked (needed in strict mode, harmless in auto
# mode), beside a sync test in the same module (a module-level pytestmark would make
# pytest-asyncio warn about it; the crash machine's tests are sync).
USER_TESTS = '''
import pytest


def test_sync_beside_async(wal_database_dsn):
    assert wal_database_dsn.startswith("postgresql://")


@pytest.mark.asyncio
async def test_engine_and_ledger(wal_test_engine, wal_effect_ledger):
    @wal_test_engine.agent("echo")
    async def echo(ctx, value):
        return value

    task = await wal_test_engine.submit("echo", {"v": 1})
    assert (await wal_test_engine.state(task)).status == "QUEUED"
    assert (await wal_effect_ledger.totals()).deliveries == 0
'''


def _env(tmp_path: Path, pg_server: TestServer, *, autoload: bool) -> dict[str, str]:
    # The project first, then whatever path this run has (a checkout that is not the
    # installed one puts itself there, and the child must load its plugin too).
    inherited = os.environ.get("PYTHONPATH")
    env = {**os.environ, "WAL_ENGINE_TEST_DSN": pg_server.admin_dsn,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *([inherited] if inherited else [])])}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    if not autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def test_plugin_loads_without_the_test_extra(tmp_path: Path, pg_server: TestServer) -> None:
    """Without pytest-asyncio and Hypothesis a plain test passes and a test using an
    async or machine fixture fails with the install command, not a plugin load error,
    before any server is reached (the DSN given names none)."""
    (tmp_path / "test_plain.py").write_text(textwrap.dedent(PLAIN_TESTS))
    env = {**_env(tmp_path, pg_server, autoload=False),
           "WAL_ENGINE_TEST_DSN": "postgresql://nobody@127.0.0.1:1/none"}
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, "-q", "-p", "no:cacheprovider",
         "-p", "wal_engine.testing.plugin", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 passed, 2 errors" in out, out
    assert "Error while loading plugin" not in out, out
    assert "'wal_test_engine' needs pytest-asyncio" in out, out
    assert "'wal_crash_machine' needs hypothesis" in out, out
    assert "pip install 'wal-engine[test]'" in out, out


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_documented_setup_has_no_warnings(tmp_path: Path, pg_server: TestServer,
                                          mode: str) -> None:
    """docs/testing.md's configuration and test style pass in both pytest-asyncio modes
    with no warning at all, every installed plugin autoloaded as in a user's venv."""
    (tmp_path / "pyproject.toml").write_text(USER_CONFIG.format(mode=mode))
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=_env(tmp_path, pg_server, autoload=True), capture_output=True,
        text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "2 passed" in out, out
    assert "warning" not in out.lower(), out
