"""An embedded PostgreSQL server, started on demand in a local data directory.

When no DSN is given and ``WAL_ENGINE_DSN`` is unset, the engine runs its own server so the
demo and the tests work on a fresh machine. The binaries come from the ``pgserver`` wheel
(``pip install 'wal-engine[embedded]'``) or from a PostgreSQL installed on the machine.

Layout of one embedded server, for a data directory ``D``::

    D/                     the cluster (initdb), owned by the user the server runs as
    D/wal-engine.conf      settings, rewritten before every start (included by postgresql.conf)
    D/wal-engine-port      the TCP port, chosen once so later processes find the same server
    D/server.log           the server's log (pg_ctl -l)
    D.lock                 flock held while any process inits, starts or stops the server

Many processes may call :meth:`EmbeddedPostgres.ensure_running` at once (the demo spawns
workers); the lock makes exactly one of them start the server and the others reuse it.
PostgreSQL refuses to run as root, so under root the server runs as the unprivileged user
``walengine`` (created if missing). The class only runs subprocesses and is synchronous;
async callers use :func:`ensure_embedded` or ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import os
import pwd
import re
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import structlog

from wal_engine.errors import ConfigurationError, EmbeddedServerUnavailable

_log = structlog.get_logger(__name__)

StopMode = Literal["fast", "immediate"]
_ServerState = Literal["ready", "absent", "busy"]

data_dir_env: Final = "WAL_ENGINE_DATA_DIR"
bin_dir_env: Final = "WAL_ENGINE_PG_BIN"
server_user_name: Final = "walengine"
fallback_user_name: Final = "nobody"
superuser_name: Final = "postgres"
listen_host: Final = "127.0.0.1"
port_file_name: Final = "wal-engine-port"
settings_file_name: Final = "wal-engine.conf"
log_file_name: Final = "server.log"
required_binaries: Final = ("initdb", "pg_ctl", "postgres")

initdb_timeout_s: Final = 120.0
start_timeout_s: Final = 60
stop_timeout_s: Final = 60
command_grace_s: Final = 15.0
"""Extra time a pg_ctl subprocess gets beyond its own ``-t`` before it is killed."""
lock_timeout_s: Final = 300.0
"""Longest wait for another process's init and start; both together take a few seconds."""
version_timeout_s: Final = 10.0
useradd_timeout_s: Final = 30.0
orphan_wait_s: Final = 10.0
probe_timeout_s: Final = 2.0
probe_reply_bytes_max: Final = 8192
protocol_version: Final = 3 << 16
"""Frontend/backend protocol 3.0, as sent in a StartupMessage."""
cannot_connect_now_sqlstate: Final = b"57P03"
poll_interval_s: Final = 0.02
start_attempts_max: Final = 3
log_tail_bytes: Final = 4000
socket_path_bytes_max: Final = 103
"""Longest unix socket path: ``sun_path`` holds 108 bytes on Linux, 104 on macOS, NUL included."""
stale_pid_file_age_s: Final = 5.0

_install_hint: Final = (
    "Do one of: pip install 'wal-engine[embedded]' (installs pgserver, which ships the "
    "PostgreSQL binaries); or install the PostgreSQL server binaries (e.g. apt-get install "
    "postgresql, brew install postgresql) or point WAL_ENGINE_PG_BIN at their bin directory; "
    "or set WAL_ENGINE_DSN to the DSN of a PostgreSQL server you run yourself."
)


