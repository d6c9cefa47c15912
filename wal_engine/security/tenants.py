"""Tenant roles: each tenant's engines log in as a role of their own (issue 16).

Row security keys on the login role (``session_user``) through ``wal_tenant_roles``, a
table only the owner writes (``schema.sql``, decision 35 of ``docs/architecture.md``), so a
process holding one tenant's credential cannot name another tenant, signal another
tenant's sessions or change another tenant's defaults. This module is the owner's side:
it creates, lists, rotates, disables and enables those roles on an administrator's
connection (a superuser, or a role with CREATEROLE that is a member of the owner role).

* Role names are per database and opaque: ``wal_`` and 24 hex digits of a sha256 of the
  database and tenant names (:func:`tenant_role_name`). Role names are cluster-wide and
  listed to everyone in ``pg_roles``; the name neither clashes with another database's
  role nor tells other tenants who the tenants are.
* Passwords are SCRAM-SHA-256 verifiers computed here (:func:`scram_verifier`): the
  password itself never reaches the server, so no statement log can hold it.
* Each role: LOGIN, no superuser, BYPASSRLS, CREATEDB, CREATEROLE or REPLICATION, a member
  of the application group (which holds the runtime's privileges), CONNECT on this
  database, a connection limit (connection slots are shared by all tenants), and the
  engine's timeouts as its own defaults. Creating or rotating resets whatever defaults the
  role gave itself (``ALTER ROLE ... SET``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import string
from datetime import datetime
from typing import Final

import asyncpg
import msgspec

from wal_engine import limits
from wal_engine.errors import ConfigurationError, InvalidInput
from wal_engine.errors import TenantExists as TenantExists
from wal_engine.errors import UnknownTenant as UnknownTenant
from wal_engine.ids import validate_tenant
from wal_engine.security.roles import APP_ROLE, dsn_for_role

ROLE_PREFIX: Final = "wal_"
role_hash_digits: Final = 24
scram_iterations: Final = 4096
"""PostgreSQL's default (``scram_iterations``)."""
password_length_min: Final = 16
generated_password_bytes: Final = 32
connection_limit_default: Final = 64
"""Connections one tenant's role may hold at once: a pool (20 by default) plus each
worker's heartbeat, sweep and LISTEN sessions, for a few engines."""
tenants_listed_max: Final = 100_000

_PASSWORD_ALPHABET: Final = frozenset(string.ascii_letters + string.digits
                                      + string.punctuation)

SECURITY_APPLIED: Final = """
SELECT to_regclass('wal_tenant_roles') IS NOT NULL AS mapping,
       EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1 AND NOT rolcanlogin) AS app_group
"""

ROLE_EXISTS: Final = "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)"

# Utility statements take no parameters: format() quotes the identifiers and literals.
CREATE_ROLE: Final = "SELECT format('CREATE ROLE %I LOGIN', $1::text)"

ROLE_ATTRIBUTES: Final = """
SELECT format('ALTER ROLE %I LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE '
              'NOREPLICATION INHERIT CONNECTION LIMIT %s PASSWORD %L',
              $1::text, $2::integer, $3::text)
"""

RESET_DEFAULTS: Final = """
SELECT format('ALTER ROLE %I RESET ALL', $1::text) AS everywhere,
       format('ALTER ROLE %I IN DATABASE %I RESET ALL', $1::text, current_database())
           AS here,
       format('ALTER ROLE %I SET statement_timeout = %L', $1::text, $2::text) AS statement,
       format('ALTER ROLE %I SET idle_in_transaction_session_timeout = %L', $1::text,
              $3::text) AS idle
"""

GRANTS: Final = """
SELECT format('GRANT %I TO %I', $2::text, $1::text) AS membership,
       format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), $1::text) AS connect
"""

