"""Least privilege: applying ``security.sql``, and the runtime's start-up self-test.

``security.sql`` (next to ``schema.sql``) creates an owner role (NOLOGIN, owns the schema
and every engine object) and an application role (SELECT and INSERT on the log, head and
lease changes through SECURITY DEFINER functions and column-limited UPDATEs); see its
header and ``docs/security.md``. :func:`apply_security` applies it, as a superuser, after
the schema.

At start-up, :meth:`wal_engine.store.Database.open` runs :func:`check_runtime_role`: the
engine refuses to run as a superuser, as a role with BYPASSRLS, or as a role that owns (or
may act as the owner of) the log, since such a role could rewrite history that the
append-only triggers and privileges are meant to protect. Development setups (the embedded
server, ``WAL_ENGINE_DEVELOPMENT=1``, or ``connect(development=True)``) are only told.
"""

from __future__ import annotations

import os
import urllib.parse
from importlib import resources
from pathlib import Path
from typing import Final

import asyncpg
import msgspec
import structlog

from wal_engine import limits
from wal_engine.errors import ConfigurationError

log = structlog.get_logger(__name__)

OWNER_ROLE: Final = "engine_owner"
APP_ROLE: Final = "engine_app"
DEVELOPMENT_ENV: Final = "WAL_ENGINE_DEVELOPMENT"
EMBEDDED_SETTINGS_FILE: Final = "wal-engine.conf"
"""The settings file the embedded server writes (``wal_engine.embedded``)."""

idle_in_transaction_timeout_ms_default: Final = 60_000

SET_PARAMETERS: Final = """
SELECT set_config('wal_engine.owner_role', $1, true),
       set_config('wal_engine.app_role', $2, true),
       set_config('wal_engine.app_statement_timeout', $3, true),
       set_config('wal_engine.app_idle_timeout', $4, true)
"""

ROLE_ATTRIBUTES: Final = """
SELECT current_user AS role, r.rolsuper AS superuser, r.rolbypassrls AS bypassrls,
       current_setting('synchronous_commit') AS synchronous_commit
  FROM pg_roles r WHERE r.rolname = current_user
"""

# Engine objects (tables, views, functions, the schema) whose owner the current role is or
# may act as (membership), so that it could ALTER, DISABLE TRIGGER or DROP them.
OWNED_OBJECTS: Final = """
WITH here AS (SELECT n.oid, n.nspname, n.nspowner FROM pg_namespace n
               WHERE n.nspname = current_schema())
SELECT 'schema ' || here.nspname AS object FROM here
 WHERE pg_has_role(current_user, here.nspowner, 'MEMBER')
UNION ALL
(SELECT c.relname::text FROM pg_class c, here
  WHERE c.relnamespace = here.oid AND c.relname LIKE 'wal\\_%'
    AND c.relkind IN ('r', 'p', 'v', 'm') AND pg_has_role(current_user, c.relowner, 'MEMBER')
  ORDER BY 1 LIMIT 50)
UNION ALL
(SELECT p.oid::regprocedure::text FROM pg_proc p, here
  WHERE p.pronamespace = here.oid AND p.proname LIKE 'wal\\_%'
    AND pg_has_role(current_user, p.proowner, 'MEMBER')
  ORDER BY 1 LIMIT 50)
"""

# Visible to superusers only (pg_settings.sourcefile): whether the server runs on the
# settings file of wal-engine's embedded server.
EMBEDDED_SERVER: Final = """
SELECT coalesce(sourcefile LIKE '%/' || $1, false) AS embedded
  FROM pg_settings WHERE name = 'port'
"""


class InsecureSetup(ConfigurationError):
    """The runtime's role could rewrite the log; it refuses to start (RELIABILITY.md S9)."""

    def __init__(self, role: str, problems: list[str]) -> None:
        super().__init__(
            f"refusing to run as role {role!r}: {'; '.join(problems)}. Connect as the "
            f"application role made by wal_engine.security.apply_security (see "
            f"docs/security.md), or pass development=True / set {DEVELOPMENT_ENV}=1 for a "
            f"development setup"
        )
        self.role = role
        self.problems = problems