def default_data_dir() -> Path:
    """Return the data directory used when the caller names none.

    Returns:
        ``WAL_ENGINE_DATA_DIR`` if set; under root ``/var/tmp/wal-engine/pgdata`` (so the
        unprivileged server user can reach it without opening up ``/root``); otherwise
        ``$XDG_DATA_HOME/wal-engine/pgdata``, defaulting to ``~/.local/share``.
    """
    configured = os.environ.get(data_dir_env)
    if configured:
        return Path(configured).expanduser()
    if os.geteuid() == 0:
        return Path("/var/tmp/wal-engine/pgdata")
    xdg = os.environ.get("XDG_DATA_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "wal-engine" / "pgdata"


# ---------------------------------------------------------------------------------------
# Finding the binaries.


def find_pg_bin(
    search_paths: Sequence[Path] | None = None, *, major_version: int | None = None
) -> Path:
    """Return a directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Args:
        search_paths: Directories to try, in order. ``None`` means ``WAL_ENGINE_PG_BIN`` if
            set (and then only it), else pgserver's bundled binaries, ``PATH``, and the
            usual install folders, newest version first.
        major_version: When set (an existing cluster's ``PG_VERSION``), only binaries of
            this major version qualify, since PostgreSQL cannot open another's data files.

    Raises:
        EmbeddedServerUnavailable: No directory qualifies; the message says what to do.
    """
    candidates = list(search_paths) if search_paths is not None else _default_bin_candidates()
    complete = [path for path in candidates if _has_server_binaries(path)]
    for path in complete:
        if major_version is None or _major_version(path) == major_version:
            return path
    looked = ", ".join(str(path) for path in candidates) or "(nowhere)"
    if complete:
        raise EmbeddedServerUnavailable(
            f"the data directory was created by PostgreSQL {major_version}, but only other "
            f"versions were found in: {looked}. Install PostgreSQL {major_version} server "
            f"binaries and point WAL_ENGINE_PG_BIN at them, or use another data directory."
        )
    raise EmbeddedServerUnavailable(
        f"no PostgreSQL server binaries (initdb, pg_ctl, postgres) found; looked in: {looked}. "
        + _install_hint
    )


def _default_bin_candidates() -> list[Path]:
    override = os.environ.get(bin_dir_env)
    if override:
        # An explicit choice is the only place looked at, so a wrong one fails loudly.
        return [Path(override).expanduser()]
    candidates: list[Path] = []
    bundled = _pgserver_bin_dir()
    if bundled is not None:
        candidates.append(bundled)
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name)
        if found is not None:
            # Distributions link pg_ctl into /usr/bin; postgres sits beside the link target.
            candidates.append(Path(found).resolve().parent)
    candidates += _newest_first(Path("/usr/lib/postgresql").glob("*/bin"))
    candidates.append(Path("/usr/local/pgsql/bin"))
    candidates += _newest_first(Path("/opt/homebrew/opt").glob("postgresql*/bin"))
    candidates += _newest_first(Path("/usr").glob("pgsql-*/bin"))
    return list(dict.fromkeys(candidates))


def _pgserver_bin_dir() -> Path | None:
    # find_spec locates the package without importing it; importing pgserver would pull in
    # psutil and platformdirs and register its own atexit handlers.
    try:
        spec = importlib.util.find_spec("pgserver")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _newest_first(paths: Iterator[Path]) -> list[Path]:
    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))

    return sorted(paths, key=version, reverse=True)


def _has_server_binaries(directory: Path) -> bool:
    return all(
        (directory / name).is_file() and os.access(directory / name, os.X_OK)
        for name in required_binaries
    )


def _major_version(bin_dir: Path) -> int | None:
    completed = subprocess.run(
        [str(bin_dir / "postgres"), "--version"],
        capture_output=True,
        text=True,
        timeout=version_timeout_s,
        check=False,
    )
    match = re.search(r"\(PostgreSQL\) (\d+)", completed.stdout)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------------------
# Running as an unprivileged user when we are root.


@dataclass(frozen=True, slots=True)
class _Account:
    """The user the server processes run as (only when this process is root)."""

    name: str
    uid: int
    gid: int


def _server_account(data_dir: Path) -> _Account | None:
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(FileNotFoundError):
        owner = data_dir.stat().st_uid
        if owner != 0 and (data_dir / "PG_VERSION").exists():
            # The server must run as the cluster's owner, whoever initialised it.
            return _account_of(pwd.getpwuid(owner))
    entry = _lookup_user(server_user_name) or _create_user(server_user_name)
    entry = entry or _lookup_user(fallback_user_name)
    if entry is None:
        raise EmbeddedServerUnavailable(
            f"running as root, PostgreSQL needs an unprivileged user, but user "
            f"{server_user_name!r} could not be created and {fallback_user_name!r} does not "
            f"exist. Create a user {server_user_name!r}, run as a normal user, or set "
            f"WAL_ENGINE_DSN."
        )
    return _account_of(entry)


