"""Applying the database side as its owner: ``schema.sql`` then ``security.sql``.

Beside :func:`~wal_engine.store.connection.apply_schema` because both are SQL the store
applies; the roles they create and check are :mod:`wal_engine.security.roles`' names.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Final

import asyncpg

from wal_engine.security.roles import APP_ROLE, OWNER_ROLE
from wal_engine.store.connection import apply_schema

SET_PARAMETERS: Final = """
SELECT set_config('wal_engine.owner_role', $1, true),
       set_config('wal_engine.app_role', $2, true)
"""


def security_sql() -> str:
    """The text of ``security.sql`` (packaged in the wheel, or at the repository root)."""
    packaged = resources.files("wal_engine").joinpath("security.sql")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parents[2] / "security.sql").read_text(encoding="utf-8")


async def apply_security(
    connection: asyncpg.Connection,
    *,
    owner_role: str = OWNER_ROLE,
    app_role: str = APP_ROLE,
    migrate: bool = True,
) -> None:
    """Create the roles and apply ownership and grants (``security.sql``), idempotently.

    Run it as a superuser after every migration (re-creating a function resets its
    SECURITY DEFINER and search_path). With ``migrate`` the schema is applied first. The
    application role is a NOLOGIN group: tenants log in as roles of their own, members of
    it, made by :func:`wal_engine.security.tenants.create_tenant` (which also sets their timeouts).
    """
    if migrate:
        await apply_schema(connection)
    async with connection.transaction():
        await connection.execute(SET_PARAMETERS, owner_role, app_role)
        await connection.execute(security_sql())
