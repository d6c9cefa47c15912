"""Least privilege: the roles of ``security.sql``, and the runtime's start-up self-test.

``security.sql`` (next to ``schema.sql``) creates an owner role (NOLOGIN, owns the schema
and every engine object) and an application role, a NOLOGIN group holding the runtime's
privileges (SELECT and INSERT on the log, head and lease changes through SECURITY DEFINER
functions and column-limited UPDATEs); each tenant logs in as a member of its own
(:mod:`wal_engine.security.tenants`). See its header and ``docs/security.md``.
:func:`wal_engine.store.setup.apply_security` applies it, as a superuser, after the schema
(the store applies SQL; this module names the roles and checks them, below the store).

At start-up, :meth:`wal_engine.store.Database.open` runs :func:`check_runtime_role`: the
engine refuses to run as a superuser, as a role with BYPASSRLS, as a role that owns (or
may act as the owner of) the log, since such a role could rewrite history that the
append-only triggers and privileges are meant to protect, as a member of
``pg_signal_backend`` (it could terminate other tenants' sessions), on a session whose
settings differ from those the engine sent at connection start (a pooler that drops
startup parameters), or as a role whose own defaults (``ALTER ROLE ... SET``) weaken a
setting the engine depends on. Development setups (the embedded server,
``WAL_ENGINE_DEVELOPMENT=1``, or ``connect(development=True)``) are only told.
"""

from __future__ import annotations

import os
from typing import Final

import asyncpg
import msgspec

from wal_engine import limits
from wal_engine.dsn import Dsn
from wal_engine.errors import DEVELOPMENT_ENV as DEVELOPMENT_ENV
from wal_engine.errors import InsecureSetup as InsecureSetup
from wal_engine.observability.logs import get_logger

log = get_logger(__name__)

OWNER_ROLE: Final = "engine_owner"
APP_ROLE: Final = "engine_app"
EMBEDDED_SETTINGS_FILE: Final = "wal-engine.conf"
"""The settings file the embedded server writes (``wal_engine.embedded``)."""

ROLE_ATTRIBUTES: Final = """
SELECT current_user AS role, r.rolsuper AS superuser, r.rolbypassrls AS bypassrls,
       current_setting('synchronous_commit') AS synchronous_commit,
       pg_has_role(current_user, 'pg_signal_backend', 'USAGE') AS signals_backends
  FROM pg_roles r WHERE r.rolname = current_user
"""

# Other login roles whose rights the current role may take (membership, direct or not):
# it could terminate or cancel their sessions (pg_terminate_backend checks exactly that).
LOGIN_ROLES_REACHED: Final = """
SELECT r.rolname FROM pg_roles r
 WHERE r.rolcanlogin AND r.rolname <> current_user
   AND pg_has_role(current_user, r.oid, 'MEMBER')
 ORDER BY 1 LIMIT 6
"""

# The session's values of the settings the engine sent at connection start (base units:
# milliseconds for the timeouts), and where each came from.
SESSION_SETTINGS: Final = """
SELECT name, setting, source FROM pg_settings WHERE name = ANY ($1::text[])
 ORDER BY name LIMIT 100
"""

