"""Running through a connection pooler (PgBouncer 1.18) in session or transaction mode.

``connect(..., pooler=)`` (default ``WAL_ENGINE_POOLER``) says what sits between the engine
and PostgreSQL; ``docs/pgbouncer.md`` is the operator's page, decision 66 of
``docs/architecture.md`` the reasons. What changes:

* **Startup parameters.** PgBouncer 1.18 keeps only a few per client (``application_name``,
  ``client_encoding``, ``DateStyle``, ``TimeZone``, ``standard_conforming_strings``) and
  refuses a connection that sends any other. Through a pooler the engine sends only those;
  the rest of its session settings (the tenant, its cap, the required settings of decision
  35) travel otherwise:

  - ``session``: a client keeps its server connection for its life, so they are set once
    per connection (``set_config(..., false)``, one round trip at connect); PgBouncer's
    ``server_reset_query`` (``DISCARD ALL``) drops them when the client goes.
  - ``transaction``: consecutive transactions of one client may run on different server
    connections, and another client's transactions on the one this client used, so no
    session state may be set (it would leak to, or be overwritten by, another engine,
    perhaps of another tenant). The settings are carried **by each transaction**
    (``set_config(..., true)`` sent with its ``BEGIN``, one simple query; a statement
    outside a transaction is wrapped in one), unless the login role carries them itself
    (``ALTER ROLE ... SET``): a tenant's role made by ``wal-engine tenant create`` does, so
    its statements carry nothing and an append stays one round trip and one commit.
    Tenancy does not rest on the setting: row security keys on the login role
    (``session_user``; PgBouncer keeps one pool per user), so a setting left behind on a
    shared server connection could only narrow a tenant role's view, never widen it.

* **Prepared statements** (transaction mode). 1.18 has no protocol-level prepared statement
  support (1.21 added it), so asyncpg's named statement cache is off
  (``statement_cache_size=0``). asyncpg would then describe every statement before running
  it (two round trips); :class:`TransactionPooledConnection` keeps each statement's
  description per connection and sends ``Parse/Bind/Execute/Sync`` together, one round trip
  that does not depend on which server connection answers.

* **LISTEN** needs a session of its own on the server: in transaction mode it is opened on
  ``listen_dsn`` (a direct DSN), and without one the worker polls (said once in its log).

Advisory locks, temporary tables and ``pg_backend_pid()`` are not used by the runtime; the
two transaction-scoped advisory locks (schema migration, LangGraph setup) hold within one
transaction, which a transaction pooler keeps on one server connection.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping
from typing import Any, Final

import asyncpg
from asyncpg.transaction import TransactionState

from wal_engine.errors import ConfigurationError
from wal_engine.observability.logs import get_logger
from wal_engine.security.roles import SESSION_SETTINGS, RoleReport, weakened_defaults

log = get_logger(__name__)

POOLER_ENV: Final = "WAL_ENGINE_POOLER"
LISTEN_DSN_ENV: Final = "WAL_ENGINE_LISTEN_DSN"
SESSION: Final = "session"
TRANSACTION: Final = "transaction"
POOLERS: Final = (SESSION, TRANSACTION)
TRACKED_PARAMETERS: Final = frozenset({
    "application_name", "client_encoding", "datestyle", "timezone",
    "standard_conforming_strings"})
"""The startup parameters PgBouncer 1.18 keeps per client (any other is refused)."""
described_statements_max: Final = 256
"""Statement descriptions a transaction-pooled connection keeps (the engine has ~150)."""


def resolve_pooler(pooler: str | None) -> str | None:
    """The ``pooler`` argument, else ``WAL_ENGINE_POOLER``; None (or ``""``/``"none"``):
    a direct connection. Anything else is a :class:`ConfigurationError`."""
    if pooler is None:
        pooler = os.environ.get(POOLER_ENV) or None
    if pooler is None or pooler.lower() in ("", "none"):
        return None
    if pooler.lower() not in POOLERS:
        raise ConfigurationError(
            f"pooler must be 'transaction', 'session' or None, not {pooler!r}")
    return pooler.lower()


def resolve_listen_dsn(listen_dsn: str | None) -> str | None:
    """The ``listen_dsn`` argument, else ``WAL_ENGINE_LISTEN_DSN``, else None."""
    return listen_dsn or os.environ.get(LISTEN_DSN_ENV) or None


def startup_parameters(settings: Mapping[str, str], pooler: str | None) -> dict[str, str]:
    """What to send in the startup packet: everything directly, only what the pooler
    keeps through one."""
    if pooler is None:
        return dict(settings)
    return {name: value for name, value in settings.items()
            if name.lower() in TRACKED_PARAMETERS}


def carried_settings(settings: Mapping[str, str], pooler: str | None) -> dict[str, str]:
    """The settings a pooler would not keep from the startup packet."""
    if pooler is None:
        return {}
    return {name: value for name, value in settings.items()
            if name.lower() not in TRACKED_PARAMETERS}


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def set_config_sql(settings: Mapping[str, str], *, local: bool) -> str | None:
    """One ``SELECT set_config(...), ...`` (simple-query text: names and values quoted as
    literals) setting ``settings`` for the transaction (``local``) or the session; None
    when there is nothing to set."""
    if not settings:
        return None
    flag = "true" if local else "false"
    calls = ", ".join(f"set_config({_literal(name)}, {_literal(value)}, {flag})"
                      for name, value in settings.items())
    return f"SELECT {calls}"


_TRANSACTION_ENDS: Final = ("COMMIT", "ROLLBACK", "RELEASE", "END", "ABORT")


class TransactionPooledConnection(asyncpg.Connection):  # type: ignore[misc]
    """An asyncpg connection for a transaction pooler (``connection_class=``).

    * Each statement is one round trip: asyncpg's statement cache is off (no named
      statements), and this class keeps the description of each unnamed statement, which
      asyncpg re-parses with every execution (``Parse/Bind/Execute/Sync`` in one write).
    * ``carried`` (``set_config(..., true)`` calls) is sent with every ``BEGIN``; a
      statement outside a transaction runs in one made for it (a simple query without
      arguments gets it prepended instead: one implicit transaction, one round trip).
    """

    # The overrides keep asyncpg's signatures (its ``timeout`` parameters: ASYNC109).
    _wal_carried: str | None = None
    _wal_described: collections.OrderedDict[str, Any] | None = None

    def carry(self, carried: str | None) -> None:
        """Send ``carried`` (SQL) at the start of every transaction of this connection."""
        self._wal_carried = carried

    async def _get_statement(self, query: str, timeout: Any, *,  # noqa: ASYNC109
                             named: Any = False, use_cache: bool = True,
                             ignore_custom_codec: bool = False,
                             record_class: Any = None) -> Any:
        # asyncpg 0.32's one path to a statement (fetch*, execute with arguments,
        # executemany, cursors). An unnamed statement's state is marked unprepared when the
        # statement cache is off, so every bind_execute re-sends its Parse: reusing the
        # state skips only the describe round trip. Checked by tests/integration/
        # test_pgbouncer.py (round trips per append).
        plain = (named is False and use_cache and record_class is None
                 and not ignore_custom_codec)
        described = self._wal_described
        if plain and described is not None:
            state = described.get(query)
            if state is not None and not state.closed:
                described.move_to_end(query)
                return state
        state = await super()._get_statement(
            query, timeout, named=named, use_cache=use_cache,
            ignore_custom_codec=ignore_custom_codec, record_class=record_class)
        if plain and not state.name and not state.prepared:
            if described is None:
                described = self._wal_described = collections.OrderedDict()
            described[query] = state
            if len(described) > described_statements_max:
                described.popitem(last=False)
        return state

    def _drop_local_statement_cache(self) -> None:
        self._wal_described = None
        super()._drop_local_statement_cache()

    async def _own_transaction(self) -> bool:
        """Whether a transaction the caller opened (asyncpg's ``transaction()``, started)
        is in progress: statements then join it. A transaction open on the server that
        no one holds is rolled back first: a ``BEGIN`` whose caller was cancelled while it
        ran leaves one (asyncpg's ``start()`` raised, so no ``__aexit__`` ends it), and a
        statement that joined it would be acknowledged and never committed (the W7 fault
        test found appends lost that way on the group commit's kept connection). It holds
        nothing of anyone's: only the BEGIN and its settings."""
        top: Any = getattr(self, "_top_xact", None)
        if top is not None and top._state is TransactionState.STARTED:
            return True
        if top is not None and top._state is not TransactionState.NEW:
            self._top_xact = None  # A start or an end that failed or was cancelled.
        if self._top_xact is None and self.is_in_transaction():
            log.warning("pooled_connection_transaction_abandoned_rolled_back")
            await super().execute("ROLLBACK")
        return False

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:  # noqa: ASYNC109
        carried = self._wal_carried
        if carried is None or (not args and query.lstrip()[:8].upper().startswith(
                _TRANSACTION_ENDS)):
            # asyncpg's commit and rollback clear _top_xact before they send theirs.
            return str(await super().execute(query, *args, timeout=timeout))
        top: Any = self._top_xact
        if not args and top is not None and top._state is TransactionState.NEW:
            # asyncpg's Transaction.start() sending its BEGIN or SAVEPOINT.
            if top._nested:
                return str(await super().execute(query, timeout=timeout))
            if self.is_in_transaction():
                log.warning("pooled_connection_transaction_abandoned_rolled_back")
                await super().execute("ROLLBACK")
            return str(await super().execute(f"{query.rstrip().rstrip(';')}; {carried}",
                                             timeout=timeout))
        if await self._own_transaction():
            return str(await super().execute(query, *args, timeout=timeout))
        if not args:
            # One simple query is one implicit transaction: set, then run.
            return str(await super().execute(f"{carried}; {query}", timeout=timeout))
        async with self.transaction():
            return str(await super().execute(query, *args, timeout=timeout))

    async def fetch(self, query: str, *args: Any, timeout: float | None = None,  # noqa: ASYNC109
                    record_class: Any = None) -> list[Any]:
        if self._wal_carried is None or await self._own_transaction():
            return list(await super().fetch(query, *args, timeout=timeout,
                                            record_class=record_class))
        async with self.transaction():
            return list(await super().fetch(query, *args, timeout=timeout,
                                            record_class=record_class))

    async def fetchrow(self, query: str, *args: Any, timeout: float | None = None,  # noqa: ASYNC109
                       record_class: Any = None) -> Any:
        if self._wal_carried is None or await self._own_transaction():
            return await super().fetchrow(query, *args, timeout=timeout,
                                          record_class=record_class)
        async with self.transaction():
            return await super().fetchrow(query, *args, timeout=timeout,
                                          record_class=record_class)

    async def fetchval(self, query: str, *args: Any, column: int = 0,
                       timeout: float | None = None) -> Any:  # noqa: ASYNC109
        if self._wal_carried is None or await self._own_transaction():
            return await super().fetchval(query, *args, column=column, timeout=timeout)
        async with self.transaction():
            return await super().fetchval(query, *args, column=column, timeout=timeout)

    async def executemany(self, command: str, args: Any, *,
                          timeout: float | None = None) -> None:  # noqa: ASYNC109
        if self._wal_carried is None or await self._own_transaction():
            await super().executemany(command, args, timeout=timeout)
            return
        async with self.transaction():
            await super().executemany(command, args, timeout=timeout)


def connection_options(pooler: str | None, settings: Mapping[str, str]) -> dict[str, Any]:
    """The options of ``asyncpg.connect``/``create_pool`` for ``pooler``: the startup
    parameters and, in transaction mode, the connection class with no statement cache."""
    options: dict[str, Any] = {"server_settings": startup_parameters(settings, pooler)}
    if pooler == TRANSACTION:
        options["statement_cache_size"] = 0
        options["connection_class"] = TransactionPooledConnection
    return options


def pool_options(pooler: str | None, settings: Mapping[str, str]) -> dict[str, Any]:
    """The options of ``asyncpg.create_pool`` for ``pooler``: :func:`connection_options`
    and, through a pooler, the ``init`` that applies what the startup packet cannot."""
    if pooler is None:
        return {"server_settings": dict(settings)}
    options = connection_options(pooler, settings)
    fixed = dict(settings)

    async def init(connection: asyncpg.Connection) -> None:
        await apply_carried(connection, pooler, fixed)

    options["init"] = init
    return options


async def apply_carried(connection: asyncpg.Connection, pooler: str | None,
                        settings: Mapping[str, str]) -> None:
    """After connecting: set what the startup packet could not carry, for the session
    (session mode: one round trip), or for each transaction of the connection (transaction
    mode: no round trip now)."""
    carried = carried_settings(settings, pooler)
    if pooler == SESSION:
        statement = set_config_sql(carried, local=False)
        if statement is not None:
            await connection.execute(statement)
    elif pooler == TRANSACTION:
        connection.carry(set_config_sql(carried, local=True))


ROLE_TENANT: Final = "SELECT current_setting('wal.tenant', true) AS tenant"


async def role_carries(connection: asyncpg.Connection, report: RoleReport, tenant: str,
                       tasks_max: int | None, required: Mapping[str, str]) -> bool:
    """Through a transaction pooler: whether the login role's own defaults carry the tenant
    and the required settings (a tenant's role made or rotated by ``wal-engine tenant``),
    so that transactions need carry nothing; said in the log when they must."""
    if report.may_administer or report.bypassrls:
        # It names its tenant by the setting, which only each transaction can carry.
        return False
    missing: list[str] = []
    previous = getattr(connection, "_wal_carried", None)
    connection.carry(None)  # What a transaction that sends nothing finds.
    try:
        found = await connection.fetchval(ROLE_TENANT)
        rows = await connection.fetch(SESSION_SETTINGS, list(required))
    finally:
        connection.carry(previous)
    if found != tenant:
        missing.append(f"wal.tenant is {found!r}, not {tenant!r}")
    actual = [f"{row['name']}={row['setting']}" for row in rows]
    missing += weakened_defaults(actual, dict(required))
    missing += [f"{name} is unset" for name in required
                if name not in {row["name"] for row in rows}]
    if tasks_max is not None:
        missing.append("tasks_max (the engine's cap) is a setting of the engine")
    if missing:
        log.info("pooler_settings_carried_per_transaction", role=report.role,
                 reason="; ".join(missing),
                 fix="`wal-engine tenant rotate TENANT` sets the tenant as the role's "
                     "default; set the others with ALTER ROLE ... SET (docs/pgbouncer.md)")
        return False
    return True
