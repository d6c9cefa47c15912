"""Running as an unprivileged user when we are root, and running PostgreSQL tools as it."""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from wal_engine.errors import EmbeddedServerUnavailable
from wal_engine.observability.logs import get_logger

_log = get_logger(__name__)

server_user_name: Final = "walengine"
fallback_user_name: Final = "nobody"
useradd_timeout_s: Final = 30.0


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