# The login role's own defaults (ALTER ROLE ... [IN DATABASE ...] SET), which any role may
# set for itself.
ROLE_DEFAULTS: Final = """
SELECT unnest(s.setconfig) AS item
  FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole
 WHERE r.rolname = session_user
   AND s.setdatabase IN (0, (SELECT d.oid FROM pg_database d
                              WHERE d.datname = current_database()))
 LIMIT 1000
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


TIMEOUT_SETTINGS: Final = ("statement_timeout", "idle_in_transaction_session_timeout")
_TRUE_WORDS: Final = frozenset({"on", "true", "yes", "1"})
_WEAK_COMMITS: Final = frozenset({"off", "local", "remote_write", "false", "no", "0"})
_DURATION_UNITS_MS: Final = {"us": 0.001, "ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000,
                             "d": 86_400_000, "": 1}


def required_settings(*, synchronous_commit: bool = True, read_only: bool = False,
                      statement_timeout_ms: int = limits.statement_timeout_ms,
                      idle_in_transaction_timeout_ms: int = limits.idle_in_transaction_timeout_ms,
                      ) -> dict[str, str]:
    """The settings every engine session sends at connection start (startup parameters
    win over role and database defaults), in pg_settings' base units.

    ``synchronous_commit=False`` leaves durability to the server's setting (the engine was
    told not to require it); ``read_only`` makes every transaction read-only (``replay``).
    """
    settings = {
        "statement_timeout": str(statement_timeout_ms),
        "idle_in_transaction_session_timeout": str(idle_in_transaction_timeout_ms),
        "row_security": "on",
        "default_transaction_read_only": "on" if read_only else "off",
        # The engine's statements are written for READ COMMITTED (ON CONFLICT, SKIP LOCKED).
        "default_transaction_isolation": "read committed",
    }
    if synchronous_commit:
        settings["synchronous_commit"] = "on"
    return settings


def _duration_ms(text: str) -> float | None:
    """A PostgreSQL duration (``300ms``, ``5s``, ``1min``, ``0``) in milliseconds."""
    cleaned = text.strip().strip("'\"").lower().replace(" ", "")
    digits = cleaned.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = cleaned[len(digits):]
    try:
        return float(digits) * _DURATION_UNITS_MS[unit]
    except (KeyError, ValueError):
        return None


def weakened_defaults(items: list[str], required: dict[str, str]) -> list[str]:
    """The role defaults (``name=value`` items of ``pg_db_role_setting``) that weaken a
    setting in ``required``: a timeout off or longer, synchronous commit off or local, or
    any other value of the remaining settings."""
    found = []
    for item in items:
        name, _, value = item.partition("=")
        name = name.strip().lower()
        if name not in required:
            continue
        word = value.strip().strip("'\"").lower()
        if name in TIMEOUT_SETTINGS:
            limit_ms = _duration_ms(value)
            weak = limit_ms is None or limit_ms == 0 or limit_ms > float(required[name])
        elif name == "synchronous_commit":
            weak = word in _WEAK_COMMITS
        elif required[name] in ("on", "off"):
            weak = (word in _TRUE_WORDS) != (required[name] == "on")
        else:
            weak = word != required[name]
        if weak:
            found.append(f"{name}={value}")
    return found


class RoleReport(msgspec.Struct, frozen=True, kw_only=True):
    """What the self-test found about the role the engine connected as."""

    role: str
    superuser: bool
    bypassrls: bool
    owned: list[str]
    """Engine objects the role owns or may act as the owner of (at most 101 listed)."""
    synchronous_commit: str
    signals_backends: bool = False
    """A member of pg_signal_backend: it could terminate any tenant's sessions."""
    weakened_defaults: list[str] = []
    """The role's own defaults (``ALTER ROLE ... SET``) that weaken a required setting."""
    unexpected_settings: list[str] = []
    """Required settings the session does not have although the engine sent them."""
    login_roles: list[str] = []
    """Other login roles it is a member of (at most 6 listed): it could signal their
    sessions."""

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
        if self.login_roles and not self.superuser:
            found.append("it is a member of the login role(s) "
                         + ", ".join(self.login_roles) + " (it could terminate their "
                         "sessions)")
        if self.signals_backends:
            found.append("it is a member of pg_signal_backend (it could terminate other "
                         "tenants' sessions)")
        if self.weakened_defaults:
            found.append("its own defaults weaken settings the engine depends on ("
                         + ", ".join(self.weakened_defaults) + "; the owner resets them "
                         "with `wal-engine tenant rotate`)")
        if self.unexpected_settings:
            found.append("the session did not keep the settings sent at connection start ("
                         + ", ".join(self.unexpected_settings) + "; a pooler that drops "
                         "startup parameters?)")
        return found

    @property
    def may_administer(self) -> bool:
        """Whether the role could take the owner's rights anyway (superuser, owner): the
        roles that run migrations and may name their tenant by the setting."""
        return self.superuser or bool(self.owned)


async def check_runtime_role(connection: asyncpg.Connection,
                             required: dict[str, str] | None = None) -> RoleReport:
    """Read the current role's attributes, what it owns, which login roles it reaches, and,
    given the ``required`` settings, how the session and the role's own defaults compare
    (five round trips, once per engine start)."""
    row = await connection.fetchrow(ROLE_ATTRIBUTES)
    owned = await connection.fetch(OWNED_OBJECTS)
    reached = [str(r["rolname"]) for r in await connection.fetch(LOGIN_ROLES_REACHED)]
    weakened: list[str] = []
    unexpected: list[str] = []
    if required:
        defaults = [str(r["item"]) for r in await connection.fetch(ROLE_DEFAULTS)]
        weakened = weakened_defaults(defaults, required)
        actual = {r["name"]: str(r["setting"])
                  for r in await connection.fetch(SESSION_SETTINGS, list(required))}
        unexpected = [f"{name} is {actual.get(name)!r}, not {value!r}"
                      for name, value in required.items() if actual.get(name) != value]
    return RoleReport(role=str(row["role"]), superuser=bool(row["superuser"]),
                      bypassrls=bool(row["bypassrls"]), owned=[r["object"] for r in owned],
                      synchronous_commit=str(row["synchronous_commit"]),
                      signals_backends=bool(row["signals_backends"]),
                      weakened_defaults=weakened, unexpected_settings=unexpected,
                      login_roles=reached)


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
    required: dict[str, str] | None = None,
) -> RoleReport:
    """Run the self-test; raise :class:`InsecureSetup` unless it passes or this is a
    development setup (``development=None`` decides with :func:`is_development_setup`)."""
    report = await check_runtime_role(connection, required)
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
    """The same server, database and parameters as ``dsn``, logging in as ``role`` (with
    ``password``, or none)."""
    parsed = Dsn.parse(dsn)
    return msgspec.structs.replace(parsed, user=role, password=password).render()
