"""A hot standby of a test's own embedded PostgreSQL, for failover tests without Patroni.

``pg_basebackup -R`` copies the primary's cluster into a sibling directory and configures
streaming replication; the standby runs as the primary's server user on a port of its own.
A test can then stop the primary and promote the standby (``pg_ctl promote``): what a
client sees during a failover (sessions cut, connections refused, a server in recovery
refused by ``target_session_attrs=read-write``, then a new primary on another address).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Final

from wal_engine.dsn import Dsn
from wal_engine.embedded.binaries import find_pg_bin
from wal_engine.testing.postgres import TestServer

command_timeout_s: Final = 60.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on now (connections to it are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def with_hosts(dsn: str, ports: list[int], **query: str) -> str:
    """``dsn`` naming the hosts ``127.0.0.1:port`` for each of ``ports``, in order (a
    multi-host DSN), with ``query`` parameters set."""
    parsed = Dsn.parse(dsn)
    import msgspec

    parsed = msgspec.structs.replace(parsed, hosts=tuple("127.0.0.1" for _ in ports),
                                     ports=tuple(ports))
    for key, value in query.items():
        parsed = parsed.with_query(key, value)
    return parsed.render()


class HotStandby:
    """A streaming standby of ``primary`` (an embedded server a test started itself)."""

    def __init__(self, primary: TestServer) -> None:
        assert primary.embedded is not None and primary.data_dir is not None
        self.primary = primary
        self.data_dir = primary.data_dir.parent / "standby"
        self.port = free_port()
        owner = primary.data_dir.stat()
        self.uid, self.gid = owner.st_uid, owner.st_gid
        self.bin_dir = find_pg_bin()
        self.log_path = primary.data_dir.parent / "standby.log"

    def _run(self, *argv: str) -> str:
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        with tempfile.TemporaryFile() as output:
            as_owner = os.geteuid() == 0 and self.uid != 0
            completed = subprocess.run(
                list(argv), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                timeout=command_timeout_s, check=False, cwd="/", env=env,
                user=self.uid if as_owner else None, group=self.gid if as_owner else None,
                extra_groups=[] if as_owner else None)
            output.seek(0)
            text = output.read().decode(errors="replace")
        if completed.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({completed.returncode}): {text[-2000:]}")
        return text

    def create(self) -> HotStandby:
        """Copy the primary (``pg_basebackup -R``) and start the standby; returns self."""
        primary_port = self.primary.embedded.port  # type: ignore[union-attr]
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.parent.chmod(0o777)  # The server user writes the copy beside it.
        self._run(str(self.bin_dir / "pg_basebackup"), "-D", str(self.data_dir), "-R",
                  "-X", "stream", "-c", "fast", "-h", "127.0.0.1", "-p", str(primary_port),
                  "-U", "postgres")
        # The copy holds the primary's lock and pid files' leftovers: none, pg_basebackup
        # skips them. Its settings include the primary's port: overridden on the command line.
        self.start()
        return self

    def start(self) -> None:
        """Start the standby (or the promoted server) on its own port."""
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories='{self.data_dir}'")
        self._run(str(self.bin_dir / "pg_ctl"), "start", "-D", str(self.data_dir), "-w",
                  "-t", "60", "-o", options, "-l", str(self.log_path))

    def promote(self) -> None:
        """Make the standby a primary (waits until it accepts writes)."""
        self._run(str(self.bin_dir / "pg_ctl"), "promote", "-D", str(self.data_dir), "-w",
                  "-t", "60")

    def stop(self, mode: str = "immediate") -> None:
        """Stop the standby if it runs."""
        if (self.data_dir / "postmaster.pid").exists():
            self._run(str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m",
                      mode, "-w", "-t", "60")

    def dsn(self, database: str) -> str:
        """A DSN of ``database`` on the standby."""
        return with_hosts(self.primary.dsn(database), [self.port])

    def wait_replayed(self, timeout_s: float = 30.0) -> None:
        """Wait until the standby has replayed everything the primary wrote so far."""
        deadline = time.monotonic() + timeout_s
        lsn = self._query(self.primary.embedded.port,  # type: ignore[union-attr]
                          "SELECT pg_current_wal_lsn()")
        while time.monotonic() < deadline:
            replayed = self._query(self.port, f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'")
            if replayed == "t":
                return
            time.sleep(0.05)
        raise TimeoutError("the standby did not catch up")

    def _query(self, port: int, sql: str) -> str:
        return self._run(str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(port),
                         "-U", "postgres", "-d", "postgres", "-Atc", sql).strip()
