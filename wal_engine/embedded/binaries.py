"""Finding the PostgreSQL server binaries (``initdb``, ``pg_ctl``, ``postgres``)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

from wal_engine.errors import EmbeddedServerUnavailable

bin_dir_env: Final = "WAL_ENGINE_PG_BIN"
required_binaries: Final = ("initdb", "pg_ctl", "postgres")
version_timeout_s: Final = 10.0

_install_hint: Final = (
    "Do one of: pip install 'wal-engine[embedded]' (installs pgserver, which ships the "
    "PostgreSQL binaries); or install the PostgreSQL server binaries (e.g. apt-get install "
    "postgresql, brew install postgresql) or point WAL_ENGINE_PG_BIN at their bin directory; "
    "or set WAL_ENGINE_DSN to the DSN of a PostgreSQL server you run yourself."
)


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
