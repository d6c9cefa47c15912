"""``wal-engine setup``: the production roles from the command line, and what ``migrate``
says when they are missing.

``setup --dsn ADMIN_DSN`` connects as a superuser, applies the schema and ``security.sql``
(:func:`wal_engine.store.setup.apply_security`: an owner role and an application group that
cannot log in, the group only able to append), then creates the tenant's login role in
that group (:func:`wal_engine.security.tenants.create_tenant`, the role ``wal-engine tenant create``
makes) with a given or generated password, and prints the DSN the application should use.
The password reaches the server only as a SCRAM-SHA-256 verifier.
"""

from __future__ import annotations

from typing import Any, Final

import asyncpg
import click

from wal_engine.cli.common import (
    EXIT_REFUSED,
    CliError,
    console,
    current_tenant,
    emit,
    json_option,
    run,
)
from wal_engine.security.roles import APP_ROLE, DEVELOPMENT_ENV, OWNER_ROLE
from wal_engine.store.setup import apply_security

APP_PASSWORD_ENV: Final = "WAL_ENGINE_APP_PASSWORD"
role_name_max_chars: Final = 63
"""PostgreSQL's NAMEDATALEN - 1: a longer name would be truncated silently."""

IS_SUPERUSER: Final = (
    "SELECT current_user AS role, rolsuper FROM pg_roles WHERE rolname = current_user")

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
              help="The NOLOGIN group holding the runtime's privileges.")
@click.option("--role", "login_role", default=None,
              help="The tenant's login role (default: wal_ and a hash of database and "
                   "tenant, as `wal-engine tenant create`).")
@click.option("--password", envvar=APP_PASSWORD_ENV, default=None,
              help=f"The login role's password, 16+ characters (default: {APP_PASSWORD_ENV}, "
                   "else a generated one, printed once).")
@json_option
def setup(admin_dsn: str, owner_role: str, app_role: str, login_role: str | None,
          password: str | None, as_json: bool) -> None:
    """Apply the schema, the least-privilege roles and the tenant's login role; print the
    application's DSN (``wal-engine --tenant T setup`` for tenant T)."""
    _check_role_name(owner_role, "--owner-role")
    _check_role_name(app_role, "--app-role")
    if owner_role == app_role:
        raise click.UsageError("--owner-role and --app-role must differ")
    tenant = current_tenant() or "default"
    result = run(_setup(admin_dsn, owner_role, app_role, tenant, login_role, password),
                 dsn=admin_dsn)
    result["password_generated"] = password is None
    if as_json:
        emit(result)
        return
    out = console()
    out.print(f"schema version {result['schema_version']}; owner role {owner_role} and "
              f"application group {app_role} (NOLOGIN); tenant {tenant!r} logs in as "
              f"{result['role']}", soft_wrap=True, markup=False)
    shown = " (generated; shown only now)" if password is None else ""
    out.print(f"application DSN{shown}:", soft_wrap=True)
    out.print(f"  {result['app_dsn']}", soft_wrap=True, markup=False)
    out.print("next: export WAL_ENGINE_DSN='<that DSN>' and run `wal-engine worker --agents "
              "module:register`; run `wal-engine setup` again after every upgrade (an "
              "existing tenant role is kept: `wal-engine tenant rotate` changes its password)",
              soft_wrap=True, markup=False)


async def _setup(admin_dsn: str, owner_role: str, app_role: str, tenant: str,
                 login_role: str | None, password: str | None) -> dict[str, Any]:
    from wal_engine.security.tenants import TenantExists, create_tenant
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
        try:
            credentials = await create_tenant(connection, tenant, dsn=admin_dsn,
                                              password=password, role=login_role,
                                              app_role=app_role)
        except TenantExists as error:
            raise CliError(f"the schema and roles are up to date; tenant {error.tenant!r} "
                           f"already has role {error.role!r}: `wal-engine --tenant {tenant} "
                           "tenant rotate` gives it a new password", EXIT_REFUSED) from error
        version = await read_schema_version(connection)
    finally:
        await connection.close()
    return {"app_dsn": credentials.dsn, "role": credentials.role, "tenant": tenant,
            "app_role": app_role, "owner_role": owner_role, "schema_version": version}


async def missing_roles_hint(connection: asyncpg.Connection) -> str | None:
    """What to run next after a migration on a database whose log still belongs to a login
    role (``security.sql`` not applied); None when the roles are set up."""
    row = await connection.fetchrow(LOG_OWNER)
    if row is None or not row["can_login"]:
        return None
    return SETUP_HINT.format(owner=row["owner"])
