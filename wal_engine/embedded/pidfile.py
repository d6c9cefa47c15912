"""What the data directory says about the server: ``postmaster.pid``, liveness, ports and
shared memory.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from wal_engine.embedded.layout import listen_host, superuser_name

probe_timeout_s: Final = 2.0
probe_reply_bytes_max: Final = 8192
protocol_version: Final = 3 << 16
"""Frontend/backend protocol 3.0, as sent in a StartupMessage."""
cannot_connect_now_sqlstate: Final = b"57P03"


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


def _running_bin_dir(pid: int) -> Path | None:
    """The directory of the binary process ``pid`` runs (Linux procfs; None elsewhere or
    when it cannot be read)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/exe")).parent
    except OSError:
        return None


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
