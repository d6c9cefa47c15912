"""Real ``redis-server`` processes for tests: a port and a directory of their own.

:class:`RedisServer` starts Debian's ``redis-server`` (never the one that may run on 6379)
with AOF and ``appendfsync always``, or without any persistence, and can SIGKILL and
restart it on the same port and data directory, so a test sees what a crash of Redis keeps.
:func:`start_sentinel_group` starts a primary, a replica and a Sentinel that watches them.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Final

start_timeout_s: Final = 20.0
SENTINEL_MASTER: Final = "walprimary"


class RedisUnavailable(RuntimeError):
    """``redis-server`` is not installed, or did not start."""


def redis_binary() -> str:
    """The path of ``redis-server``; :class:`RedisUnavailable` when it is missing."""
    found = shutil.which("redis-server")
    if found is None:
        raise RedisUnavailable("redis-server is not installed (apt-get install redis-server)")
    return found


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` a test owns; ``persistence`` is ``"aof"`` or ``"none"``."""

    def __init__(self, *, persistence: str = "aof", port: int | None = None,
                 data_dir: Path | None = None, extra: list[str] | None = None,
                 sentinel: bool = False) -> None:
        if persistence not in ("aof", "none"):
            raise ValueError(f"persistence must be 'aof' or 'none', not {persistence!r}")
        self.persistence = persistence
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="wal-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.extra = extra or []
        self.sentinel = sentinel
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        if self.sentinel:
            config = self.data_dir / "sentinel.conf"
            if not config.exists():
                config.write_text("")
            return [redis_binary(), str(config), "--sentinel", "--port", str(self.port),
                    "--bind", "127.0.0.1", "--dir", str(self.data_dir), *self.extra]
        durable = (["--appendonly", "yes", "--appendfsync", "always"]
                   if self.persistence == "aof" else ["--appendonly", "no"])
        return [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "", *durable,
                "--protected-mode", "no", "--logfile", str(self.data_dir / "redis.log"),
                *self.extra]

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        log = (self.data_dir / "stdout.log").open("ab")
        self.process = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + start_timeout_s
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RedisUnavailable(f"redis-server on port {self.port} did not start: "
                                       f"{self.log_tail()}")
            time.sleep(0.02)
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def info(self, section: str) -> dict[str, str]:
        """``INFO section`` as a mapping (raw RESP over a socket: no client needed)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as connection:
            connection.sendall(f"INFO {section}\r\n".encode())
            data = b""
            while not data.endswith(b"\r\n") or data.count(b"\r\n") < 2:
                chunk = connection.recv(65536)
                if not chunk:
                    break
                data += chunk
        lines = data.decode(errors="replace").splitlines()[1:]
        return dict(line.split(":", 1) for line in lines if ":" in line)

    def log_tail(self) -> str:
        """The last lines the server logged (for failure messages)."""
        lines: list[str] = []
        for name in ("redis.log", "stdout.log"):
            path = self.data_dir / name
            if path.exists():
                lines += path.read_text(errors="replace").splitlines()[-10:]
        return "\n".join(lines)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no AOF rewrite, like a power cut for the process."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def restart(self) -> RedisServer:
        """SIGKILL, then start again on the same port and directory."""
        self.kill()
        return self.start()

    def close(self) -> None:
        """Kill the server and remove its directory if this object made it."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class SentinelGroup:
    """A primary, a replica of it and one Sentinel (quorum 1) watching the primary."""

    def __init__(self, primary: RedisServer, replica: RedisServer,
                 sentinel: RedisServer) -> None:
        self.primary = primary
        self.replica = replica
        self.sentinel = sentinel

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        """Addresses to hand ``redis.asyncio.sentinel.Sentinel``."""
        return [("127.0.0.1", self.sentinel.port)]

    def close(self) -> None:
        """Stop all three."""
        for server in (self.sentinel, self.replica, self.primary):
            server.close()


def start_sentinel_group(*, down_after_ms: int = 500) -> SentinelGroup:
    """Start a primary with AOF, a replica of it, and a Sentinel that fails over to the
    replica ``down_after_ms`` after the primary stops answering."""
    # No diskless-sync delay: Redis waits 5 s by default for more replicas to sync at once.
    fast_sync = ["--repl-diskless-sync-delay", "0"]
    primary = RedisServer(persistence="aof", extra=fast_sync).start()
    started = [primary]
    try:
        replica = RedisServer(persistence="aof", extra=[
            *fast_sync, "--replicaof", "127.0.0.1", str(primary.port)]).start()
        started.append(replica)
        _wait_replication(replica)
        sentinel = RedisServer(sentinel=True)
        (sentinel.data_dir / "sentinel.conf").write_text(
            f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary.port} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_MASTER} {down_after_ms}\n"
            f"sentinel failover-timeout {SENTINEL_MASTER} 5000\n"
            f"sentinel parallel-syncs {SENTINEL_MASTER} 1\n"
            f"logfile {sentinel.data_dir / 'redis.log'}\n")
        sentinel.start()
        started.append(sentinel)
    except BaseException:
        for server in started:
            with contextlib.suppress(Exception):
                server.close()
        raise
    return SentinelGroup(primary, replica, sentinel)


def _wait_replication(replica: RedisServer) -> None:
    """Wait until the replica's link to its primary is up (initial sync done)."""
    deadline = time.monotonic() + start_timeout_s
    while replica.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            raise RedisUnavailable(f"replica never synced: {replica.log_tail()}")
        time.sleep(0.05)
