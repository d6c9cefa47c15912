"""``wal-engine tenant create|list|rotate|disable|enable``: the owner's side of tenant
roles (:mod:`wal_engine.security.tenants`).

These commands run on an administrator's DSN (``--dsn``: a superuser, or CREATEROLE and a
member of the owner role), never on a tenant's. ``create`` and ``rotate`` print the
tenant's role, password and DSN once: wal-engine keeps only the SCRAM verifier. A password
given with ``--password-stdin`` is read from the first line of standard input.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg
import click
from rich.markup import escape
from rich.table import Table

from wal_engine.cli.common import console, dsn_option, emit, json_option, run
from wal_engine.cli.render import record_json
from wal_engine.security import tenants
from wal_engine.security.tenants import TenantCredentials

F = TypeVar("F", bound=Callable[..., Any])


@asynccontextmanager
async def _admin(dsn: str | None) -> AsyncIterator[tuple[asyncpg.Connection, str]]:
    from wal_engine.store.connection import _connect_once, resolve_dsn

    resolved = await resolve_dsn(dsn)
    connection = await _connect_once(resolved)
    try:
        yield connection, resolved
    finally:
        await connection.close()


def _password_option(function: F) -> F:
    return click.option(
        "--password-stdin", is_flag=True,
        help="Read the password from standard input (default: generate one).")(function)


def _read_password(from_stdin: bool) -> str | None:
    return sys.stdin.readline().rstrip("\r\n") if from_stdin else None


def _show_credentials(credentials: TenantCredentials, as_json: bool, verb: str) -> None:
    if as_json:
        emit(record_json(credentials))
        return
    out = console()
    out.print(f"tenant {escape(credentials.tenant)} {verb}: role {escape(credentials.role)}")
    out.print(f"password: {escape(credentials.password)}")
    out.print(f"dsn: {escape(credentials.dsn)}")
    out.print("(shown once: wal-engine keeps only the SCRAM verifier)")


@click.group()
def tenant() -> None:
    """Tenant roles: each tenant's engines log in as a role of their own."""


@tenant.command("create")
@click.argument("name", metavar="TENANT")
@dsn_option
@_password_option
@click.option("--role", default=None, metavar="ROLE",
              help="The role's name (default: wal_ and a hash of database and tenant).")
@click.option("--connection-limit", type=int, default=tenants.connection_limit_default,
              show_default=True, help="Connections the role may hold at once (-1: none).")
@json_option
def create(name: str, dsn: str | None, password_stdin: bool, role: str | None,
           connection_limit: int, as_json: bool) -> None:
    """Create TENANT's login role (applies security.sql first, idempotently)."""
    password = _read_password(password_stdin)

    async def _create() -> TenantCredentials:
        from wal_engine.store.setup import apply_security

        async with _admin(dsn) as (connection, resolved):
            await apply_security(connection, migrate=True)
            return await tenants.create_tenant(connection, name, dsn=resolved,
                                               password=password, role=role,
                                               connection_limit=connection_limit)

    _show_credentials(run(_create(), dsn=dsn), as_json, "created")


@tenant.command("rotate")
@click.argument("name", metavar="TENANT")
@dsn_option
@_password_option
@click.option("--terminate", is_flag=True,
              help="Also end the role's open sessions (after a leaked password).")
@click.option("--connection-limit", type=int, default=tenants.connection_limit_default,
              show_default=True, help="Connections the role may hold at once (-1: none).")
@json_option
def rotate(name: str, dsn: str | None, password_stdin: bool, terminate: bool,
           connection_limit: int, as_json: bool) -> None:
    """Give TENANT's role a new password and reset its own defaults."""
    password = _read_password(password_stdin)

    async def _rotate() -> TenantCredentials:
        async with _admin(dsn) as (connection, resolved):
            return await tenants.rotate_tenant(connection, name, dsn=resolved,
                                               password=password, terminate=terminate,
                                               connection_limit=connection_limit)

    _show_credentials(run(_rotate(), dsn=dsn), as_json, "rotated")


@tenant.command("disable")
@click.argument("name", metavar="TENANT")
@dsn_option
@json_option
def disable(name: str, dsn: str | None, as_json: bool) -> None:
    """Stop TENANT: no more logins, open sessions see nothing and are ended."""
    async def _disable() -> int:
        async with _admin(dsn) as (connection, _resolved):
            return await tenants.disable_tenant(connection, name)

    terminated = run(_disable(), dsn=dsn)
    if as_json:
        emit({"tenant": name, "enabled": False, "sessions_terminated": terminated})
        return
    console().print(f"tenant {escape(name)} disabled ({terminated} sessions ended)")


@tenant.command("enable")
@click.argument("name", metavar="TENANT")
@dsn_option
@json_option
def enable(name: str, dsn: str | None, as_json: bool) -> None:
    """Let a disabled TENANT log in again (same password)."""
    async def _enable() -> None:
        async with _admin(dsn) as (connection, _resolved):
            await tenants.enable_tenant(connection, name)

    run(_enable(), dsn=dsn)
    if as_json:
        emit({"tenant": name, "enabled": True})
        return
    console().print(f"tenant {escape(name)} enabled")


@tenant.command("list")
@dsn_option
@json_option
def list_command(dsn: str | None, as_json: bool) -> None:
    """The tenant roles of this database."""
    async def _list() -> list[tenants.TenantRole]:
        async with _admin(dsn) as (connection, _resolved):
            return await tenants.list_tenants(connection)

    found = run(_list(), dsn=dsn)
    if as_json:
        for item in found:
            emit(record_json(item))
        return
    table = Table("tenant", "role", "enabled", "sessions", "created", "rotated")
    for item in found:
        table.add_row(escape(item.tenant), item.role, "yes" if item.enabled else "no",
                      str(item.sessions), f"{item.created_at:%Y-%m-%d %H:%M}",
                      "" if item.rotated_at is None else f"{item.rotated_at:%Y-%m-%d %H:%M}")
    console().print(table)
