"""``wal-engine setup``: the production roles from the command line, and what ``migrate``
says when they are missing.

``setup --dsn ADMIN_DSN`` connects as a superuser, applies the schema and ``security.sql``
(:func:`wal_engine.security.apply_security`: an owner role that cannot log in, an
application role that can only append), gives the application role a password (generated
unless given) and prints the DSN the application should use. The password is sent as a
SCRAM-SHA-256 verifier computed here, so the plain text never reaches the server (nor its
statement log).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any, Final

import asyncpg
import click

from wal_engine.cli.common import (
    EXIT_REFUSED,
    CliError,
    console,
    emit,
    json_option,
    run,
)
from wal_engine.security import (
    APP_ROLE,
    DEVELOPMENT_ENV,
    OWNER_ROLE,
    apply_security,
    dsn_for_role,
)

APP_PASSWORD_ENV: Final = "WAL_ENGINE_APP_PASSWORD"
scram_iterations: Final = 4096
"""PostgreSQL's default ``scram_iterations``."""
generated_password_bytes: Final = 24
role_name_max_chars: Final = 63
"""PostgreSQL's NAMEDATALEN - 1: a longer name would be truncated silently."""

IS_SUPERUSER: Final = (
    "SELECT current_user AS role, rolsuper FROM pg_roles WHERE rolname = current_user")

# The verifier is quoted by the server (format %L): ALTER ROLE takes no bind parameters.
SET_PASSWORD: Final = "SELECT format('ALTER ROLE %I WITH LOGIN PASSWORD %L', $1::text, $2::text)"

# Whether the log's table belongs to a role that can log in: then security.sql has not been
# applied (it hands every engine object to a NOLOGIN owner).
LOG_OWNER: Final = """
SELECT r.rolname AS owner, r.rolcanlogin AS can_login
  FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
 WHERE c.relname = 'wal_events' AND c.relnamespace = current_schema()::regnamespace
 LIMIT 1
"""

SETUP_HINT: Final = (
    "no application role is set up (the log belongs to role {owner}, which can log in): "
    "for production run `wal-engine setup --dsn ADMIN_DSN` as a superuser "
    "(docs/security.md); this role runs the engine only in development (the embedded "
    f"server, --development or {DEVELOPMENT_ENV}=1)")


def scram_verifier(password: str, *, salt: bytes | None = None,
                   iterations: int = scram_iterations) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677).

    The password is used as UTF-8 without SASLprep, as PostgreSQL itself does for a
    password that SASLprep would change.
    """
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _check_role_name(value: str, option: str) -> str:
    if not value or len(value) > role_name_max_chars:
        raise click.UsageError(f"{option} must be 1 to {role_name_max_chars} characters")
    return value


@click.command()
@click.option("--dsn", "admin_dsn", required=True, metavar="ADMIN_DSN",
              help="DSN of a superuser on the database to set up (used once, not kept).")
@click.option("--owner-role", default=OWNER_ROLE, show_default=True,
              help="The NOLOGIN role that owns every engine object.")
@click.option("--app-role", default=APP_ROLE, show_default=True,
              help="The login role the application and its workers connect as.")
@click.option("--password", envvar=APP_PASSWORD_ENV, default=None,
              help=f"The application role's password (default: {APP_PASSWORD_ENV}, else "
                   "a generated one, printed once).")
@json_option
def setup(admin_dsn: str, owner_role: str, app_role: str, password: str | None,
          as_json: bool) -> None:
    """Apply the schema and the least-privilege roles; print the application's DSN."""
    _check_role_name(owner_role, "--owner-role")
    _check_role_name(app_role, "--app-role")
    if owner_role == app_role:
        raise click.UsageError("--owner-role and --app-role must differ")
    generated = password is None
    secret = password if password is not None else secrets.token_urlsafe(
        generated_password_bytes)
    result = run(_setup(admin_dsn, owner_role, app_role, secret), dsn=admin_dsn)
    result["password_generated"] = generated
    if as_json:
        emit(result)
        return
    out = console()
    out.print(f"schema version {result['schema_version']}; owner role {owner_role} (NOLOGIN, "
              f"owns the log), application role {app_role} (LOGIN, appends only)")
    shown = " (generated; shown only now)" if generated else ""
    out.print(f"application DSN{shown}:", soft_wrap=True)
    out.print(f"  {result['app_dsn']}", soft_wrap=True)
    out.print("next: export WAL_ENGINE_DSN='<that DSN>' and run `wal-engine worker --agents "
              "module:register`; run `wal-engine setup` again after every upgrade",
              soft_wrap=True)


async def _setup(admin_dsn: str, owner_role: str, app_role: str,
                 password: str) -> dict[str, Any]:
    from wal_engine.store.connection import _connect_once, read_schema_version

    connection = await _connect_once(admin_dsn)
    try:
        row = await connection.fetchrow(IS_SUPERUSER)
        if row is None or not row["rolsuper"]:
            role = row["role"] if row is not None else "?"
            raise CliError(f"setup needs a superuser's DSN: role {role!r} is not a "
                           "superuser (it creates roles and hands the log to its owner)",
                           EXIT_REFUSED)
        await apply_security(connection, owner_role=owner_role, app_role=app_role)
        statement = await connection.fetchval(SET_PASSWORD, app_role,
                                              scram_verifier(password))
        await connection.execute(statement)
        version = await read_schema_version(connection)
    finally:
        await connection.close()
    return {"app_dsn": dsn_for_role(admin_dsn, app_role, password), "app_role": app_role,
            "owner_role": owner_role, "schema_version": version}


async def missing_roles_hint(connection: asyncpg.Connection) -> str | None:
    """What to run next after a migration on a database whose log still belongs to a login
    role (``security.sql`` not applied); None when the roles are set up."""
    row = await connection.fetchrow(LOG_OWNER)
    if row is None or not row["can_login"]:
        return None
    return SETUP_HINT.format(owner=row["owner"])
