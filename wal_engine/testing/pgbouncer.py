"""A real PgBouncer in front of a test PostgreSQL: a port, a directory and a process of its own.

:class:`PgBouncer` starts Debian's ``/usr/sbin/pgbouncer`` (1.18 on this project's CI) on a
free port of 127.0.0.1 with a temporary ini and auth file, in ``transaction`` or
``session`` pool mode, in front of a server given by host and port. Every database name is
served (``* =``), so the per-test databases of the suite's factory need no entry. PgBouncer
refuses to run as root: under root it runs as the unprivileged user the embedded PostgreSQL
runs as (``walengine``, else ``nobody``). :meth:`PgBouncer.close` stops only the process
this object started, by its pid.

Clients authenticate with ``trust`` by default (the test servers trust local logins too);
every user must still be listed in the auth file (:meth:`PgBouncer.add_user`, which
reloads the ini), and a password listed there is the one PgBouncer logs into the server
with. ``dsn(database, user)`` is the DSN to hand the engine, with ``pooler=`` the same mode.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Final

from wal_engine.dsn import Dsn
from wal_engine.embedded import fallback_user_name, server_user_name

PGBOUNCER_BINARY: Final = "/usr/sbin/pgbouncer"
POOL_MODES: Final = ("transaction", "session")
start_timeout_s: Final = 20.0
stop_timeout_s: Final = 10.0
transaction_pool_size_default: Final = 20
"""Server connections per (database, user) in transaction mode: far more clients share them."""
session_pool_size_default: Final = 100
"""In session mode each client holds a server connection for its life: an engine's pool plus
a worker's sweep, LISTEN and lease sessions, for a few engines per test database."""


class PgBouncerUnavailable(RuntimeError):
    """``pgbouncer`` is not installed, or did not start."""


