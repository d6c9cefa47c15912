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

from wal_engine.embedded.account import fallback_user_name, server_user_name
from wal_engine.embedded.binaries import bin_dir_env, find_pg_bin, required_binaries
from wal_engine.embedded.layout import (
    data_dir_env,
    default_data_dir,
    listen_host,
    log_file_name,
    port_file_name,
    settings_file_name,
    superuser_name,
)
from wal_engine.embedded.server import EmbeddedPostgres, StopMode, ensure_embedded

__all__ = [
    "EmbeddedPostgres",
    "StopMode",
    "bin_dir_env",
    "data_dir_env",
    "default_data_dir",
    "ensure_embedded",
    "fallback_user_name",
    "find_pg_bin",
    "listen_host",
    "log_file_name",
    "port_file_name",
    "required_binaries",
    "server_user_name",
    "settings_file_name",
    "superuser_name",
]
