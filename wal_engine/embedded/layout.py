"""Where an embedded server lives and how a DSN reaches it: the data directory, the files
wal-engine keeps in it, the listen address and the superuser.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Final

data_dir_env: Final = "WAL_ENGINE_DATA_DIR"
superuser_name: Final = "postgres"
listen_host: Final = "127.0.0.1"
port_file_name: Final = "wal-engine-port"
settings_file_name: Final = "wal-engine.conf"
log_file_name: Final = "server.log"


project_markers: Final = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
"""Files that mark a directory as a project's root (the nearest one up from the cwd)."""
project_file_name: Final = "wal-engine-project"
"""Holds the project directory a default data directory belongs to (for ``embedded status``)."""
project_key_chars: Final = 12


def project_root(start: Path | None = None) -> Path | None:
    """The nearest directory at or above ``start`` (default: the working directory) that
    holds a project marker (``pyproject.toml``, ``setup.py``, ``setup.cfg`` or ``.git``)."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if any((directory / marker).exists() for marker in project_markers):
            return directory
    return None


def _user_base() -> Path:
    if os.geteuid() == 0:
        return Path("/var/tmp/wal-engine")
    xdg = os.environ.get("XDG_DATA_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "wal-engine"


def default_data_dir(start: Path | None = None) -> Path:
    """Return the data directory used when the caller names none: one server per project.

    Returns:
        ``WAL_ENGINE_DATA_DIR`` if set. Otherwise a directory of the project the working
        directory (or ``start``) belongs to, ``BASE/projects/NAME-HASH/pgdata`` (NAME the
        project directory's name, HASH from its full path), or ``BASE/pgdata`` outside any
        project. BASE is ``/var/tmp/wal-engine`` under root (so the unprivileged server
        user can reach it without opening up ``/root``), else
        ``$XDG_DATA_HOME/wal-engine``, defaulting to ``~/.local/share/wal-engine``.
    """
    configured = os.environ.get(data_dir_env)
    if configured:
        return Path(configured).expanduser()
    base = _user_base()
    root = project_root(start)
    if root is None:
        return base / "pgdata"
    digest = hashlib.sha256(os.fsencode(root)).hexdigest()[:project_key_chars]
    return base / "projects" / f"{root.name or 'root'}-{digest}" / "pgdata"