# Every role the new role is a member of, but the application group: a fresh role has
# none; a reused one must not bring any (pg_signal_backend, another tenant's role).
OTHER_MEMBERSHIPS: Final = """
SELECT g.rolname FROM pg_auth_members m
  JOIN pg_roles g ON g.oid = m.roleid JOIN pg_roles r ON r.oid = m.member
 WHERE r.rolname = $1 AND g.rolname <> $2
 ORDER BY 1 LIMIT 20
"""

# The tenant as the role's own default in this database: through a transaction pooler the
# engine sends no startup parameter, and each transaction then finds its tenant here (row
# security keys on the role anyway; decision 66).
TENANT_DEFAULT: Final = """
SELECT format('ALTER ROLE %I IN DATABASE %I SET wal.tenant = %L', $1::text,
              current_database(), $2::text)
"""

REVOKE_MEMBERSHIP: Final = "SELECT format('REVOKE %I FROM %I', $2::text, $1::text)"

INSERT_MAPPING: Final = """
INSERT INTO wal_tenant_roles (role_name, tenant) VALUES ($1, $2)
"""

READ_MAPPING: Final = """
SELECT role_name, tenant, enabled, created_at, rotated_at
  FROM wal_tenant_roles WHERE tenant = $1
"""

MARK_ROTATED: Final = "UPDATE wal_tenant_roles SET rotated_at = now() WHERE tenant = $1"

SET_ENABLED: Final = "UPDATE wal_tenant_roles SET enabled = $2 WHERE tenant = $1"

SET_LOGIN: Final = "SELECT format('ALTER ROLE %I %s', $1::text, $2::text)"

# The role's sessions on the whole server (its role is this database's only).
TERMINATE_SESSIONS: Final = """
SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid)) AS terminated
  FROM pg_stat_activity a WHERE a.usename = $1 AND a.pid <> pg_backend_pid()
"""

LIST_TENANTS: Final = f"""
SELECT m.role_name, m.tenant, m.enabled, m.created_at, m.rotated_at,
       coalesce(r.rolcanlogin, false) AS can_login,
       (SELECT count(*) FROM pg_stat_activity a WHERE a.usename = m.role_name) AS sessions
  FROM wal_tenant_roles m LEFT JOIN pg_roles r ON r.rolname = m.role_name
 ORDER BY m.tenant
 LIMIT {tenants_listed_max}
"""