def _account_of(entry: pwd.struct_passwd) -> _Account:
    return _Account(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid)


def _lookup_user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _create_user(name: str) -> pwd.struct_passwd | None:
    argv = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    try:
        subprocess.run(argv, capture_output=True, timeout=useradd_timeout_s, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        _log.warning("embedded_server_user_not_created", user=name, error=str(exc))
    else:
        _log.info("embedded_server_user_created", user=name)
    # Looked up either way: a concurrent process may have created the user first.
    return _lookup_user(name)


def _make_traversable(directory: Path) -> None:
    """Add o+x to ``directory`` and each of its parents where missing, nothing else."""
    for path in (directory, *directory.parents):
        mode = path.stat().st_mode
        if not mode & stat.S_IXOTH:
            path.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


_opened_installs: Final[set[Path]] = set()
"""Install trees already opened up by this process; walking one takes a few milliseconds."""


def _open_install_to_others(bin_dir: Path) -> None:
    """Let the server user run pgserver's binaries and read their libraries and share files.

    pip run by root under a restrictive umask can leave the wheel closed to others, and
    pgserver opens it up the same way. A system install is left alone: its package manager
    made it usable, and adding mode bits across /usr/bin could loosen files closed on purpose.
    """
    if bin_dir in _opened_installs or bin_dir.parent.name != "pginstall":
        return
    install = bin_dir.parent
    _make_traversable(bin_dir)
    read = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
    execute = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
    _add_mode_bits(bin_dir, read | execute)
    # pgserver.libs holds the shared libraries auditwheel vendored for the binaries' rpath.
    for tree in (install / "lib", install / "share", install.parent.parent / "pgserver.libs"):
        if tree.is_dir():
            _add_mode_bits(tree, read)
    _opened_installs.add(bin_dir)


def _add_mode_bits(tree: Path, file_bits: int) -> None:
    directory_bits = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
    for root, _directories, files in os.walk(tree):
        paths = [(Path(root), directory_bits)] + [(Path(root) / name, file_bits) for name in files]
        for path, bits in paths:
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode) and stat.S_IMODE(mode) & bits != bits:
                path.chmod(stat.S_IMODE(mode) | bits)


def _give_to(path: Path, account: _Account | None) -> None:
    if account is not None:
        os.chown(path, account.uid, account.gid)


# ---------------------------------------------------------------------------------------
# Subprocesses.


