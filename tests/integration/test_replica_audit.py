"""Audits on a read replica (issue 22): ``tasks``, ``history``, ``show``, ``verify`` and
``timeline`` with ``--replica DSN`` read a real streaming standby (``pg_basebackup -R`` of a
primary this module starts), say how far behind it is, and write nothing.

The primary and the standby are shared by the module's tests (one start each, ~1 s)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import asyncpg
import msgspec
import pytest

from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, drive, lines, one_error_line
from wal_engine.embedded import find_pg_bin
from wal_engine.embedded.pidfile import _pick_free_port
from wal_engine.engine import connect
from wal_engine.store.connection import apply_schema
from wal_engine.store.replica import lsn_bytes
from wal_engine.testing.plugin import run_sync
from wal_engine.testing.postgres import TestServer, start_embedded_server

DATABASE: Final = "walt_replica"
catch_up_timeout_s: Final = 30.0


class Replicated(msgspec.Struct, kw_only=True):
    primary: str
    standby: str
    standby_dir: Path


def _as_owner(argv: list[str], data_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool as the owner of the primary's cluster (the unprivileged user
    the embedded server runs as, when the tests run as root)."""
    owner = data_dir.stat()
    root = os.geteuid() == 0
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, check=False, cwd="/",
        env={key: value for key, value in os.environ.items() if not key.startswith("PG")},
        user=owner.st_uid if root else None, group=owner.st_gid if root else None,
        extra_groups=[] if root else None)


def _start_standby(server: TestServer) -> tuple[str, Path]:
    """A hot standby of ``server`` streaming from it; returns its admin DSN and directory."""
    assert server.data_dir is not None
    bin_dir = find_pg_bin(major_version=int((server.data_dir / "PG_VERSION").read_text()))
    if not (bin_dir / "pg_basebackup").exists():
        pytest.skip(f"no pg_basebackup beside the server binaries in {bin_dir}")
    primary_port = int(server.admin_dsn.rsplit(":", 1)[1].split("/", 1)[0])
    standby = server.data_dir.parent / "standby"
    standby.mkdir(mode=0o700)
    owner = server.data_dir.stat()
    if os.geteuid() == 0:
        os.chown(standby, owner.st_uid, owner.st_gid)
    copied = _as_owner([str(bin_dir / "pg_basebackup"), "-D", str(standby), "-R",
                        "-X", "stream", "-h", "127.0.0.1", "-p", str(primary_port),
                        "-U", "postgres", "--no-sync", "--checkpoint=fast"], server.data_dir)
    assert copied.returncode == 0, copied.stderr
    port = _pick_free_port()
    with (standby / "postgresql.auto.conf").open("a") as conf:
        # postgresql.auto.conf is read last: it overrides the primary's copied settings.
        conf.write(f"port = {port}\nunix_socket_directories = '{standby}'\n")
    started = _as_owner([str(bin_dir / "pg_ctl"), "start", "-D", str(standby), "-l",
                         str(standby / "server.log"), "-w", "-t", "60"], server.data_dir)
    assert started.returncode == 0, started.stdout + started.stderr
    return f"postgresql://postgres@127.0.0.1:{port}/postgres?sslmode=disable", standby


def _stop_standby(server: TestServer, standby: Path) -> None:
    assert server.data_dir is not None
    bin_dir = find_pg_bin(major_version=int((standby / "PG_VERSION").read_text()))
    _as_owner([str(bin_dir / "pg_ctl"), "stop", "-D", str(standby), "-m", "immediate",
               "-w", "-t", "30"], server.data_dir)


@pytest.fixture(scope="module")
def replicated() -> Iterator[Replicated]:
    """A primary with the schema in ``walt_replica`` and a streaming standby of it."""
    server = start_embedded_server()
    standby_dir: Path | None = None
    try:
        run_sync(_create_database(server))
        standby_admin, standby_dir = _start_standby(server)
        yield Replicated(primary=server.dsn(DATABASE),
                         standby=standby_admin.replace("/postgres?", f"/{DATABASE}?"),
                         standby_dir=standby_dir)
    finally:
        if standby_dir is not None:
            _stop_standby(server, standby_dir)
        server.close()


