"""A PostgreSQL server for tests and a fast factory of fresh databases.

The server is the one named by ``WAL_ENGINE_TEST_DSN`` when set, else an embedded server
started in a temporary directory with ``fsync=off`` (RELIABILITY.md finding 5: process
crashes lose nothing with ``fsync=off`` as long as ``synchronous_commit`` stays on). Only an
embedded server may be stopped or crashed by a test: the ``embedded`` attribute is None for
a borrowed server.

The temporary directory is on a memory file system when the machine has one with room
(:func:`scratch_root`): every test makes a database, and on ext4 each ``CREATE DATABASE``
made about 300 files while the inode allocator scanned the ones deleted before
(``recently_deleted``): 265-500 ms of the server's CPU per database on this machine,
growing over a run, against 17-42 ms on tmpfs.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

import asyncpg

from wal_engine.embedded import EmbeddedPostgres
from wal_engine.store.connection import apply_schema, with_database

TEST_DSN_ENV: Final = "WAL_ENGINE_TEST_DSN"
SCRATCH_ENV: Final = "WAL_ENGINE_TEST_TMPDIR"
MEMORY_FS: Final = Path("/dev/shm")
memory_fs_free_min_bytes: Final = 4 * 1024**3
"""Room a memory file system must have left to hold test servers (each writes up to its
``max_wal_size`` of WAL between checkpoints)."""


def scratch_root(prefix: str) -> Path:
    """A new directory for a test server's files: under ``WAL_ENGINE_TEST_TMPDIR`` when
    set, else under ``/dev/shm`` when it is a writable directory with 4 GiB free, else
    where :mod:`tempfile` puts it. Made with :func:`tempfile.mkdtemp`, so that the
    unprivileged server user can traverse it when the tests run as root."""
    chosen = os.environ.get(SCRATCH_ENV)
    if chosen:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=chosen))
    try:
        usage = shutil.disk_usage(MEMORY_FS)
        usable = os.access(MEMORY_FS, os.W_OK | os.X_OK) and MEMORY_FS.is_dir()
    except OSError:
        usable = False
    if usable and usage.free >= memory_fs_free_min_bytes:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=MEMORY_FS))
    return Path(tempfile.mkdtemp(prefix=prefix))


class TestServer:
    """A server the tests may create databases on."""

    __test__ = False  # Not a pytest test class despite the name.

    def __init__(self, admin_dsn: str, embedded: EmbeddedPostgres | None,
                 data_dir: Path | None) -> None:
        self.admin_dsn = admin_dsn
        self.embedded = embedded
        self.data_dir = data_dir

    def dsn(self, database: str) -> str:
        """DSN of ``database`` on this server."""
        return with_database(self.admin_dsn, database)

    def close(self) -> None:
        """Stop and remove an embedded server; leave a borrowed one alone."""
        if self.embedded is not None:
            self.embedded.stop("immediate")
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)


def start_test_server() -> TestServer:
    """Borrow ``WAL_ENGINE_TEST_DSN`` or start an embedded server in a temporary directory."""
    borrowed = os.environ.get(TEST_DSN_ENV)
    if borrowed:
        return TestServer(borrowed, None, None)
    root = scratch_root("wal-engine-test-")
    data_dir = root / "pgdata"
    server = EmbeddedPostgres(data_dir, fsync=False)
    return TestServer(server.ensure_running(), server, data_dir)


class DatabaseFactory:
    """Creates fresh databases from a template that already holds the schema."""

    def __init__(self, server: TestServer) -> None:
        self.server = server
        self.prefix = f"walt_{os.getpid()}"
        self.template = f"{self.prefix}_template"
        self._counter = itertools.count(1)
        self._created: list[str] = []

    async def prepare(self) -> None:
        """Create the template database and apply the schema to it."""
        admin = await asyncpg.connect(self.server.admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.template}"')
            await admin.execute(f'CREATE DATABASE "{self.template}"')
        finally:
            await admin.close()
        connection = await asyncpg.connect(self.server.dsn(self.template))
        try:
            await apply_schema(connection)
        finally:
            await connection.close()

    async def create(self) -> str:
        """A new database cloned from the template; returns its DSN."""
        name = f"{self.prefix}_{next(self._counter)}"
        admin = await asyncpg.connect(self.server.admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        finally:
            await admin.close()
        self._created.append(name)
        return self.server.dsn(name)

    async def drop(self, dsn: str) -> None:
        """Drop a database made by :meth:`create` (its connections are closed first)."""
        name = dsn.rsplit("/", 1)[-1].split("?", 1)[0]
        admin = await asyncpg.connect(self.server.admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        if name in self._created:
            self._created.remove(name)

    async def drop_all(self) -> None:
        """Drop every database this factory made and has not dropped yet, and the template.

        One at a time: a session that made hundreds of databases must not open hundreds of
        admin connections at once (``max_connections``).
        """
        for name in list(self._created):
            await self.drop(self.server.dsn(name))
        await self.drop(self.server.dsn(self.template))


def start_embedded_server(*, fsync: bool = False) -> TestServer:
    """Always start a new embedded server in a temporary directory (even when
    ``WAL_ENGINE_TEST_DSN`` is set): a server a test may stop, crash and restart.

    The directory comes from :func:`scratch_root`; :meth:`TestServer.close` removes it.
    """
    root = scratch_root("wal-engine-crashable-")
    data_dir = root / "pgdata"
    server = EmbeddedPostgres(data_dir, fsync=fsync)
    return TestServer(server.ensure_running(), server, data_dir)
