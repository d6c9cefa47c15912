"""The settings every engine session sends and how role defaults are judged (issue 16)."""

from __future__ import annotations

import pytest

from wal_engine.security.roles import required_settings, weakened_defaults
from wal_engine.store.connection import dsn_requests_read_only, session_settings

REQUIRED = required_settings()


@pytest.mark.parametrize("item", [
    "statement_timeout=0", "statement_timeout=1h", "statement_timeout=31s",
    "statement_timeout=nonsense", "idle_in_transaction_session_timeout=0",
    "synchronous_commit=off", "synchronous_commit=local", "synchronous_commit=remote_write",
    "row_security=off", "row_security=false", "default_transaction_read_only=on",
    "default_transaction_read_only=true", "default_transaction_isolation=serializable",
    "Statement_Timeout=0",
])
def test_weakening_role_defaults_are_named(item: str) -> None:
    """A role default that turns a timeout off or longer, durability down, row security
    off, transactions read-only or another isolation level is reported."""
    assert weakened_defaults([item], REQUIRED) == [item.split("=", 1)[0].lower() + "="
                                                    + item.split("=", 1)[1]]


@pytest.mark.parametrize("item", [
    "statement_timeout=1ms", "statement_timeout=300ms", "statement_timeout=30s",
    "statement_timeout=30000", "idle_in_transaction_session_timeout=5s",
    "synchronous_commit=on", "synchronous_commit=remote_apply", "row_security=on",
    "default_transaction_read_only=off", "default_transaction_isolation=read committed",
    "work_mem=64kB", "search_path=public",
])
def test_harmless_or_stricter_role_defaults_pass(item: str) -> None:
    """Stricter timeouts (overridden at connection start anyway), the required values and
    settings the engine does not depend on are not weakening."""
    assert weakened_defaults([item], REQUIRED) == []


def test_session_settings_carry_the_required_settings_and_the_tenant() -> None:
    """The startup parameters: the tenant, the application name and every required
    setting; without synchronous commit required, the server's setting stays."""
    settings = session_settings("acme", "app")
    assert settings["wal.tenant"] == "acme" and settings["application_name"] == "app"
    assert {k: settings[k] for k in REQUIRED} == REQUIRED
    assert REQUIRED["statement_timeout"] == "30000" and REQUIRED["row_security"] == "on"
    relaxed = required_settings(synchronous_commit=False, read_only=True)
    assert "synchronous_commit" not in relaxed
    assert relaxed["default_transaction_read_only"] == "on"


def test_read_only_dsn_is_recognised() -> None:
    """A DSN asking for read-only transactions keeps them read-only."""
    assert dsn_requests_read_only("postgresql://u@h/d?default_transaction_read_only=on")
    assert not dsn_requests_read_only("postgresql://u@h/d?default_transaction_read_only=off")
    assert not dsn_requests_read_only("postgresql://u@h/d")


@pytest.mark.parametrize("dsn", ["postgresql://[::1", "postgresql://host:port/db"])
async def test_a_dsn_urllib_cannot_parse_is_a_typed_error(dsn: str) -> None:
    """connect() on a malformed DSN raises DatabaseUnavailable ("invalid DSN"), never the
    ValueError urllib raises inside asyncpg's parser."""
    from wal_engine import connect
    from wal_engine.errors import DatabaseUnavailable

    with pytest.raises(DatabaseUnavailable, match="invalid DSN"):
        await connect(dsn, development=True)
