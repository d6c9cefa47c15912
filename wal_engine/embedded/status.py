"""What ``wal-engine embedded status`` reports: every embedded server of this user, where
it lives, which project it serves, whether it runs, and whether it is stale or foreign.

A server is *stale* when the project it was started for no longer exists (it would keep
its data and, if running, its port forever), and *foreign* when the running postmaster's
binaries are not the ones this installation would use (another virtual environment, or
another PostgreSQL version, started it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from wal_engine.embedded.layout import _user_base, default_data_dir, project_file_name
from wal_engine.embedded.pidfile import _is_live_postgres, _read_pid_file
from wal_engine.embedded.server import EmbeddedPostgres

servers_listed_max: Final = 200


@dataclass(frozen=True)
class ServerStatus:
    """One embedded server's data directory and state."""

    data_dir: str
    project: str | None
    """The project directory it serves (None: outside any project, or not recorded)."""
    running: bool
    pid: int | None
    port: int | None
    stale: bool
    foreign_binaries: str | None
    current: bool
    """Whether it is the data directory this working directory uses."""

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON-ready mapping."""
        return asdict(self)


def status_of(data_dir: Path, *, current: Path | None = None) -> ServerStatus:
    """The state of the embedded server in ``data_dir`` (which need not exist)."""
    server = EmbeddedPostgres(data_dir)
    info = _read_pid_file(server.data_dir)
    pid = info.pid if info is not None and info.pid is not None else None
    running = pid is not None and _is_live_postgres(pid)
    try:
        recorded = (server.data_dir / project_file_name).read_text().strip() or None
    except OSError:
        recorded = None
    foreign = server.foreign_binaries(pid) if running and pid is not None else None
    here = (current or default_data_dir()).expanduser().resolve()
    return ServerStatus(
        data_dir=str(server.data_dir), project=recorded,
        running=running, pid=pid if running else None,
        port=server.port, stale=recorded is not None and not Path(recorded).exists(),
        foreign_binaries=str(foreign) if foreign is not None else None,
        current=server.data_dir == here)


def known_data_dirs() -> list[Path]:
    """Every default data directory of this user: the one outside projects and one per
    project (at most :data:`servers_listed_max`)."""
    base = _user_base()
    found = [base / "pgdata"] if (base / "pgdata").exists() else []
    projects = base / "projects"
    if projects.is_dir():
        found += sorted(p / "pgdata" for p in projects.iterdir() if (p / "pgdata").is_dir())
    return found[:servers_listed_max]
