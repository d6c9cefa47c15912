"""The parsed DSN type: hostile DSNs parse, render back to the same fields, and their
redacted form shows no secret (password, ``?password=``, ``?sslpassword=``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wal_engine.dsn import Dsn, redact_dsn, with_database
from wal_engine.errors import ConfigurationError, InvalidDsn
from wal_engine.store.connection import dsn_requests_read_only

SECRET = "s3cr3t-Zq"

HOSTILE = [
    f"postgresql://user:{SECRET}@db.example:5432/app",
    f"postgresql://user@db.example/app?password={SECRET}",
    f"postgresql://user@db.example/app?sslmode=require&sslpassword={SECRET}&password={SECRET}",
    f"postgres://user:{SECRET}%40x%3Ay%2Fz%3Fq%23r@h/app",  # encoded @ : / ? #
    f"postgresql://user:{SECRET}@x@h/app",  # a raw @ in the password: masked whole
    f"postgresql://user:{SECRET}:more@h/app",  # a raw : in the password
    f"postgresql://üser:{SECRET}ä@hóst.example/dätabase",
    f"postgresql://user:{SECRET}@[::1]:5433,[fe80::1%25eth0],h2:6000/app",
    f"postgresql://user:{SECRET}@%2Fvar%2Frun%2Fpostgresql/app",
    f"postgresql:///app?host=/var/run/postgresql&password={SECRET}",
    f"postgresql://user:{SECRET}@h1,h2,h3/app?target_session_attrs=read-write",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_redacted_form_shows_no_secret(text: str) -> None:
    """No secret of a hostile DSN appears in its redacted form, nor in str() of the type."""
    parsed = Dsn.parse(text)
    assert SECRET in "".join(parsed.secrets())
    assert SECRET not in redact_dsn(text)
    assert SECRET not in str(parsed) and SECRET not in repr(parsed.redacted())
    assert "***" in redact_dsn(text)


@pytest.mark.parametrize("text", HOSTILE)
def test_render_reads_back_to_the_same_fields(text: str) -> None:
    """A rendered DSN parses back to exactly the fields it was rendered from."""
    parsed = Dsn.parse(text)
    assert Dsn.parse(parsed.render()) == parsed


def test_fields_of_a_multi_host_dsn() -> None:
    """Hosts, ports (one per host), user, password, database and query are all decoded."""
    parsed = Dsn.parse("postgresql://u%20x:p%40w@[::1]:5433,h2,%2Ftmp%2Fsock:7/d%C3%A4?a=1&a=2")
    assert parsed.hosts == ("::1", "h2", "/tmp/sock")
    assert parsed.ports == (5433, None, 7)
    assert (parsed.user, parsed.password, parsed.database) == ("u x", "p@w", "dä")
    assert parsed.query_value("a") == "2"


def test_empty_password_is_kept_and_not_masked() -> None:
    """An empty password stays empty (nothing to hide) and renders the same."""
    parsed = Dsn.parse("postgresql://user:@h/d")
    assert parsed.password == ""
    assert parsed.secrets() == ()
    assert parsed.redacted() == "postgresql://user:@h/d"


def test_with_database_keeps_everything_else() -> None:
    """with_database changes only the database, on multi-host DSNs and query strings too."""
    text = f"postgresql://u:{SECRET}@h1:1,h2:2/old?sslmode=require"
    moved = Dsn.parse(with_database(text, "new/ db"))
    assert moved == Dsn.parse(text).with_database("new/ db")
    assert (moved.database, moved.hosts, moved.password) == ("new/ db", ("h1", "h2"), SECRET)


def test_with_query_replaces_every_earlier_value() -> None:
    """with_query leaves one value of the key; dsn_requests_read_only reads the last one."""
    text = "postgresql://h/d?default_transaction_read_only=off&x=1"
    dsn = Dsn.parse(text).with_query("default_transaction_read_only", "on")
    assert dsn.query == (("x", "1"), ("default_transaction_read_only", "on"))
    assert dsn_requests_read_only(dsn.render())
    assert not dsn_requests_read_only(text)


@pytest.mark.parametrize("text", [
    f"mysql://u:{SECRET}@h/d",
    f"postgresql://u:{SECRET}#frag@h/d",  # a raw '#'
    f"postgresql://u:{SECRET}/x@h/d",  # a raw '/' in the password: port is not a number
    f"postgresql://u:12/{SECRET}@h/d",  # a raw '/' giving a database with '@'
    "postgresql://h:99999/d",
    "postgresql://h:\uff15\uff14\uff13\uff12/d",  # fullwidth (non-ASCII) digits
    "postgresql://[::1/d",
    "postgresql://h/d?novalue",
    "postgresql://h/%ff",
])
def test_unreadable_dsns_are_refused_without_echoing(text: str) -> None:
    """A DSN that cannot be read without guessing is InvalidDsn (a ConfigurationError),
    whose message holds no part of it; redact_dsn then prints a placeholder."""
    with pytest.raises(InvalidDsn) as caught:
        Dsn.parse(text)
    assert isinstance(caught.value, ConfigurationError)
    assert SECRET not in str(caught.value)
    assert redact_dsn(text) == "<unparseable dsn>"


_component = st.text(st.characters(codec="utf-8"), max_size=12)


@given(user=_component, password=_component, database=_component.filter(bool),
       value=_component, port=st.none() | st.integers(1, 65535))
def test_any_components_round_trip(user: str, password: str, database: str, value: str,
                                   port: int | None) -> None:
    """Any text in any component renders to a DSN that parses back to it, and the redacted
    form masks any non-empty password."""
    dsn = Dsn(hosts=("h",), ports=(port,), user=user or None, password=password,
              database=database, query=(("application_name", value),))
    assert Dsn.parse(dsn.render()) == dsn
    if password:
        assert Dsn.parse(dsn.redacted()).password == "***"