class TenantRole(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's login role as ``wal_tenant_roles`` and ``pg_roles`` record it."""

    tenant: str
    role: str
    enabled: bool
    created_at: datetime
    rotated_at: datetime | None = None
    can_login: bool = True
    sessions: int = 0


class TenantCredentials(msgspec.Struct, frozen=True, kw_only=True):
    """What a tenant's engines need to connect: shown once, never stored by wal-engine."""

    tenant: str
    role: str
    password: str
    dsn: str
    """The administrator's DSN with this role and password (same server and database)."""


def tenant_role_name(database: str, tenant: str) -> str:
    """The login role of ``tenant`` in ``database``: opaque, and another in each database."""
    digest = hashlib.sha256(f"wal-engine/role/{database}/{validate_tenant(tenant)}".encode())
    return ROLE_PREFIX + digest.hexdigest()[:role_hash_digits]


def generate_password() -> str:
    """A fresh random password (256 bits, URL-safe characters)."""
    return secrets.token_urlsafe(generated_password_bytes)


def _check_password(password: str) -> str:
    if len(password) < password_length_min:
        raise InvalidInput(f"a tenant password needs at least {password_length_min} "
                           "characters")
    if not set(password) <= _PASSWORD_ALPHABET:
        # PostgreSQL normalises other characters (SASLprep) before hashing; printable
        # ASCII hashes the same here and there.
        raise InvalidInput("a tenant password must be printable ASCII without spaces")
    return password


def scram_verifier(password: str, *, salt: bytes | None = None,
                   iterations: int = scram_iterations) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802, 7677), as
    ``ALTER ROLE ... PASSWORD`` accepts it: the server never sees the password."""
    salt = secrets.token_bytes(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


async def _execute_formatted(connection: asyncpg.Connection, query: str, *args: object) -> None:
    """Run the utility statement ``query`` builds with format() (identifiers quoted)."""
    await connection.execute(await connection.fetchval(query, *args))


async def _require_security(connection: asyncpg.Connection, app_role: str) -> None:
    row = await connection.fetchrow(SECURITY_APPLIED, app_role)
    if not row["mapping"] or not row["app_group"]:
        raise ConfigurationError(
            f"security.sql is not applied to this database (no wal_tenant_roles or no "
            f"NOLOGIN group {app_role!r}): run wal_engine.store.setup.apply_security first "
            "(`wal-engine tenant create` does)")


async def _set_up_role(connection: asyncpg.Connection, role: str, password: str, *,
                       app_role: str, connection_limit: int, statement_timeout_ms: int,
                       idle_in_transaction_timeout_ms: int) -> None:
    """Attributes, password, defaults and memberships of a tenant's role, whatever the
    role had before."""
    await _execute_formatted(connection, ROLE_ATTRIBUTES, role, connection_limit,
                             scram_verifier(password))
    row = await connection.fetchrow(RESET_DEFAULTS, role, f"{statement_timeout_ms}ms",
                                    f"{idle_in_transaction_timeout_ms}ms")
    for statement in (row["everywhere"], row["here"], row["statement"], row["idle"]):
        await connection.execute(statement)
    for other in await connection.fetch(OTHER_MEMBERSHIPS, role, app_role):
        await _execute_formatted(connection, REVOKE_MEMBERSHIP, role, str(other["rolname"]))
    grants = await connection.fetchrow(GRANTS, role, app_role)
    await connection.execute(grants["membership"])
    await connection.execute(grants["connect"])


async def create_tenant(
    connection: asyncpg.Connection,
    tenant: str,
    *,
    dsn: str,
    password: str | None = None,
    role: str | None = None,
    app_role: str = APP_ROLE,
    connection_limit: int = connection_limit_default,
    statement_timeout_ms: int = limits.statement_timeout_ms,
    idle_in_transaction_timeout_ms: int = limits.idle_in_transaction_timeout_ms,
) -> TenantCredentials:
    """Create ``tenant``'s login role and map it to the tenant (one transaction).

    Args:
        connection: An administrator's connection to the engine database (superuser, or
            CREATEROLE and a member of the owner role), security.sql applied.
        tenant: The tenant id (``[A-Za-z0-9_.:-]``, 1 to 64).
        dsn: The administrator's DSN, to build the tenant's (``TenantCredentials.dsn``).
        password: The role's password (16+ printable ASCII characters); generated when
            None.
        role: The role's name; default :func:`tenant_role_name` of this database.
        app_role: The NOLOGIN group holding the runtime's privileges.
        connection_limit: Connections the role may hold at once (-1: no limit).
        statement_timeout_ms: The role's own ``statement_timeout`` default (engines send
            theirs at connection start anyway).
        idle_in_transaction_timeout_ms: Likewise for idle transactions.

    Raises:
        TenantExists: The tenant already has a role (rotate it instead).
        InvalidInput: A bad tenant id, password or limit.
    """
    tenant = validate_tenant(tenant)
    secret = generate_password() if password is None else _check_password(password)
    if connection_limit < -1 or statement_timeout_ms < 1 or idle_in_transaction_timeout_ms < 1:
        raise InvalidInput("connection_limit must be >= -1 and the timeouts >= 1 ms")
    await _require_security(connection, app_role)
    database = str(await connection.fetchval("SELECT current_database()"))
    name = tenant_role_name(database, tenant) if role is None else role
    async with connection.transaction():
        existing = await connection.fetchrow(READ_MAPPING, tenant)
        if existing is not None:
            raise TenantExists(tenant, str(existing["role_name"]))
        if not await connection.fetchval(ROLE_EXISTS, name):
            await _execute_formatted(connection, CREATE_ROLE, name)
        await _set_up_role(connection, name, secret, app_role=app_role,
                           connection_limit=connection_limit,
                           statement_timeout_ms=statement_timeout_ms,
                           idle_in_transaction_timeout_ms=idle_in_transaction_timeout_ms)
        await _execute_formatted(connection, TENANT_DEFAULT, name, tenant)
        await connection.execute(INSERT_MAPPING, name, tenant)
    return TenantCredentials(tenant=tenant, role=name, password=secret,
                             dsn=dsn_for_role(dsn, name, secret))


async def _mapping(connection: asyncpg.Connection, tenant: str) -> asyncpg.Record:
    row = await connection.fetchrow(READ_MAPPING, validate_tenant(tenant))
    if row is None:
        raise UnknownTenant(tenant)
    return row


async def rotate_tenant(
    connection: asyncpg.Connection,
    tenant: str,
    *,
    dsn: str,
    password: str | None = None,
    terminate: bool = False,
    app_role: str = APP_ROLE,
    connection_limit: int = connection_limit_default,
    statement_timeout_ms: int = limits.statement_timeout_ms,
    idle_in_transaction_timeout_ms: int = limits.idle_in_transaction_timeout_ms,
) -> TenantCredentials:
    """Give ``tenant``'s role a new password and reset its attributes, defaults and
    memberships (undoing any ``ALTER ROLE ... SET`` it made itself).

    Open sessions keep running unless ``terminate`` (after a leak: the holder of the old
    password may be connected); engines then reconnect with the new password.
    """
    row = await _mapping(connection, tenant)
    secret = generate_password() if password is None else _check_password(password)
    name = str(row["role_name"])
    async with connection.transaction():
        await _set_up_role(connection, name, secret, app_role=app_role,
                           connection_limit=connection_limit,
                           statement_timeout_ms=statement_timeout_ms,
                           idle_in_transaction_timeout_ms=idle_in_transaction_timeout_ms)
        await _execute_formatted(connection, TENANT_DEFAULT, name, str(row["tenant"]))
        await connection.execute(MARK_ROTATED, row["tenant"])
    if terminate:
        await connection.fetchval(TERMINATE_SESSIONS, name)
    return TenantCredentials(tenant=str(row["tenant"]), role=name, password=secret,
                             dsn=dsn_for_role(dsn, name, secret))


async def disable_tenant(connection: asyncpg.Connection, tenant: str) -> int:
    """Stop ``tenant``: its role may no longer log in, its open sessions see nothing from
    their next statement (the mapping is disabled) and are terminated. Its data stays.
    Returns the number of sessions terminated."""
    row = await _mapping(connection, tenant)
    async with connection.transaction():
        await connection.execute(SET_ENABLED, row["tenant"], False)
        await _execute_formatted(connection, SET_LOGIN, row["role_name"], "NOLOGIN")
    return int(await connection.fetchval(TERMINATE_SESSIONS, row["role_name"]))


async def enable_tenant(connection: asyncpg.Connection, tenant: str) -> None:
    """Let a disabled tenant's role log in and see its rows again (same password)."""
    row = await _mapping(connection, tenant)
    async with connection.transaction():
        await connection.execute(SET_ENABLED, row["tenant"], True)
        await _execute_formatted(connection, SET_LOGIN, row["role_name"], "LOGIN")


async def list_tenants(connection: asyncpg.Connection) -> list[TenantRole]:
    """Every tenant role of this database, by tenant, with its open sessions."""
    rows = await connection.fetch(LIST_TENANTS)
    return [TenantRole(tenant=r["tenant"], role=r["role_name"], enabled=r["enabled"],
                       created_at=r["created_at"], rotated_at=r["rotated_at"],
                       can_login=r["can_login"], sessions=int(r["sessions"]))
            for r in rows]
