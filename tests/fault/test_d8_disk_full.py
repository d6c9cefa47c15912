"""D8 (RELIABILITY.md): the data disk fills up.

The log (``wal_events`` and its primary key) is moved to a tablespace on a 16 MB tmpfs that
a filler table then fills, so appends fail with 53100 (disk full) while workers run.
Expected: the error surfaces (no task is failed for it), no side effect starts without a
durable intent (I5), nothing acknowledged is lost, and once the filler is dropped every task
finishes with its crash-free output. Needs root (to mount the tmpfs) and a server the test
started (the tablespace lives on this machine); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Final

import asyncpg
import pytest
from structlog.testing import capture_logs

from tests.fault.support import check_everything, report
from tests.fault.test_d_database_faults import (
    ErrorCounter,
    _all_done,
    _engine_with_own_ledger,
    _outcomes,
    _submit,
    _workers,
)
from wal_engine.engine import Engine
from wal_engine.testing.invariants import AckRecorder
from wal_engine.testing.postgres import TestServer
from wal_engine.testing.processes import wait_until

TMPFS_MIB: Final = 16
CHUNK_BYTES: Final = 256 * 1024


def _mount_small_disk(mib: int = TMPFS_MIB) -> Path:
    """A world-traversable directory with a small tmpfs mounted on it (skip if impossible)."""
    if os.geteuid() != 0:
        pytest.skip("D8 mounts a tmpfs: needs root")
    root = Path(tempfile.mkdtemp(prefix="wal-d8-"))
    root.chmod(0o755)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs",
                             str(root)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        root.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    return root


def _unmount(disk: Path) -> None:
    subprocess.run(["umount", str(disk)], check=False)
    disk.rmdir()


async def _fill(admin: asyncpg.Connection, tablespace: str) -> int:
    """Fill the tablespace with incompressible rows until PostgreSQL reports 53100."""
    await admin.execute(f"CREATE TABLE d8_filler (b bytea) TABLESPACE {tablespace}")
    await admin.execute("ALTER TABLE d8_filler ALTER COLUMN b SET STORAGE EXTERNAL")
    written = 0
    for size in (CHUNK_BYTES, 8 * 1024, 512):
        while True:
            try:
                await admin.execute("INSERT INTO d8_filler VALUES ($1)", os.urandom(size))
            except asyncpg.DiskFullError:
                break
            written += size
    return written


async def _move_log(admin: asyncpg.Connection, tablespace: str) -> None:
    """Move the log's table and key index to ``tablespace``: each of its partitions (the
    partitioned table itself only names the tablespace of partitions made later)."""
    for kind, root in (("TABLE", "wal_events"), ("INDEX", "wal_events_pkey")):
        for row in await admin.fetch("SELECT relid::regclass::text AS name"
                                     " FROM pg_partition_tree($1::regclass)", root):
            await admin.execute(f"ALTER {kind} {row['name']} SET TABLESPACE {tablespace}")


@pytest.mark.timeout(240)
async def test_d8_data_disk_full(pg_server: TestServer, database_dsn: str) -> None:
    """30 tasks run while the log's disk is full, then the space comes back."""
    if pg_server.data_dir is None:
        pytest.skip("D8 needs a server started on this machine (WAL_ENGINE_TEST_DSN is set)")
    disk = _mount_small_disk()
    tablespace = f"wal_d8_{os.getpid()}"
    admin = await asyncpg.connect(database_dsn)
    moved = False
    try:
        location = disk / "ts"
        location.mkdir()
        owner = pg_server.data_dir.stat()
        os.chown(location, owner.st_uid, owner.st_gid)
        await admin.execute(f"CREATE TABLESPACE {tablespace} LOCATION '{location}'")
        await _move_log(admin, tablespace)
        moved = True
        engine, ledger_db = await _engine_with_own_ledger(database_dsn)
        errors = ErrorCounter(engine.database)
        acks = AckRecorder()
        acks.install(engine)
        try:
            expected = await _submit(engine, "d8", 30)
            filled = await _fill(admin, tablespace)
            with capture_logs() as logs:
                async with _workers(engine, 2):
                    await wait_until(lambda: _disk_full_seen(logs, errors), "a refused append",
                                     60, 0.05)
                    await asyncio.sleep(1.0)  # The workers keep running on a full disk.
                    blocked = len(expected) - len(await _finished(engine))
                    await admin.execute("DROP TABLE d8_filler")
                    await wait_until(lambda: _all_done(engine, list(expected)),
                                     "every task to finish", 120, 0.1)
            violations, effects = await check_everything(engine, acks=acks)
            outcomes, escalated, unknown = await _outcomes(engine, expected)
        finally:
            await engine.close()
            await ledger_db.close()
    finally:
        await admin.execute("DROP TABLE IF EXISTS d8_filler")
        if moved:
            await _move_log(admin, "pg_default")
        await admin.execute(f"DROP TABLESPACE IF EXISTS {tablespace}")
        await admin.close()
        _unmount(disk)
    report("D8", violations + outcomes, tasks=len(expected), effects=effects,
           filler_mib=round(filled / 2**20, 1), disk_full_errors=_disk_full_seen(logs, errors),
           tasks_unfinished_while_full=blocked, escalated=escalated,
           tool_outcome_unknown=unknown)


def _disk_full_seen(logs: list[dict[str, object]], errors: ErrorCounter) -> int:
    """Appends refused for lack of space: retried in place, or ending a run."""
    retried = sum(1 for entry in logs if entry.get("event") == "statement_retried"
                  and entry.get("sqlstate") == "53100")
    return retried + errors.counts.get("DatabaseUnavailable", 0)


async def _finished(engine: Engine) -> list[str]:
    rows = await engine.database.fetch(
        "SELECT task_id FROM wal_tasks WHERE status IN ('COMPLETED', 'FAILED')")
    return [row["task_id"] for row in rows]
