"""Where an embedded server lives and how a DSN reaches it: the data directory, the files
wal-engine keeps in it, the listen address and the superuser.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

data_dir_env: Final = "WAL_ENGINE_DATA_DIR"
superuser_name: Final = "postgres"
listen_host: Final = "127.0.0.1"
port_file_name: Final = "wal-engine-port"
settings_file_name: Final = "wal-engine.conf"
log_file_name: Final = "server.log"


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
