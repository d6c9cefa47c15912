"""The embedded PostgreSQL server: start, reuse, crash, restart, and a missing install."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import asyncpg
import pytest

from wal_engine.embedded import EmbeddedPostgres, find_pg_bin
from wal_engine.errors import EmbeddedServerUnavailable

repo_root: Final = Path(__file__).resolve().parents[2]
connect_timeout_s: Final = 10.0
child_timeout_s: Final = 120.0
process_exit_timeout_s: Final = 10.0

_ensure_running_script: Final = (
    "import sys\n"
    "from pathlib import Path\n"
    "from wal_engine.embedded import EmbeddedPostgres\n"
    "print(EmbeddedPostgres(Path(sys.argv[1]), fsync=False).ensure_running())\n"
)


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh data directory whose server, whoever started it, is stopped afterwards."""
    path = tmp_path / "pgdata"
    yield path
    EmbeddedPostgres(path).stop("immediate")


@pytest.fixture
def server(data_dir: Path) -> EmbeddedPostgres:
    """An embedded server without fsync (faster; crash-safe short of an OS crash)."""
    return EmbeddedPostgres(data_dir, fsync=False)


async def _fetch_value(dsn: str, query: str) -> object:
    connection = await asyncpg.connect(dsn, timeout=connect_timeout_s)
    try:
        return await connection.fetchval(query)
    finally:
        await connection.close()


def _wait_until_gone(pid: int, *, zombie_counts: bool = True) -> None:
    """Wait until ``pid`` has exited (and, unless ``zombie_counts``, been reaped)."""
    deadline = time.monotonic() + process_exit_timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z" and zombie_counts:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still alive")


async def test_server_starts_with_durable_settings(data_dir: Path) -> None:
    """A new data dir is initialised, the server accepts asyncpg and commits synchronously."""
    server = EmbeddedPostgres(data_dir)
    dsn = await asyncio.to_thread(server.ensure_running)
    assert dsn == f"postgresql://postgres@127.0.0.1:{server.port}/postgres?sslmode=disable"
    assert await _fetch_value(dsn, "SHOW synchronous_commit") == "on"
    assert await _fetch_value(dsn, "SHOW fsync") == "on"
    assert await _fetch_value(dsn, "SHOW full_page_writes") == "on"
    assert await _fetch_value(dsn, "SHOW max_connections") == "300"
    assert await _fetch_value(dsn, "SHOW listen_addresses") == "127.0.0.1"
    assert server.is_running()


async def test_fsync_off_applies_to_fsync_and_full_page_writes(server: EmbeddedPostgres) -> None:
    """fsync=False turns off fsync and full_page_writes but never synchronous_commit."""
    dsn = await asyncio.to_thread(server.ensure_running)
    assert await _fetch_value(dsn, "SHOW fsync") == "off"
    assert await _fetch_value(dsn, "SHOW full_page_writes") == "off"
    assert await _fetch_value(dsn, "SHOW synchronous_commit") == "on"


def test_ensure_running_twice_reuses_the_server(server: EmbeddedPostgres, data_dir: Path) -> None:
    """A second call, from the same or another instance, reuses the running server."""
    first = server.ensure_running()
    pid = server.pid()
    assert server.ensure_running() == first
    assert EmbeddedPostgres(data_dir, fsync=False).ensure_running() == first
    assert server.pid() == pid


def test_two_processes_at_once_share_one_server(server: EmbeddedPostgres, data_dir: Path) -> None:
    """Two processes racing on a fresh data dir get one server and the same DSN."""
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    command = [sys.executable, "-c", _ensure_running_script, str(data_dir)]
    children = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    results = [child.communicate(timeout=child_timeout_s) for child in children]
    for child, (_, stderr) in zip(children, results, strict=True):
        assert child.returncode == 0, stderr.decode()
    # structlog prints to stdout by default, so the DSN is the last line, not the only one.
    dsns = {stdout.decode().strip().splitlines()[-1] for stdout, _ in results}
    assert dsns == {server.dsn()}
    assert server.is_running()


async def test_immediate_stop_then_start_keeps_committed_data(server: EmbeddedPostgres) -> None:
    """A crash (immediate stop) loses nothing committed, and start() brings the server back."""
    dsn = await asyncio.to_thread(server.ensure_running)
    port = server.port
    await _fetch_value(dsn, "CREATE TABLE survivor AS SELECT 42 AS answer")
    await asyncio.to_thread(server.stop, "immediate")
    assert not server.is_running()
    assert server.pid() is None
    await asyncio.to_thread(server.start)
    assert server.port == port
    assert await _fetch_value(dsn, "SELECT answer FROM survivor") == 42


async def test_killed_postmaster_leaves_no_blocking_pid_file(server: EmbeddedPostgres) -> None:
    """After kill -9 of the postmaster, ensure_running starts a new server over the stale pid."""
    dsn = await asyncio.to_thread(server.ensure_running)
    await _fetch_value(dsn, "CREATE TABLE survivor AS SELECT 7 AS answer")
    old_pid = server.pid()
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    _wait_until_gone(old_pid)
    assert (server.data_dir / "postmaster.pid").exists()
    assert not server.is_running()
    assert await asyncio.to_thread(server.ensure_running) == dsn
    assert server.pid() not in (None, old_pid)
    assert await _fetch_value(dsn, "SELECT answer FROM survivor") == 7


async def test_ensure_running_waits_out_crash_recovery(server: EmbeddedPostgres) -> None:
    """After a backend is SIGKILLed (P9), ensure_running returns once sessions are let in."""
    dsn = await asyncio.to_thread(server.ensure_running)
    postmaster_pid = server.pid()
    victim = await asyncpg.connect(dsn, timeout=connect_timeout_s)
    backend_pid = await victim.fetchval("SELECT pg_backend_pid()")
    os.kill(backend_pid, signal.SIGKILL)
    # Once the postmaster has reaped the backend it is in crash recovery and refuses sessions.
    _wait_until_gone(backend_pid, zombie_counts=False)
    assert await asyncio.to_thread(server.ensure_running) == dsn
    assert await _fetch_value(dsn, "SELECT 1") == 1
    assert server.pid() == postmaster_pid
    victim.terminate()


def test_restart_reuses_the_port_and_moves_off_a_taken_one(server: EmbeddedPostgres) -> None:
    """The port is remembered across restarts, and a new one is picked if it was taken."""
    server.ensure_running()
    port = server.port
    assert port is not None
    assert server.restart("fast") == server.dsn()
    assert server.port == port
    server.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        dsn = server.ensure_running()
    assert server.port != port
    assert dsn == server.dsn()


def test_no_binaries_raises_with_instructions(tmp_path: Path) -> None:
    """With no PostgreSQL binaries anywhere, the error says how to get them or skip them."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    server = EmbeddedPostgres(tmp_path / "pgdata", search_paths=[empty])
    with pytest.raises(EmbeddedServerUnavailable) as caught:
        server.ensure_running()
    message = str(caught.value)
    assert "pip install 'wal-engine[embedded]'" in message
    assert "WAL_ENGINE_DSN" in message
    assert str(empty) in message
    assert not server.is_running()


def test_pg_bin_override_is_the_only_place_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WAL_ENGINE_PG_BIN pointing at an empty directory fails instead of falling back."""
    monkeypatch.setenv("WAL_ENGINE_PG_BIN", str(tmp_path))
    with pytest.raises(EmbeddedServerUnavailable, match="pip install 'wal-engine"):
        find_pg_bin()