class RoleReport(msgspec.Struct, frozen=True, kw_only=True):
    """What the self-test found about the role the engine connected as."""

    role: str
    superuser: bool
    bypassrls: bool
    owned: list[str]
    """Engine objects the role owns or may act as the owner of (at most 101 listed)."""
    synchronous_commit: str

    def problems(self, *, require_synchronous_commit: bool = True) -> list[str]:
        """Why this role must not run the engine in production (empty: none)."""
        found = []
        if self.superuser:
            found.append("it is a superuser")
        if self.bypassrls:
            found.append("it has BYPASSRLS")
        if self.owned:
            shown = ", ".join(self.owned[:5]) + (", ..." if len(self.owned) > 5 else "")
            found.append(f"it owns or may act as the owner of {shown}")
        if require_synchronous_commit and self.synchronous_commit == "off":
            found.append("synchronous_commit is off")
        return found


async def check_runtime_role(connection: asyncpg.Connection) -> RoleReport:
    """Read the current role's attributes and what it owns (two round trips)."""
    row = await connection.fetchrow(ROLE_ATTRIBUTES)
    owned = await connection.fetch(OWNED_OBJECTS)
    return RoleReport(role=str(row["role"]), superuser=bool(row["superuser"]),
                      bypassrls=bool(row["bypassrls"]), owned=[r["object"] for r in owned],
                      synchronous_commit=str(row["synchronous_commit"]))


async def is_development_setup(connection: asyncpg.Connection, *, embedded_dsn: bool) -> bool:
    """Whether this is a development setup: the embedded server (started on demand, or
    recognised by its settings file) or ``WAL_ENGINE_DEVELOPMENT=1``."""
    if embedded_dsn or os.environ.get(DEVELOPMENT_ENV, "").lower() in ("1", "true", "yes"):
        return True
    return bool(await connection.fetchval(EMBEDDED_SERVER, EMBEDDED_SETTINGS_FILE))


async def enforce_runtime_role(
    connection: asyncpg.Connection,
    *,
    development: bool | None,
    embedded_dsn: bool = False,
    require_synchronous_commit: bool = True,
) -> RoleReport:
    """Run the self-test; raise :class:`InsecureSetup` unless it passes or this is a
    development setup (``development=None`` decides with :func:`is_development_setup`)."""
    report = await check_runtime_role(connection)
    problems = report.problems(require_synchronous_commit=require_synchronous_commit)
    if not problems:
        return report
    if development is None:
        development = await is_development_setup(connection, embedded_dsn=embedded_dsn)
    if not development:
        raise InsecureSetup(report.role, problems)
    log.debug("security_self_test_development", role=report.role, problems=problems)
    return report


def dsn_for_role(dsn: str, role: str, password: str | None = None) -> str:
    """The same server and database as ``dsn``, logging in as ``role``."""
    parts = urllib.parse.urlsplit(dsn)
    user = urllib.parse.quote(role, safe="")
    if password is not None:
        user += ":" + urllib.parse.quote(password, safe="")
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@{host}"))


def security_sql() -> str:
    """The text of ``security.sql`` (packaged in the wheel, or at the repository root)."""
    packaged = resources.files("wal_engine").joinpath("security.sql")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parents[1] / "security.sql").read_text(encoding="utf-8")


async def apply_security(
    connection: asyncpg.Connection,
    *,
    owner_role: str = OWNER_ROLE,
    app_role: str = APP_ROLE,
    statement_timeout_ms: int = limits.statement_timeout_ms,
    idle_in_transaction_timeout_ms: int = idle_in_transaction_timeout_ms_default,
    migrate: bool = True,
) -> None:
    """Create the roles and apply ownership and grants (``security.sql``), idempotently.

    Run it as a superuser after every migration (re-creating a function resets its
    SECURITY DEFINER and search_path). With ``migrate`` the schema is applied first. Role
    names are cluster-wide: give each engine database its own pair if several share a
    server and must not reach each other's data. The application role gets no password
    here; set one (``ALTER ROLE ... PASSWORD``, SCRAM) or map it in ``pg_hba.conf``.
    """
    if migrate:
        from wal_engine.store.connection import apply_schema

        await apply_schema(connection)
    for value, what in ((statement_timeout_ms, "statement_timeout_ms"),
                        (idle_in_transaction_timeout_ms, "idle_in_transaction_timeout_ms")):
        if value < 0:
            raise ValueError(f"{what} must be >= 0")
    async with connection.transaction():
        await connection.execute(SET_PARAMETERS, owner_role, app_role,
                                 f"{statement_timeout_ms}ms",
                                 f"{idle_in_transaction_timeout_ms}ms")
        await connection.execute(security_sql())
