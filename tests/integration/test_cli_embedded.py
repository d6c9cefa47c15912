"""The embedded server per project and ``wal-engine embedded path|status|stop``: where it
lives, whether it runs, and a stale or foreign server named instead of reused silently."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from wal_engine.embedded import EmbeddedPostgres, find_pg_bin
from wal_engine.embedded.layout import default_data_dir, project_file_name


def _cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wal_engine.cli", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WAL_ENGINE_DATA_DIR", "WAL_ENGINE_DSN", "WAL_ENGINE_PG_BIN")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One data directory for the module (one initdb), its server stopped afterwards."""
    path = tmp_path_factory.mktemp("embedded-cli") / "pgdata"
    yield path
    EmbeddedPostgres(path).stop("immediate")


def test_each_project_has_its_own_data_directory(tmp_path: Path) -> None:
    """Two projects get two directories; a subdirectory uses its project's, and the CLI's
    `embedded path` prints the same one."""
    one, two = tmp_path / "one", tmp_path / "two"
    for project in (one, two):
        (project / "src").mkdir(parents=True)
        (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    first, second = default_data_dir(one / "src"), default_data_dir(two)
    assert first != second and first == default_data_dir(one)
    assert first.parent.name.startswith("one-") and first.parent.parent.name == "projects"
    printed = _cli("embedded", "path", cwd=one / "src", env=_env())
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == str(first)
    never = _cli("embedded", "status", cwd=two, env=_env())
    assert never.stdout.strip() == \
        f"{second}: not running; no project recorded yet [this project's]"


def test_status_and_stop_and_a_stale_project(tmp_path: Path, data_dir: Path) -> None:
    """status reports the running server (pid, port, this project's), a server whose
    project is gone as stale, and stop stops it."""
    EmbeddedPostgres(data_dir, fsync=False).ensure_running()
    env = _env(WAL_ENGINE_DATA_DIR=str(data_dir))
    (data_dir / project_file_name).write_text(f"{tmp_path / 'deleted-project'}\n")
    shown = _cli("embedded", "status", "--json", cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    (status,) = [orjson.loads(line) for line in shown.stdout.splitlines()]
    assert status["running"] and status["current"] and status["port"] > 0
    assert status["stale"] is True and status["foreign_binaries"] is None
    human = _cli("embedded", "status", cwd=tmp_path, env=env)
    assert "stale: its project" in human.stdout and "running (pid" in human.stdout
    stopped = _cli("embedded", "stop", cwd=tmp_path, env=env)
    assert stopped.returncode == 0 and stopped.stdout.strip().endswith("stopped")
    assert not EmbeddedPostgres(data_dir).is_running()
    again = _cli("embedded", "status", "--json", cwd=tmp_path, env=env)
    assert orjson.loads(again.stdout)["running"] is False


def test_a_server_of_other_binaries_is_named_foreign(tmp_path: Path, data_dir: Path) -> None:
    """A server started by other binaries than this installation's is reported, by status
    and by the warning of the command that reuses it."""
    EmbeddedPostgres(data_dir, fsync=False).ensure_running()
    other = tmp_path / "other-bin"
    other.mkdir()
    for binary in find_pg_bin().iterdir():
        (other / binary.name).symlink_to(binary)
    env = _env(WAL_ENGINE_DATA_DIR=str(data_dir), WAL_ENGINE_PG_BIN=str(other))
    shown = _cli("embedded", "status", "--json", cwd=tmp_path, env=env)
    assert orjson.loads(shown.stdout)["foreign_binaries"] == str(find_pg_bin())
    reused = _cli("tasks", cwd=tmp_path, env=env)
    assert "embedded_server_foreign" in reused.stderr + reused.stdout
