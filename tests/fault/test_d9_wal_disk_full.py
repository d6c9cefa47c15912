"""D9 (RELIABILITY.md, deep tier): the WAL disk fills up.

The test module's own server gets its ``pg_wal`` on a small tmpfs; while two workers run,
a filler file takes the rest of that disk and the server is made to start a new WAL
segment: PostgreSQL PANICs and the cluster goes down (it cannot even finish crash recovery
on a full disk). Then the filler is removed and the server started again. Expected: I1
(nothing acknowledged is lost), I2 (seqs contiguous and unique), I5 (no effect without a
durable intent), and every task finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Final

import asyncpg
import pytest

from tests.fault.support import check_everything, report
from tests.fault.test_d8_disk_full import _mount_small_disk
from tests.fault.test_d_database_faults import (
    _all_done,
    _engine_with_own_ledger,
    _outcomes,
    _retry,
    _submit,
    _workers,
)
from wal_engine.testing.invariants import AckRecorder
from wal_engine.testing.postgres import DatabaseFactory, TestServer
from wal_engine.testing.processes import wait_until

WAL_DISK_MIB: Final = 64


def _move_wal(data_dir: Path, disk: Path) -> None:
    """Put the cluster's pg_wal on ``disk`` (the server is stopped), owned as before."""
    wal = data_dir / "pg_wal"
    target = disk / "pg_wal"
    shutil.copytree(wal, target, symlinks=True)
    owner = data_dir.stat()
    for path in (target, *target.rglob("*")):
        os.chown(path, owner.st_uid, owner.st_gid, follow_symlinks=False)
    target.chmod(0o700)
    shutil.rmtree(wal)
    wal.symlink_to(target)


def _fill(disk: Path) -> int:
    """Write a filler file until the disk is full; returns its size."""
    written = 0
    with (disk / "filler").open("wb") as filler:
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while True:
                filler.write(chunk)
                filler.flush()
                written += len(chunk)
    return written


async def _make_wal(dsn: str) -> None:
    """Switch to a new WAL segment and keep writing until the server goes down."""
    with contextlib.suppress(*_DOWN):
        connection = await asyncpg.connect(dsn, timeout=5)
        await connection.execute("CREATE TABLE IF NOT EXISTS d9_churn (b bytea)")
        for _ in range(10_000):
            await connection.execute("SELECT pg_switch_wal()")
            await connection.execute("INSERT INTO d9_churn SELECT repeat('x', 8000)::bytea "
                                     "FROM generate_series(1, 100)")


_DOWN: Final = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


@pytest.mark.deep
@pytest.mark.timeout(600)
async def test_d9_wal_disk_full(crashable: tuple[TestServer, DatabaseFactory]) -> None:
    """The WAL disk fills while 30 tasks run: the cluster PANICs and stays down; after the
    space is back and it is started again, nothing acknowledged is lost and all finish."""
    server, factory = crashable
    if server.embedded is None or server.data_dir is None:
        pytest.skip("D9 needs the module's own embedded server")
    disk = _mount_small_disk(WAL_DISK_MIB)
    dsn = await factory.create()
    engine = ledger_db = None
    try:
        await asyncio.to_thread(server.embedded.stop, "fast")
        await asyncio.to_thread(_move_wal, server.data_dir, disk)
        await asyncio.to_thread(server.embedded.start)
        engine, ledger_db = await _engine_with_own_ledger(dsn)
        acks = AckRecorder()
        acks.install(engine)
        expected = await _submit(engine, "d9", 30)
        async with _workers(engine, 2):
            await wait_until(lambda: acks.appends > 20, "the first appends", 60, 0.05)
            filled = await asyncio.to_thread(_fill, disk)
            await _make_wal(server.admin_dsn)
            await wait_until(lambda: not server.embedded.is_running(),  # type: ignore[union-attr]
                             "the cluster to go down", 120, 0.2)
            log = (server.data_dir / "server.log").read_text(errors="replace")
            panicked = "PANIC" in log
            acknowledged_while_up = len(acks.acknowledged)
            await asyncio.to_thread((disk / "filler").unlink)
            await asyncio.to_thread(server.embedded.start)
            await wait_until(lambda: _retry(lambda: _all_done(engine, list(expected))),
                             "every task to finish", 240, 0.2)
        violations, effects = await check_everything(engine, acks=acks)
        outcomes, escalated, unknown = await _outcomes(engine, expected)
    finally:
        if engine is not None:
            await engine.close()
        if ledger_db is not None:
            await ledger_db.close()
        await asyncio.to_thread(server.embedded.stop, "immediate")  # Before its disk goes.
        await asyncio.to_thread(_unmount_when_free, disk)
    report("D9", violations + outcomes, tasks=len(expected), effects=effects,
           filler_mib=round(filled / 2**20), panic_logged=panicked,
           acknowledged_before_the_panic=acknowledged_while_up,
           acknowledged_appends=len(acks.acknowledged), escalated=escalated,
           tool_outcome_unknown=unknown)
    assert panicked


def _unmount_when_free(disk: Path) -> None:
    """Unmount the WAL disk; the module's server is stopped and is not started again."""
    (disk / "filler").unlink(missing_ok=True)
    subprocess.run(["umount", "-l", str(disk)], check=False)
    with contextlib.suppress(OSError):
        disk.rmdir()