def _run(
    argv: Sequence[str],
    *,
    account: _Account | None,
    timeout_s: float,
    detach: bool = False,
) -> tuple[int, str]:
    """Run a PostgreSQL tool (as ``account`` if set); return its exit code and output.

    Output goes through a temporary file, not a pipe: a server started by pg_ctl would
    inherit a pipe and keep it open, and reading it would then never finish.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    with tempfile.TemporaryFile() as output:
        try:
            completed = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
                cwd="/",  # the caller's directory may be closed to the server user
                env=env,
                user=account.uid if account else None,
                group=account.gid if account else None,
                extra_groups=[] if account else None,  # drop root's supplementary groups
                start_new_session=detach,  # a Ctrl-C aimed at the caller must not reach it
            )
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedServerUnavailable(
                f"{Path(argv[0]).name} did not finish within {timeout_s} s: {' '.join(argv)}"
            ) from exc
        output.seek(0)
        return completed.returncode, output.read().decode(errors="replace").strip()


# ---------------------------------------------------------------------------------------
# What the data directory says about the server.


@dataclass(frozen=True, slots=True)
class _PidFile:
    """The parts of ``postmaster.pid`` we use (pid, port, shared memory id, status)."""

    pid: int | None
    port: int | None
    shmem_id: int | None
    status: str
    age_s: float


def _read_pid_file(data_dir: Path) -> _PidFile | None:
    path = data_dir / "postmaster.pid"
    try:
        lines = path.read_text(errors="replace").splitlines()
        age_s = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    # Lines: pid, data dir, start time, port, socket dir, listen address, shmem key and
    # id, status. The postmaster writes them in steps, so any of them may be missing.
    fields = [*lines, "", "", "", "", "", "", "", ""]
    shmem = fields[6].split()
    return _PidFile(
        pid=_to_int(fields[0]),
        port=_to_int(fields[3]),
        shmem_id=_to_int(shmem[1]) if len(shmem) == 2 else None,
        status=fields[7].strip(),
        age_s=age_s,
    )


def _to_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _is_live_postgres(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        # Either it died just now, or there is no procfs to ask and kill() must do.
        return not Path("/proc/self").exists()
    # A zombie has an empty command line, and a recycled pid another program's: neither
    # is our postmaster, though kill() says they are alive.
    return b"postgres" in cmdline or b"postmaster" in cmdline


def _accepts_sessions(port: int) -> bool:
    """Whether the server on ``port`` lets a session in, as ``pg_isready`` asks it.

    A bare TCP connect is not enough: while recovering from a crashed backend (P9) the
    postmaster accepts the socket and postmaster.pid still says "ready", but every
    session is refused with SQLSTATE 57P03 until recovery ends.
    """
    body = b"user\0" + superuser_name.encode() + b"\0\0"
    startup = struct.pack("!ii", 8 + len(body), protocol_version) + body
    try:
        with socket.create_connection((listen_host, port), timeout=probe_timeout_s) as peer:
            peer.sendall(startup)
            kind, length = struct.unpack("!cI", _receive_exactly(peer, 5))
            payload = _receive_exactly(peer, min(length - 4, probe_reply_bytes_max))
    except (OSError, struct.error):
        return False
    if kind != b"E":
        return True  # an authentication request: the session would be let in
    # Any other error (too many connections, a bad password) still means a running server.
    # Fields are a type byte and a NUL-terminated string each; C holds the SQLSTATE.
    return b"\0C" + cannot_connect_now_sqlstate + b"\0" not in b"\0" + payload


def _receive_exactly(peer: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0:
        chunk = peer.recv(size)
        if not chunk:
            raise ConnectionResetError("server closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # PostgreSQL binds with SO_REUSEADDR too, so connections of the previous server
        # still in TIME_WAIT do not count as the port being taken.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((listen_host, port))
        except OSError:
            return False
        return True


def _pick_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((listen_host, 0))
        port: int = probe.getsockname()[1]
        return port


def _shared_memory_attachments(shmem_id: int) -> int:
    """Processes still attached to a SysV segment (0 when unknown or gone; Linux only)."""
    try:
        rows = Path("/proc/sysvipc/shm").read_text().splitlines()
    except OSError:
        return 0
    header = rows[0].split() if rows else []
    if "shmid" not in header or "nattch" not in header:
        return 0
    id_column, count_column = header.index("shmid"), header.index("nattch")
    for row in rows[1:]:
        fields = row.split()
        if len(fields) == len(header) and int(fields[id_column]) == shmem_id:
            return int(fields[count_column])
    return 0


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
        name = urllib.parse.quote(database, safe="")
        return f"postgresql://{superuser_name}@{listen_host}:{port}/{name}"

    def _log_tail(self) -> str:
        try:
            with self._log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - log_tail_bytes))
                return log.read().decode(errors="replace")
        except OSError:
            return "(no server log)"


def _lock_file_is_stale(path: Path) -> bool:
    """Whether a PostgreSQL lock file names no pid, or a pid that is not a postgres process."""
    try:
        pid = _to_int(path.read_text(errors="replace").partition("\n")[0])
    except FileNotFoundError:
        return False
    return pid is None or _pid_alive_other_program(pid)


def _pid_alive_other_program(pid: int) -> bool:
    """Whether ``pid`` is alive (kill() succeeds) although it is not a postgres process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # PostgreSQL itself treats EPERM as "not running"
    return not _is_live_postgres(pid)


async def ensure_embedded(data_dir: Path | None = None, *, fsync: bool = True) -> str:
    """Start (or reuse) the embedded server without blocking the event loop; return its DSN.

    Args:
        data_dir: The cluster's directory; defaults to :func:`default_data_dir`.
        fsync: See :class:`EmbeddedPostgres`.
    """
    server = EmbeddedPostgres(data_dir or default_data_dir(), fsync=fsync)
    return await asyncio.to_thread(server.ensure_running)
