"""The server: :class:`EmbeddedPostgres` inits, starts, stops and reuses one cluster."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final, Literal

from wal_engine.dsn import Dsn
from wal_engine.embedded.account import (
    _Account,
    _give_to,
    _make_traversable,
    _open_install_to_others,
    _run,
    _server_account,
)
from wal_engine.embedded.binaries import find_pg_bin
from wal_engine.embedded.layout import (
    default_data_dir,
    listen_host,
    log_file_name,
    port_file_name,
    project_file_name,
    project_root,
    settings_file_name,
    superuser_name,
)
from wal_engine.embedded.pidfile import (
    _accepts_sessions,
    _is_live_postgres,
    _lock_file_is_stale,
    _pick_free_port,
    _PidFile,
    _port_free,
    _read_pid_file,
    _running_bin_dir,
    _shared_memory_attachments,
    _to_int,
)
from wal_engine.errors import ConfigurationError, EmbeddedServerUnavailable
from wal_engine.observability.logs import get_logger

_log = get_logger(__name__)

StopMode = Literal["fast", "immediate"]
_ServerState = Literal["ready", "absent", "busy"]

initdb_timeout_s: Final = 120.0
start_timeout_s: Final = 60
stop_timeout_s: Final = 60
command_grace_s: Final = 15.0
"""Extra time a pg_ctl subprocess gets beyond its own ``-t`` before it is killed."""
lock_timeout_s: Final = 300.0
"""Longest wait for another process's init and start; both together take a few seconds."""
orphan_wait_s: Final = 10.0
poll_interval_s: Final = 0.02
start_attempts_max: Final = 3
log_tail_bytes: Final = 4000
socket_path_bytes_max: Final = 103
"""Longest unix socket path: ``sun_path`` holds 108 bytes on Linux, 104 on macOS, NUL included."""
stale_pid_file_age_s: Final = 5.0


def _conf_value(value: str) -> str:
    # postgresql.conf strings are single-quoted and backslash escapes are honoured.
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _elapsed_ms(started: float) -> int:
    return round((time.monotonic() - started) * 1000)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ---------------------------------------------------------------------------------------
# The server.


