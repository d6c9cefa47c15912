"""The saver's own pool: wal-engine's checks, without a session reset on every release.

asyncpg's pool resets a connection on release (``RESET ALL; UNLISTEN *; CLOSE ALL; ...``)
unless given a ``reset`` of its own: a second round trip for every statement. The saver
never changes session state (no ``SET``, no session advisory locks, no ``LISTEN``, no
cursors outside transactions), so its pool skips that query; asyncpg still rolls back a
transaction left open and drops listeners before handing a connection out again.
"""

from __future__ import annotations

from typing import Final

import asyncpg

from wal_engine import limits
from wal_engine.store import Database
from wal_engine.store.connection import connect_failure
from wal_engine.store.pooler import pool_options

pool_size_max: Final = 10
"""Connections of the saver's pool (LangGraph writes one thread's steps one at a time)."""


async def _keep_session(connection: asyncpg.Connection) -> None:
    """Release hook: nothing beyond asyncpg's own rollback (see the module docstring)."""


async def open_database(dsn: str | None = None, *, max_size: int = pool_size_max,
                        tenant: str | None = None) -> Database:
    """A :class:`Database` on ``dsn`` whose pool keeps sessions on release.

    The DSN is resolved, the schema applied or checked and durability checked exactly as
    :meth:`Database.open` does (it runs first, on one connection). Its connections are
    bound to ``tenant`` (default ``WAL_ENGINE_TENANT``, else ``"default"``) like an
    engine's.
    """
    checked = await Database.open(dsn, min_size=1, max_size=1, tenant=tenant)
    resolved = checked.dsn
    tenant = checked.tenant
    await checked.close()
    try:
        pool = await asyncpg.create_pool(
            resolved,
            min_size=1,
            max_size=max_size,
            timeout=limits.connect_timeout_s,
            command_timeout=limits.command_timeout_s,
            reset=_keep_session,
            # Through a pooler: its settings as the engine's travel (docs/pgbouncer.md).
            **pool_options(checked.pooler, checked.session_settings("wal-engine:langgraph")),
        )
    except Exception as error:
        raise connect_failure(resolved, error) from error
    assert pool is not None
    return Database(pool, resolved, tenant=tenant, pooler=checked.pooler,
                    listen_dsn=checked.listen_dsn, role_carries=checked.role_carries)
