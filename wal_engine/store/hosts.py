"""Connecting through a multi-host DSN: each host with a timeout of its own, the host that
answered last tried first.

asyncpg reads ``postgresql://u:p@host1,host2,host3/db?target_session_attrs=read-write``
itself, but its ``timeout`` covers the whole list: a first host that does not answer at
all (a lost node whose address drops packets, not one that refuses) takes the whole
budget, and the next hosts are never tried; and every new connection starts with the first
host again, so after a failover each one waits for the dead former primary first.
:func:`connect_any` tries the hosts one by one, each with the full timeout (as libpq's
``connect_timeout`` applies per host), starting with the host that gave this DSN its last
connection. A DSN of one host goes to asyncpg unchanged.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import asyncpg
import msgspec

from wal_engine.dsn import Dsn
from wal_engine.errors import InvalidDsn

_NEXT_HOST_SQLSTATES: Final = frozenset({"57P03"})
"""A server that cannot take sessions now (starting up, shutting down, in recovery): try
the next host, as asyncpg does."""

_last_good: dict[str, int] = {}
"""Per DSN text, the index of the host that gave its last connection (shared by the
pool's loop and the lease keeper's thread)."""
_lock = threading.Lock()


def _next_host(error: BaseException) -> bool:
    """Whether ``error`` of one host means: try the next one (what asyncpg's own host loop
    moves on after, plus a timeout of that host and a server that is not the kind
    ``target_session_attrs`` asks for)."""
    if isinstance(error, OSError | TimeoutError):
        return True
    if isinstance(error, asyncpg.exceptions.TargetServerAttributeNotMatched):
        return True
    if isinstance(error, asyncpg.PostgresError):
        code = str(error.sqlstate or "")
        return code in _NEXT_HOST_SQLSTATES or code.startswith("08")
    return False


def host_order(count: int, first: int) -> list[int]:
    """Indexes of ``count`` hosts, starting at ``first`` and wrapping around."""
    return [(first + step) % count for step in range(count)]


async def connect_any(dsn: str, *, timeout: float | None = None,  # noqa: ASYNC109 (asyncpg's name)
                      **options: Any
                      ) -> asyncpg.Connection:
    """``asyncpg.connect(dsn, timeout=timeout, **options)``, except that a DSN naming
    several hosts has each tried on its own with ``timeout``, the last good one first.
    Raises what the last host raised (asyncpg's rule), or at once an error that is no
    reason to try another host (a wrong password). Also the pool's ``connect`` callback:
    it takes and ignores ``loop``."""
    options.pop("loop", None)
    try:
        parsed = Dsn.parse(dsn)
    except InvalidDsn:
        parsed = None
    if parsed is None or len(parsed.hosts) < 2:
        return await asyncpg.connect(dsn, timeout=timeout, **options)
    with _lock:
        first = _last_good.get(dsn, 0) % len(parsed.hosts)
    last_error: BaseException | None = None
    for index in host_order(len(parsed.hosts), first):
        single = msgspec.structs.replace(parsed, hosts=(parsed.hosts[index],),
                                         ports=(parsed.ports[index],)).render()
        try:
            connection = await asyncpg.connect(single, timeout=timeout, **options)
        except Exception as error:
            if not _next_host(error):
                raise
            last_error = error
            continue
        with _lock:
            _last_good[dsn] = index
        return connection
    assert last_error is not None
    raise last_error
