"""``wal-engine setup``: schema plus least-privilege roles from the command line, the
application DSN it prints working as the application role, and ``migrate``'s hint."""

from __future__ import annotations

import base64
import urllib.parse

import asyncpg
import pytest

from tests.integration.test_cli_agents import cli, lines, one_error_line
from wal_engine.engine import connect
from wal_engine.errors import TenantRoleRefused
from wal_engine.security.roles import InsecureSetup, dsn_for_role
from wal_engine.security.tenants import scram_verifier
from wal_engine.store.connection import SCHEMA_VERSION

OWNER = "walt_setup_owner"
APP = "walt_setup_app"
STORED_PASSWORD = "SELECT rolpassword FROM pg_authid WHERE rolname = $1"


async def test_migrate_hints_setup_and_setup_makes_a_working_app_role(
        database_dsn: str) -> None:
    """A superuser's migrate names `wal-engine setup`; setup's DSN then runs commands as
    the application role, and the hint is gone."""
    (migrated,) = lines((await cli("migrate", "--dsn", database_dsn, "--json")).stdout)
    assert "wal-engine setup --dsn ADMIN_DSN" in migrated["next"]
    human = await cli("migrate", "--dsn", database_dsn)
    assert "next: no application role is set up" in human.stderr
    made = await cli("setup", "--dsn", database_dsn, "--owner-role", OWNER, "--app-role", APP,
                     "--json")
    assert made.exit_code == 0, made.output
    (result,) = lines(made.stdout)
    assert result["password_generated"] is True and result["schema_version"] == SCHEMA_VERSION
    assert result["tenant"] == "default" and result["role"].startswith("wal_")
    app_dsn = result["app_dsn"]
    assert app_dsn.startswith(f"postgresql://{result['role']}:") and app_dsn.endswith(
        database_dsn.rsplit("@", 1)[1])
    submitted = await cli("submit", "anything", "--input", "{}", "--dsn", app_dsn, "--json")
    assert submitted.exit_code == 0, submitted.output
    listed = lines((await cli("tasks", "--dsn", app_dsn, "--json")).stdout)
    assert [t["agent"] for t in listed] == ["anything"]
    connection = await asyncpg.connect(app_dsn)
    try:
        assert await connection.fetchval("SELECT current_user") == result["role"]
    finally:
        await connection.close()
    (again,) = lines((await cli("migrate", "--dsn", database_dsn, "--json")).stdout)
    assert again["next"] is None
    twice = await cli("setup", "--dsn", database_dsn, "--owner-role", OWNER, "--app-role", APP)
    assert twice.exit_code == 3 and "tenant rotate" in one_error_line(twice)


async def test_given_password_is_stored_as_postgres_own_scram_verifier(
        database_dsn: str) -> None:
    """The password given in WAL_ENGINE_APP_PASSWORD is in the printed DSN, and the
    verifier function matches PostgreSQL's for the same salt."""
    password = "pa55w0rd'-long-enough"
    made = await cli("setup", "--dsn", database_dsn, "--owner-role", OWNER, "--app-role", APP,
                     "--json", env={"WAL_ENGINE_APP_PASSWORD": password})
    assert made.exit_code == 0, made.output
    (result,) = lines(made.stdout)
    assert f":{urllib.parse.quote(password, safe='')}@" in result["app_dsn"]
    assert result["password_generated"] is False
    admin = await asyncpg.connect(database_dsn)
    try:
        assert (await admin.fetchval(STORED_PASSWORD, result["role"])).startswith(
            "SCRAM-SHA-256$4096:")
        await admin.execute(f'ALTER ROLE "{result["role"]}" PASSWORD \'reference pw\'')
        reference = await admin.fetchval(STORED_PASSWORD, result["role"])
    finally:
        await admin.close()
    iterations, rest = reference.removeprefix("SCRAM-SHA-256$").split(":", 1)
    salt = base64.b64decode(rest.split("$", 1)[0])
    assert scram_verifier("reference pw", salt=salt, iterations=int(iterations)) == reference


async def test_setup_refuses_bad_roles_and_non_superusers(database_dsn: str) -> None:
    """Equal role names are a usage error; a non-superuser DSN is refused by name."""
    same = await cli("setup", "--dsn", database_dsn, "--owner-role", "x", "--app-role", "x")
    assert same.exit_code == 2 and "must differ" in one_error_line(same)
    made = await cli("setup", "--dsn", database_dsn, "--owner-role", OWNER, "--app-role", APP,
                     "--password", "a-long-password-here", "--json")
    (result,) = lines(made.stdout)
    refused = await cli("setup", "--dsn", result["app_dsn"])
    assert refused.exit_code == 3
    assert f"role '{result['role']}' is not a superuser" in one_error_line(refused)
    assert "a-long-password-here" not in refused.output


def test_refusal_names_the_cli_flag_and_the_variable() -> None:
    """The security self-test's refusal says how to relax it from the CLI and the env."""
    message = str(InsecureSetup("postgres", ["it is a superuser"]))
    assert "--development" in message and "WAL_ENGINE_DEVELOPMENT=1" in message
    assert "wal-engine setup --dsn ADMIN_DSN" in message


async def test_a_role_without_the_engines_privileges_is_told_to_run_setup(
        database_dsn: str) -> None:
    """The first hour's symptom: schema migrated as a superuser, then a login role made by
    hand. connect() raises a typed error (not the driver's permission error) and the CLI
    says to run `wal-engine setup`."""
    role = "walt_handmade_" + database_dsn.rsplit("/", 1)[1][-12:]
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
    finally:
        await admin.close()
    dsn = dsn_for_role(database_dsn, role)
    try:
        with pytest.raises(TenantRoleRefused, match="wal-engine setup --dsn ADMIN_DSN") as raised:
            await connect(dsn, migrate=False)
        assert raised.value.role == role
        listed = await cli("tasks", "--dsn", dsn)
        assert listed.exit_code == 4
        assert "run `wal-engine setup --dsn ADMIN_DSN`" in one_error_line(listed)
    finally:
        admin = await asyncpg.connect(database_dsn)
        try:
            await admin.execute(f'DROP ROLE "{role}"')
        finally:
            await admin.close()