async def _create_database(server: TestServer) -> None:
    admin = await asyncpg.connect(server.admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await admin.close()
    connection = await asyncpg.connect(server.dsn(DATABASE))
    try:
        await apply_schema(connection)
    finally:
        await connection.close()


async def _caught_up(setup: Replicated) -> None:
    """Wait until the standby has replayed everything the primary had written by now."""
    primary = await asyncpg.connect(setup.primary)
    try:
        target = lsn_bytes(await primary.fetchval("SELECT pg_current_wal_lsn()::text"))
    finally:
        await primary.close()
    standby = await asyncpg.connect(setup.standby)
    try:
        deadline = asyncio.get_running_loop().time() + catch_up_timeout_s
        while lsn_bytes(await standby.fetchval("SELECT pg_last_wal_replay_lsn()::text")) \
                < target:
            assert asyncio.get_running_loop().time() < deadline, "the standby lags on"
            await asyncio.sleep(0.02)
    finally:
        await standby.close()


async def _audit(setup: Replicated, *args: str, replica: bool = True) -> tuple[Any, list[Any]]:
    """Run a reading command with --json on the standby (or the primary); return its
    replica line (None on the primary) and its other lines."""
    where = ["--replica", setup.standby, "--dsn", setup.primary] if replica else \
        ["--dsn", setup.primary]
    result = await cli(*args, *where, "--development", "--json")
    assert result.exit_code == 0, result.output
    parsed = lines(result.stdout)
    if not replica:
        return None, parsed
    assert parsed and set(parsed[0]) == {"replica"}, parsed[:1]
    return parsed[0]["replica"], parsed[1:]


async def _submit_and_run(setup: Replicated, task_ids: list[str]) -> None:
    engine = await connect(setup.primary, migrate=False, development=True)
    try:
        agents.register(engine)
        for task_id in task_ids:
            await engine.submit("cli-echo", {"q": task_id}, task_id=task_id)
            await drive(engine, task_id)
    finally:
        await engine.close()


async def test_each_audit_command_reads_the_standby_and_says_how_far_behind(
        replicated: Replicated, tmp_path: Path) -> None:
    """Each command prints on the standby what it prints on the primary, after a replica
    line saying the standby is caught up; nothing is written on the standby."""
    await _submit_and_run(replicated, ["rep-1", "rep-2"])
    await _caught_up(replicated)
    for command in (["tasks"], ["tasks", "--by-version"], ["history", "rep-1"],
                    ["show", "rep-1"], ["verify", "rep-1"], ["verify", "--all"]):
        status, on_standby = await _audit(replicated, *command)
        _, on_primary = await _audit(replicated, *command, replica=False)
        assert on_standby == on_primary, command
        assert status["replay_paused"] is False and status["primary_note"] is None
        # Caught up before the command; the WAL the servers write on their own (a
        # checkpoint's, a running-transactions record: tens of bytes) may follow.
        assert 0 <= status["bytes_behind"] < 4096, status
        assert lsn_bytes(status["replay_lsn"]) <= lsn_bytes(status["primary_lsn"])
        assert "@127.0.0.1:" in status["replica"]
    assert [task["task_id"] for task in on_standby if "task_id" in task] == ["rep-1", "rep-2"]
    assert all(report["ok"] for report in on_standby)
    status, timeline = await _audit(replicated, "timeline", "rep-1", "--html",
                                    str(tmp_path / "rep-1.html"))
    history = (await _audit(replicated, "history", "rep-1"))[1]
    assert timeline == [{"task_id": "rep-1", "file": str(tmp_path / "rep-1.html"),
                         "events": len(history)}]
    assert "rep-1" in (tmp_path / "rep-1.html").read_text()
    human = await cli("verify", "rep-1", "--replica", replicated.standby, "--dsn",
                      replicated.primary, "--development")
    first, second = human.stdout.splitlines()[:2]
    assert first.startswith("reading standby "), first
    assert "behind the primary" in first or "caught up with the primary" in first, first
    assert second.startswith("task rep-1: ok"), human.stdout
    # Sound on a standby: every session was read-only, and no write was even attempted
    # (a standby logs each refused one: "cannot execute ... in a read-only transaction").
    log = (replicated.standby_dir / "server.log").read_text(errors="replace")
    assert "read-only transaction" not in log and "recovery is in progress" not in log


async def test_lag_is_reported_while_replay_is_paused(replicated: Replicated) -> None:
    """With replay paused, the replica line says so and counts the bytes behind; a task
    submitted since is not on the standby until replay resumes."""
    standby = await asyncpg.connect(replicated.standby)
    try:
        await standby.execute("SELECT pg_wal_replay_pause()")
        deadline = asyncio.get_running_loop().time() + catch_up_timeout_s
        while await standby.fetchval("SELECT pg_get_wal_replay_pause_state()") != "paused":
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        await _submit_and_run(replicated, ["rep-late"])
        status, listed = await _audit(replicated, "tasks")
        assert status["replay_paused"] is True
        assert status["bytes_behind"] > 0, status
        assert "rep-late" not in [task["task_id"] for task in listed]
        human = await cli("tasks", "--replica", replicated.standby, "--dsn",
                          replicated.primary, "--development")
        assert "replay PAUSED" in human.stdout.splitlines()[0]
        assert f"{status['bytes_behind']} bytes" in human.stdout or "bytes of WAL behind" \
            in human.stdout
        missing = await cli("history", "rep-late", "--replica", replicated.standby,
                            "--development")
        assert missing.exit_code == 3, missing.output  # unknown task, on the standby
        alone, _ = await _audit_without_primary(replicated)
        assert alone["bytes_behind"] is None and alone["primary_note"] == \
            "no primary DSN given" and alone["replay_paused"] is True
    finally:
        await standby.execute("SELECT pg_wal_replay_resume()")
        await standby.close()
    await _caught_up(replicated)
    status, listed = await _audit(replicated, "tasks")
    assert status["replay_paused"] is False
    assert "rep-late" in [task["task_id"] for task in listed]


async def _audit_without_primary(setup: Replicated) -> tuple[Any, list[Any]]:
    result = await cli("tasks", "--replica", setup.standby, "--development", "--json",
                       env={"WAL_ENGINE_DSN": ""})
    assert result.exit_code == 0, result.output
    parsed = lines(result.stdout)
    return parsed[0]["replica"], parsed[1:]


async def test_a_primary_or_an_unreachable_replica_is_a_clear_error(
        replicated: Replicated) -> None:
    """--replica naming the primary is refused (not a standby); an unreachable one is a
    one-line error naming the replica, without its password; exit code 4 for both."""
    primary = await cli("history", "rep-1", "--replica", replicated.primary, "--development")
    assert primary.exit_code == 4
    assert "is not a standby" in one_error_line(primary)
    port = _pick_free_port()
    secret = "s3cret-replica-pw"
    away = f"postgresql://postgres:{secret}@127.0.0.1:{port}/{DATABASE}?sslmode=disable"
    for command in (["verify", "--all"], ["tasks"], ["show", "rep-1"]):
        result = await cli(*command, "--replica", away, "--development")
        assert result.exit_code == 4, result.output
        line = one_error_line(result)
        assert line.startswith("error: replica unreachable at "), line
        assert secret not in result.output
    as_json = await cli("tasks", "--replica", away, "--development", "--json")
    error = lines(as_json.stderr)[0]
    assert error["exit_code"] == 4 and "replica unreachable" in error["error"]


def test_binaries_for_a_standby_exist() -> None:
    """The module needs pg_basebackup beside the server binaries (pgserver and Debian's
    PostgreSQL both ship it); say so loudly rather than skip the module silently."""
    bin_dir = find_pg_bin()
    assert (bin_dir / "pg_basebackup").exists() or shutil.which("pg_basebackup"), bin_dir