def pgbouncer_binary() -> str:
    """The path of ``pgbouncer``; :class:`PgBouncerUnavailable` when it is missing."""
    for candidate in (PGBOUNCER_BINARY, shutil.which("pgbouncer")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise PgBouncerUnavailable("pgbouncer is not installed (apt-get install pgbouncer)")


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _quote_auth(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


class PgBouncer:
    """One PgBouncer a test (or the test session) owns."""

    def __init__(self, server_host: str, server_port: int, *, pool_mode: str = "transaction",
                 pool_size: int | None = None, users: dict[str, str] | None = None,
                 auth_type: str = "trust") -> None:
        if pool_mode not in POOL_MODES:
            raise ValueError(f"pool_mode must be one of {POOL_MODES}, not {pool_mode!r}")
        self.server_host = server_host
        self.server_port = server_port
        self.pool_mode = pool_mode
        self.pool_size = pool_size or (transaction_pool_size_default
                                       if pool_mode == "transaction"
                                       else session_pool_size_default)
        self.users: dict[str, str] = dict(users or {})
        self.auth_type = auth_type
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="wal-pgbouncer-"))
        self.process: subprocess.Popen[bytes] | None = None
        self._account = _run_account()

    @classmethod
    def in_front_of(cls, server_dsn: str, **options: object) -> PgBouncer:
        """A PgBouncer (not started) in front of the server of ``server_dsn``; its user
        is in the auth file."""
        parsed = Dsn.parse(server_dsn)
        users = dict(options.pop("users", None) or {})  # type: ignore[call-overload]
        users.setdefault(parsed.user or "postgres", parsed.password or "")
        return cls(parsed.hosts[0] if parsed.hosts else "127.0.0.1",
                   (parsed.ports[0] if parsed.ports else None) or 5432, users=users,
                   **options)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------ files

    def _first_user(self) -> str:
        """The user the harness was made for (the server's superuser): PgBouncer's admin,
        and its ``auth_user``, which looks any other login role up in ``pg_shadow``
        (``auth_query``), so roles a test creates need no entry in the auth file."""
        return next(iter(self.users), "postgres")

    @property
    def ini_path(self) -> Path:
        return self.directory / "pgbouncer.ini"

    @property
    def log_path(self) -> Path:
        return self.directory / "pgbouncer.log"

    def _write_files(self) -> None:
        auth = "".join(f"{_quote_auth(user)} {_quote_auth(password)}\n"
                       for user, password in sorted(self.users.items()))
        (self.directory / "users.txt").write_text(auth)
        ini = f"""[databases]
* = host={self.server_host} port={self.server_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = {self.auth_type}
auth_file = {self.directory / 'users.txt'}
pidfile = {self.directory / 'pgbouncer.pid'}
logfile = {self.log_path}
pool_mode = {self.pool_mode}
default_pool_size = {self.pool_size}
max_client_conn = 2000
server_reset_query = DISCARD ALL
server_idle_timeout = 30
server_connect_timeout = 5
server_login_retry = 1
query_wait_timeout = 60
admin_users = {self._first_user()}
auth_user = {self._first_user()}
ignore_startup_parameters = extra_float_digits
log_connections = 0
log_disconnections = 0
"""
        self.ini_path.write_text(ini)
        if self._account is not None:
            for path in (self.directory, *self.directory.iterdir()):
                os.chown(path, self._account.pw_uid, self._account.pw_gid)

    # ------------------------------------------------------------------------ process

    def start(self) -> PgBouncer:
        """Start PgBouncer and wait until it accepts connections on its port."""
        binary = pgbouncer_binary()
        self._write_files()
        output = (self.directory / "stdout.log").open("ab")
        account = self._account
        try:
            self.process = subprocess.Popen(
                [binary, str(self.ini_path)], stdin=subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, cwd=str(self.directory),
                user=account.pw_uid if account else None,
                group=account.pw_gid if account else None,
                extra_groups=[] if account else None,
                start_new_session=True)  # a Ctrl-C aimed at pytest must not reach it first
        finally:
            output.close()
        deadline = time.monotonic() + start_timeout_s
        while not self._accepts():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise PgBouncerUnavailable(f"pgbouncer on port {self.port} did not start: "
                                           f"{self.log_tail()}")
            time.sleep(0.02)
        return self

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def add_user(self, user: str, password: str = "") -> None:
        """List ``user`` in the auth file (PgBouncer logs into the server with
        ``password``) and reload the ini (SIGHUP)."""
        self.users[user] = password
        self._write_files()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGHUP)

    def dsn(self, database: str, *, user: str | None = None,
            password: str | None = None) -> str:
        """A DSN of ``database`` through this PgBouncer."""
        chosen = user or next(iter(self.users), "postgres")
        return Dsn(hosts=("127.0.0.1",), ports=(self.port,), user=chosen,
                   password=password, database=database).render()

    def via(self, direct_dsn: str) -> str:
        """``direct_dsn`` (a DSN of the server behind) rewritten to go through PgBouncer:
        same user, password, database and parameters."""
        import msgspec

        parsed = Dsn.parse(direct_dsn)
        return msgspec.structs.replace(parsed, hosts=("127.0.0.1",),
                                       ports=(self.port,)).render()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines PgBouncer logged (for failure messages)."""
        for path in (self.log_path, self.directory / "stdout.log"):
            if path.exists() and path.stat().st_size:
                return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def close(self) -> None:
        """Stop this object's PgBouncer (SIGINT: a safe shutdown, then SIGKILL after a
        deadline) and remove its directory."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=stop_timeout_s)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _run_account() -> pwd.struct_passwd | None:
    """The unprivileged user PgBouncer runs as under root (it refuses to run as root)."""
    if os.geteuid() != 0:
        return None
    for name in (server_user_name, fallback_user_name):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PgBouncerUnavailable(
        f"running as root, pgbouncer needs an unprivileged user ({server_user_name!r} or "
        f"{fallback_user_name!r}); neither exists")
