"""The one parsed form of a PostgreSQL connection URL: parse once, render, redact.

A DSN is parsed the way asyncpg reads it (``postgresql://user:password@host:port,.../db?k=v``;
hosts may be IPv6 literals in brackets or percent-encoded unix socket directories), except
that the user information ends at the *last* ``@`` of the authority, so that a password
holding a raw ``@`` is masked whole. Rendering percent-encodes every component, so a
rendered DSN is unambiguous whatever the text it came from. Text that cannot be read without
guessing (a raw ``#``, or a raw ``/`` or ``@`` in the database name, which is what a password
with an unencoded ``/`` or ``?`` produces) is refused with :class:`InvalidDsn`, never read
half-way: a half-read DSN could print part of a password.

This module is pure (no I/O, no asyncpg).
"""

from __future__ import annotations

import urllib.parse
from typing import Final

import msgspec

from wal_engine.errors import InvalidDsn

SCHEMES: Final = ("postgresql", "postgres")
MASK: Final = "***"
SECRET_QUERY_KEYS: Final = frozenset({"password", "sslpassword"})
"""Query parameters that carry a secret (masked by :meth:`Dsn.redacted`)."""
TRUE_VALUES: Final = frozenset({"on", "true", "yes", "1"})


class Dsn(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed connection URL; every field is decoded (no percent-encoding left).

    Attributes:
        scheme: ``postgresql`` or ``postgres``.
        hosts: One entry per host of a multi-host DSN; a unix socket directory starts with
            ``/``; empty when the DSN names no host.
        ports: One entry per host (None where that host names no port).
        user: The user, or None.
        password: The password, or None when the DSN has none (``""`` when it is empty).
        database: The database, or None.
        query: The query parameters, in order (a key may repeat, the last one wins).
    """

    scheme: str = "postgresql"
    hosts: tuple[str, ...] = ()
    ports: tuple[int | None, ...] = ()
    user: str | None = None
    password: str | None = None
    database: str | None = None
    query: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if len(self.ports) != len(self.hosts):
            raise InvalidDsn("a DSN needs one port entry (or None) per host")

    @classmethod
    def parse(cls, text: str) -> Dsn:
        """Parse ``text``; raises :class:`InvalidDsn` (the message never holds the text)."""
        scheme, separator, rest = text.partition("://")
        if not separator or scheme.lower() not in SCHEMES:
            raise InvalidDsn('the scheme must be "postgresql://" or "postgres://"')
        if "#" in rest:
            raise InvalidDsn("a raw '#' (percent-encode it as %23)")
        authority, path, query_text = _split_rest(rest)
        user, password, hostspec = _split_authority(authority)
        hosts, ports = _parse_hosts(hostspec)
        return cls(scheme=scheme.lower(), hosts=hosts, ports=ports, user=user,
                   password=password, database=_parse_database(path),
                   query=_parse_query(query_text))

    # ------------------------------------------------------------------ reading

    def query_value(self, key: str) -> str | None:
        """The last value of query parameter ``key``, or None."""
        values = [value for name, value in self.query if name == key]
        return values[-1] if values else None

    def query_flag(self, key: str) -> bool:
        """Whether query parameter ``key`` is set to a true value (on, true, yes, 1)."""
        value = self.query_value(key)
        return value is not None and value.strip().lower() in TRUE_VALUES

    def secrets(self) -> tuple[str, ...]:
        """Every non-empty secret the DSN holds (its password, secret query parameters)."""
        found = [self.password or ""]
        found += [value for key, value in self.query if key in SECRET_QUERY_KEYS]
        return tuple(secret for secret in found if secret)

    # ------------------------------------------------------------------ deriving

    def with_database(self, database: str) -> Dsn:
        """The same server and credentials, another database."""
        return msgspec.structs.replace(self, database=database)

    def with_query(self, key: str, value: str) -> Dsn:
        """``key`` set to ``value`` (every earlier value of ``key`` dropped)."""
        kept = tuple((name, old) for name, old in self.query if name != key)
        return msgspec.structs.replace(self, query=(*kept, (key, value)))

    # ------------------------------------------------------------------ rendering

    def render(self) -> str:
        """The DSN as a URL asyncpg reads back to the same fields."""
        return self._render(mask=False)

    def redacted(self) -> str:
        """The DSN with its password and secret query parameters masked, safe to print."""
        return self._render(mask=True)

    def __str__(self) -> str:
        # Printing a Dsn never shows a secret; render() is the explicit way to get one.
        return self.redacted()

    def _render(self, *, mask: bool) -> str:
        userinfo = ""
        if self.user is not None or self.password is not None:
            userinfo = _quote(self.user or "")
            if self.password is not None:
                shown = MASK if mask and self.password else _quote(self.password)
                userinfo += f":{shown}"
            userinfo += "@"
        hosts = ",".join(_render_host(host, port)
                         for host, port in zip(self.hosts, self.ports, strict=True))
        path = "" if self.database is None else "/" + _quote(self.database)
        query = "&".join(
            f"{_quote(key)}={MASK if mask and key in SECRET_QUERY_KEYS else _quote(value)}"
            for key, value in self.query)
        return f"{self.scheme}://{userinfo}{hosts}{path}{'?' + query if query else ''}"


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _split_rest(rest: str) -> tuple[str, str, str]:
    """(authority, path, query) of the text after ``scheme://``."""
    end = len(rest)
    for mark in "/?":
        index = rest.find(mark)
        if index != -1:
            end = min(end, index)
    authority, remainder = rest[:end], rest[end:]
    path, _, query_text = remainder.partition("?")
    return authority, path, query_text


def _split_authority(authority: str) -> tuple[str | None, str | None, str]:
    """(user, password, hostspec); the user information ends at the last ``@``."""
    if "@" not in authority:
        return None, None, authority
    userinfo, _, hostspec = authority.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return _unquote(user) or None, _unquote(password) if colon else None, hostspec


def _unquote(text: str) -> str:
    try:
        return urllib.parse.unquote(text, errors="strict")
    except UnicodeDecodeError as error:
        raise InvalidDsn("a percent-encoded component that is not UTF-8") from error


def _render_host(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else _quote(host)
    return shown if port is None else f"{shown}:{port}"


def _parse_hosts(hostspec: str) -> tuple[tuple[str, ...], tuple[int | None, ...]]:
    if not hostspec:
        return (), ()
    hosts: list[str] = []
    ports: list[int | None] = []
    for entry in hostspec.split(","):
        host, port = _parse_host(entry)
        hosts.append(host)
        ports.append(port)
    return tuple(hosts), tuple(ports)


def _parse_host(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):
        host, bracket, after = entry[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise InvalidDsn("an IPv6 host must be written [address] or [address]:port")
        return host, _parse_port(after[1:]) if after else None
    host, colon, port_text = entry.partition(":")
    return _unquote(host), _parse_port(port_text) if colon else None


def _parse_port(text: str) -> int | None:
    if text == "":
        return None
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 65536:
        raise InvalidDsn("a port must be a number from 1 to 65535")
    return int(text)


def _parse_database(path: str) -> str | None:
    if not path:
        return None
    name = path[1:]
    if "/" in name or "@" in name:
        raise InvalidDsn("a raw '/' or '@' after the host (percent-encode it: %2F, %40)")
    return _unquote(name) if name else None


def _parse_query(text: str) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    try:
        pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=True,
                                       errors="strict")
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidDsn("a query that is not key=value pairs joined by '&'") from error
    return tuple(pairs)


def redact_dsn(dsn: str) -> str:
    """``dsn`` with its secrets masked, safe to print (a placeholder if it does not parse)."""
    try:
        return Dsn.parse(dsn).redacted()
    except InvalidDsn:
        return "<unparseable dsn>"


def with_database(dsn: str, database: str) -> str:
    """The same server DSN pointing at another database."""
    return Dsn.parse(dsn).with_database(database).render()