class EmbeddedPostgres:
    """A PostgreSQL server in a local data directory, shared by every process that uses it.

    Args:
        data_dir: The cluster's directory; created and initialised on first use.
        fsync: Server ``fsync`` and ``full_page_writes``. Off survives a server crash but
            not an operating system crash; tests turn it off for speed.
        port: TCP port to listen on when this object starts the server; ``None`` picks a
            free one once and remembers it. A server already running keeps its port.
        search_paths: Where to look for the binaries (see :func:`find_pg_bin`).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        fsync: bool = True,
        port: int | None = None,
        search_paths: Sequence[Path] | None = None,
    ) -> None:
        self.data_dir: Final = Path(data_dir).expanduser().resolve()
        self.fsync: Final = fsync
        self._requested_port: Final = port
        self._search_paths: Final = list(search_paths) if search_paths is not None else None
        self._lock_path: Final = self.data_dir.with_name(self.data_dir.name + ".lock")
        self._log_path: Final = self.data_dir / log_file_name

    # Public API ------------------------------------------------------------------------

    def ensure_running(self) -> str:
        """Initialise the cluster if needed, start the server unless it runs, return a DSN.

        A server already running on this data directory (started by any process) is reused.

        Raises:
            EmbeddedServerUnavailable: No binaries, or the server did not start (the
                message carries the end of the server log).
            ConfigurationError: The data directory holds something other than a cluster.
        """
        with self._locked():
            port = self._ensure_running_locked()
        return self._dsn_for(port, superuser_name)

    def start(self) -> None:
        """Start the server if it is not running (same as :meth:`ensure_running`)."""
        self.ensure_running()

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server; do nothing if it is not running.

        Args:
            mode: ``"fast"`` rolls back open transactions and checkpoints; ``"immediate"``
                kills every server process at once, like a crash (recovery runs at the
                next start).
        """
        with self._locked():
            self._stop_locked(mode)

    def restart(self, mode: StopMode = "fast") -> str:
        """Stop the server with ``mode`` and start it again; return the DSN."""
        with self._locked():
            self._stop_locked(mode)
            port = self._ensure_running_locked()
        return self._dsn_for(port, superuser_name)

    def is_running(self) -> bool:
        """Whether a server is running on this data directory and accepting connections."""
        return self._state()[0] == "ready"

    def pid(self) -> int | None:
        """The postmaster's process id, or ``None`` when no server is running."""
        info = _read_pid_file(self.data_dir)
        if info is None or info.pid is None or not _is_live_postgres(info.pid):
            return None
        return info.pid

    @property
    def port(self) -> int | None:
        """The TCP port of the server, or ``None`` before a port has ever been chosen."""
        info = _read_pid_file(self.data_dir)
        if info is not None and info.port is not None:
            return info.port
        return self._requested_port or self._remembered_port()

    def dsn(self, database: str = "postgres") -> str:
        """A DSN for ``database`` on this server (TCP on 127.0.0.1, user ``postgres``).

        Raises:
            EmbeddedServerUnavailable: The server was never started, so it has no port.
        """
        port = self.port
        if port is None:
            raise EmbeddedServerUnavailable(
                f"the embedded server in {self.data_dir} has not been started; "
                f"call ensure_running() first"
            )
        return self._dsn_for(port, database)

    # Locking and state -------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock_path.open("a+b") as handle:
            deadline = time.monotonic() + lock_timeout_s
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EmbeddedServerUnavailable(
                            f"{self._lock_path} stayed locked for {lock_timeout_s} s"
                        ) from None
                    time.sleep(poll_interval_s)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _state(self) -> tuple[_ServerState, _PidFile | None]:
        info = _read_pid_file(self.data_dir)
        if info is None:
            return "absent", None
        if info.pid is None:
            # Being written right now, or left half-written by a crash long ago.
            return ("absent" if info.age_s > stale_pid_file_age_s else "busy"), info
        if not _is_live_postgres(info.pid):
            return "absent", info
        if info.status == "ready" and info.port is not None and _accepts_sessions(info.port):
            return "ready", info
        return "busy", info  # starting, recovering or shutting down

    # Starting ------------------------------------------------------------------------------

    def _ensure_running_locked(self) -> int:
        deadline = time.monotonic() + start_timeout_s + command_grace_s
        attempts, failure = 0, ""
        while time.monotonic() < deadline:
            state, info = self._state()
            if state == "ready" and info is not None and info.port is not None:
                if info.pid is not None:
                    self._warn_if_foreign(info.pid)
                return info.port
            if state == "busy":
                time.sleep(poll_interval_s)
                continue
            if attempts == start_attempts_max:
                break
            attempts += 1
            failure = self._start_once(info)
        raise EmbeddedServerUnavailable(
            f"the embedded PostgreSQL server in {self.data_dir} did not start "
            f"({attempts} attempts): {failure}\n--- end of {self._log_path} ---\n"
            f"{self._log_tail()}"
        )

    def foreign_binaries(self, pid: int) -> Path | None:
        """The binaries of the running postmaster ``pid`` when they are not the ones this
        installation would start it with (another venv's or another version's); None when
        they are ours or cannot be told."""
        running = _running_bin_dir(pid)
        if running is None:
            return None
        try:
            ours = self._bin_dir()
        except EmbeddedServerUnavailable:
            return running
        return None if running.resolve() == ours.resolve() else running

    def _warn_if_foreign(self, pid: int) -> None:
        foreign = self.foreign_binaries(pid)
        if foreign is not None:
            _log.warning("embedded_server_foreign", data_dir=str(self.data_dir), pid=pid,
                         running_binaries=str(foreign),
                         hint="another installation started this server; it is reused as "
                              "is. `wal-engine embedded stop` stops it, so that the next "
                              "command starts this installation's own")

    def _start_once(self, stale: _PidFile | None) -> str:
        """Run one ``pg_ctl start``; return its output on failure, ``""`` on success."""
        account = _server_account(self.data_dir)
        bin_dir = self._prepare(account)
        self._clear_stale(stale)
        port = self._choose_port(account)
        self._write_settings(port, account)
        started = time.monotonic()
        argv = [str(bin_dir / "pg_ctl"), "start", "-D", str(self.data_dir)]
        argv += ["-l", str(self._log_path), "-w", "-t", str(start_timeout_s)]
        code, output = _run(
            argv, account=account, timeout_s=start_timeout_s + command_grace_s, detach=True
        )
        if code != 0:
            return output
        _log.info(
            "embedded_server_started",
            port=port,
            data_dir=str(self.data_dir),
            pid=self.pid(),
            user=account.name if account else None,
            elapsed_ms=_elapsed_ms(started),
        )
        return ""

    def _prepare(self, account: _Account | None) -> Path:
        """Make binaries and directories usable by the server user, init if needed."""
        bin_dir = self._bin_dir()
        if account is not None:
            _make_traversable(self.data_dir.parent)
            _open_install_to_others(bin_dir)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initialise(bin_dir, account)
        return bin_dir

    def _bin_dir(self) -> Path:
        try:
            major = _to_int((self.data_dir / "PG_VERSION").read_text())
        except FileNotFoundError:
            major = None
        return find_pg_bin(self._search_paths, major_version=major)

    def _initialise(self, bin_dir: Path, account: _Account | None) -> None:
        """Run initdb in a staging directory and rename it into place.

        initdb writes PG_VERSION early, so an initdb killed halfway in place would leave
        a directory that looks initialised but is not; the rename makes it all or nothing.
        """
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise ConfigurationError(
                f"{self.data_dir} is not empty and is not a PostgreSQL data directory; "
                f"choose another directory (WAL_ENGINE_DATA_DIR)"
            )
        staging = self.data_dir.with_name(f".{self.data_dir.name}.initdb")
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed initdb; we hold the lock
        staging.mkdir(mode=0o700, parents=True)
        _give_to(staging, account)
        started = time.monotonic()
        argv = [str(bin_dir / "initdb"), "-D", str(staging), "-U", superuser_name]
        argv += ["--auth=trust", "--encoding=UTF8", "--no-locale"]
        argv += [] if self.fsync else ["--no-sync"]
        code, output = _run(argv, account=account, timeout_s=initdb_timeout_s)
        if code != 0:
            raise EmbeddedServerUnavailable(f"initdb failed in {staging}: {output}")
        with (staging / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\n# Managed by wal-engine, rewritten at every start.\n"
                f"include_if_exists = '{settings_file_name}'\n"
            )
        if self.data_dir.exists():
            self.data_dir.rmdir()
        staging.rename(self.data_dir)
        if self.fsync:
            _fsync_directory(self.data_dir.parent)
        _log.info(
            "embedded_cluster_initialised",
            data_dir=str(self.data_dir),
            elapsed_ms=_elapsed_ms(started),
        )

    def _clear_stale(self, stale: _PidFile | None) -> None:
        """Make the lock files and shared memory of a killed server harmless."""
        # PostgreSQL refuses to start over a lock file (postmaster.pid, or the socket's
        # .s.PGSQL.<port>.lock) that is unreadable or names a pid kill() finds alive: a
        # zombie, when nothing reaps the killed postmaster, or a recycled pid.
        for path in [self.data_dir / "postmaster.pid", *self.data_dir.glob(".s.PGSQL.*.lock")]:
            if _lock_file_is_stale(path):
                path.unlink(missing_ok=True)
                _log.warning("embedded_stale_lock_file_removed", path=str(path))
        if stale is not None and stale.shmem_id is not None:
            # Backends of a killed postmaster exit on their own within moments; until then
            # PostgreSQL refuses to start ("pre-existing shared memory block is still in use").
            deadline = time.monotonic() + orphan_wait_s
            while _shared_memory_attachments(stale.shmem_id) and time.monotonic() < deadline:
                time.sleep(poll_interval_s)

    def _choose_port(self, account: _Account | None) -> int:
        if self._requested_port is not None:
            return self._requested_port
        remembered = self._remembered_port()
        if remembered is not None and _port_free(remembered):
            return remembered
        port = _pick_free_port()
        path = self.data_dir / port_file_name
        path.write_text(f"{port}\n")
        _give_to(path, account)
        if remembered is not None:
            _log.warning("embedded_port_changed", old_port=remembered, port=port)
        return port

    def _remembered_port(self) -> int | None:
        try:
            return _to_int((self.data_dir / port_file_name).read_text())
        except FileNotFoundError:
            return None

    def _write_settings(self, port: int, account: _Account | None) -> None:
        socket_path = f"{self.data_dir}/.s.PGSQL.{port}"
        socket_fits = len(os.fsencode(socket_path)) <= socket_path_bytes_max
        if not socket_fits:
            _log.warning("embedded_unix_socket_skipped", path=socket_path)
        on_off = "on" if self.fsync else "off"
        settings = {
            "port": str(port),
            "listen_addresses": listen_host,
            "unix_socket_directories": str(self.data_dir) if socket_fits else "",
            "fsync": on_off,
            "full_page_writes": on_off,
            "synchronous_commit": "on",  # acknowledged commits must survive a crash (P15)
            "max_connections": "300",
            "shared_buffers": "128MB",
            "logging_collector": "off",
            "log_min_messages": "warning",
        }
        path = self.data_dir / settings_file_name
        path.write_text("".join(f"{key} = {_conf_value(v)}\n" for key, v in settings.items()))
        _give_to(path, account)

    # Stopping ------------------------------------------------------------------------------

    def _stop_locked(self, mode: StopMode) -> None:
        info = _read_pid_file(self.data_dir)
        if info is None or info.pid is None or not _is_live_postgres(info.pid):
            return
        account = _server_account(self.data_dir)
        bin_dir = self._bin_dir()
        started = time.monotonic()
        argv = [str(bin_dir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode]
        argv += ["-w", "-t", str(stop_timeout_s)]
        code, output = _run(argv, account=account, timeout_s=stop_timeout_s + command_grace_s)
        if code != 0 and _is_live_postgres(info.pid):
            raise EmbeddedServerUnavailable(f"pg_ctl stop failed for {self.data_dir}: {output}")
        _log.info(
            "embedded_server_stopped",
            mode=mode,
            data_dir=str(self.data_dir),
            elapsed_ms=_elapsed_ms(started),
        )

    # Helpers -----------------------------------------------------------------------------

    def _dsn_for(self, port: int, database: str) -> str:
        # The server has no certificate: without sslmode=disable every connection would
        # first ask for TLS and be refused, a round trip and an SSL context built each
        # time (measured: 1.3 ms of 9 ms a connect, 1.2 ms of client CPU).
        return Dsn(hosts=(listen_host,), ports=(port,), user=superuser_name,
                   database=database, query=(("sslmode", "disable"),)).render()

    def _log_tail(self) -> str:
        try:
            with self._log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - log_tail_bytes))
                return log.read().decode(errors="replace")
        except OSError:
            return "(no server log)"


async def ensure_embedded(data_dir: Path | None = None, *, fsync: bool = True) -> str:
    """Start (or reuse) the embedded server without blocking the event loop; return its DSN.

    Args:
        data_dir: The cluster's directory; defaults to :func:`default_data_dir`.
        fsync: See :class:`EmbeddedPostgres`.
    """
    server = EmbeddedPostgres(data_dir or default_data_dir(), fsync=fsync)
    dsn = await asyncio.to_thread(server.ensure_running)
    if data_dir is None:
        record_project(server.data_dir)
    return dsn


def record_project(data_dir: Path) -> None:
    """Write which project a default data directory serves (``wal-engine embedded status``
    reads it, and calls a server whose project is gone stale)."""
    root = project_root()
    path = data_dir / project_file_name
    text = f"{root}\n" if root is not None else "\n"
    with contextlib.suppress(OSError):
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
