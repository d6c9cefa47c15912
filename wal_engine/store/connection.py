"""Connections: DSN resolution, the pool, error translation, and the schema."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Final

import asyncpg

from wal_engine import limits
from wal_engine.dsn import Dsn
from wal_engine.dsn import redact_dsn as redact_dsn
from wal_engine.dsn import with_database as with_database
from wal_engine.errors import (
    AmbiguousCommit,
    ConfigurationError,
    ConnectionLost,
    CorruptionError,
    DatabaseUnavailable,
    InvalidDsn,
    SchemaMismatch,
    TaskQuotaExceeded,
    TenantRoleRefused,
    WalError,
)
from wal_engine.ids import DEFAULT_TENANT, validate_tenant
from wal_engine.observability.logs import capture_driver_logs, get_logger
from wal_engine.retries import STATEMENT_RETRY, retrying
from wal_engine.security.roles import RoleReport, enforce_runtime_role, required_settings
from wal_engine.store import pooler as poolers
from wal_engine.store import queries, sqlstate
from wal_engine.store.hosts import connect_any

log = get_logger(__name__)

SCHEMA_VERSION: Final = 5
"""The schema version this code reads and writes (``wal_schema_version``)."""

DSN_ENV: Final = "WAL_ENGINE_DSN"
TENANT_ENV: Final = "WAL_ENGINE_TENANT"
TENANT_SETTING: Final = "wal.tenant"
"""The setting every statement and row-security policy reads the tenant from."""
TASKS_MAX_SETTING: Final = "wal.tasks_max"
"""The engine's cap on its tenant's tasks, read by the counting trigger."""
EMBEDDED_DATABASE: Final = "wal_engine"

CONNECTION_ERRORS: Final = (
    ConnectionLost,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
    *sqlstate.CLIENT_DISCONNECTS,
)
"""Errors after which the outcome of a statement in flight is unknown: what
:class:`Database` raises for them (:class:`ConnectionLost`), and the raw driver errors of
code that holds a connection of its own."""

TRANSIENT_SQLSTATES: Final = sqlstate.TRANSIENT_SQLSTATES

UNAVAILABLE_ERRORS: Final = (*CONNECTION_ERRORS, DatabaseUnavailable, AmbiguousCommit)
"""Everything that says "the database is away" to a caller of the store: waited out,
never the agent's or the caller's failure."""


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says the database is away (``retry_if`` of the retry helper)."""
    return isinstance(error, UNAVAILABLE_ERRORS)


_REFUSED_LOGINS: Final = (asyncpg.exceptions.InvalidAuthorizationSpecificationError,
                          asyncpg.exceptions.InvalidCatalogNameError)
"""A wrong password, a role or database that does not exist: DatabaseUnavailable too, but
no outage that waiting ends."""


def is_outage(error: BaseException) -> bool:
    """Whether ``error`` says the database is away for now (refused, lost, unanswered,
    starting up, in recovery, failing over), so that waiting may end it: :func:`is_unavailable`
    less a login the server refused (a wrong password or database name)."""
    return is_unavailable(error) and not isinstance(error.__cause__, _REFUSED_LOGINS)


def drop_if_stuck(connection: Any, error: BaseException) -> bool:
    """Terminate a pooled ``connection`` that ``error`` left unusable, so that the pool
    opens a new one instead of handing it out again; True when nothing of the statement was
    sent. asyncpg raises ``InternalClientError`` ("cannot switch to state 12; another
    operation (2) is in progress") before sending anything when the server ended the
    session (``pg_terminate_backend``, a failover, a restart) while the connection was idle
    or between two statements: its protocol stays in that state until it is closed."""
    if not isinstance(error, asyncpg.exceptions.InternalClientError):
        return False
    with contextlib.suppress(Exception):
        connection.terminate()
    text = str(error)
    return text.startswith("cannot switch to state") or text == "not connected"


async def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN argument, else ``WAL_ENGINE_DSN``, else an embedded server started on demand."""
    if dsn:
        return dsn
    from_env = os.environ.get(DSN_ENV)
    if from_env:
        return from_env
    from wal_engine.embedded import ensure_embedded

    server_dsn = await ensure_embedded()
    await ensure_database(server_dsn, EMBEDDED_DATABASE)
    return with_database(server_dsn, EMBEDDED_DATABASE)


def resolve_tenant(tenant: str | None = None) -> str:
    """The tenant argument, else ``WAL_ENGINE_TENANT``, else ``"default"``; validated
    (:class:`~wal_engine.errors.InvalidTenant`)."""
    if tenant is None:
        tenant = os.environ.get(TENANT_ENV) or DEFAULT_TENANT
    return validate_tenant(tenant)


def requested_tenant(tenant: str | None = None) -> str | None:
    """The tenant argument, else ``WAL_ENGINE_TENANT``, validated; None when neither names
    one (a tenant role then serves the tenant it is mapped to)."""
    if tenant is None:
        tenant = os.environ.get(TENANT_ENV) or None
    return None if tenant is None else validate_tenant(tenant)


def session_settings(tenant: str, application_name: str, *,
                     tasks_max: int | None = None,
                     required: dict[str, str] | None = None) -> dict[str, str]:
    """The startup parameters of an engine connection: its tenant (and cap), bound for the
    session's life at no round trip (``docs/architecture.md``, decision 23), and the
    settings the engine depends on (``required``, default
    :func:`wal_engine.security.roles.required_settings`), which win over any role or database
    default (decision 35)."""
    settings = dict(required_settings() if required is None else required)
    settings.update({"application_name": application_name,
                     TENANT_SETTING: validate_tenant(tenant)})
    if tasks_max is not None:
        settings[TASKS_MAX_SETTING] = str(int(tasks_max))
    return settings


def dsn_requests_read_only(dsn: str) -> bool:
    """Whether the DSN asks for read-only transactions (``default_transaction_read_only=on``
    in its query, as ``wal-engine replay`` does): the engine then keeps them read-only."""
    try:
        return Dsn.parse(dsn).query_flag("default_transaction_read_only")
    except InvalidDsn:
        return False


async def ensure_database(server_dsn: str, database: str) -> None:
    """Create ``database`` on the server if it does not exist (embedded default only)."""
    connection = await _connect_once(server_dsn)
    try:
        exists = await connection.fetchval(
            "SELECT 1 FROM pg_database WHERE datname = $1", database
        )
        if not exists:
            try:
                # Identifiers cannot be parameters; the name is a constant of this module.
                await connection.execute(f'CREATE DATABASE "{database}"')
            except asyncpg.exceptions.DuplicateDatabaseError:
                pass  # Another process created it between the check and the create.
    finally:
        await connection.close()


async def connect_once(dsn: str, settings: Mapping[str, str] | None = None, *,
                       pooler: str | None = None) -> asyncpg.Connection:
    """One connection outside any pool (a dedicated session: sweep, LISTEN, renewals);
    every failure to open it is :class:`DatabaseUnavailable`. Through a ``pooler``
    (:mod:`wal_engine.store.pooler`) the settings it would refuse at start-up are set
    after connecting or carried by each transaction."""
    try:
        if pooler is None:
            return await connect_any(
                dsn, timeout=limits.connect_timeout_s,
                server_settings=None if settings is None else dict(settings))
        connection = await connect_any(dsn, timeout=limits.connect_timeout_s,
                                       **poolers.connection_options(pooler, settings or {}))
    except Exception as error:
        raise connect_failure(dsn, error) from error
    try:
        await poolers.apply_carried(connection, pooler, settings or {})
    except BaseException as error:
        connection.terminate()
        translated = connect_failure(dsn, error)
        if translated is error or not isinstance(error, Exception):
            raise
        raise translated from error
    return connection


_connect_once = connect_once  # The name the CLI modules import.


def connect_failure(dsn: str, error: BaseException) -> WalError | BaseException:
    """The typed error for a connection that could not be opened (nothing was sent), or
    ``error`` itself when it is no connection failure (a programming error)."""
    if isinstance(error, WalError):
        return error
    if isinstance(error, asyncpg.exceptions.InvalidCatalogNameError
                  | asyncpg.exceptions.InvalidAuthorizationSpecificationError):
        return DatabaseUnavailable(redact_dsn(dsn), str(error) or type(error).__name__)
    if isinstance(error, ValueError) and not isinstance(error, asyncpg.InterfaceError):
        # urllib's, from inside asyncpg's DSN parser ("Invalid IPv6 URL", a port that is
        # not a number): the same answer as the DSNs asyncpg itself calls invalid.
        return DatabaseUnavailable(redact_dsn(dsn), f"invalid DSN: {error}")
    translated = sqlstate.translate_failure(error, redact_dsn(dsn), sent=False)
    if translated is None:
        return error
    if isinstance(translated, DatabaseUnavailable):
        # A connection of its own that could not be opened: the answer it always had.
        return DatabaseUnavailable(translated.dsn_redacted, translated.reason)
    return translated


def schema_sql() -> str:
    """The text of ``schema.sql`` (packaged in the wheel, or at the repository root)."""
    packaged = resources.files("wal_engine").joinpath("schema.sql")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    source_tree = Path(__file__).resolve().parents[2] / "schema.sql"
    return source_tree.read_text(encoding="utf-8")


async def apply_schema(connection: asyncpg.Connection, *, force: bool = False) -> bool:
    """Apply ``schema.sql`` in one transaction, serialised by an advisory lock (idempotent).

    Skipped when the same text was already applied (its checksum is recorded), so that a
    connecting worker takes no table locks. When the DDL does run on a live database, it
    first locks every engine table in one fixed order: replacing a trigger locks its table,
    and taking those locks one by one against running appends could deadlock. Returns
    whether the DDL ran.
    """
    text = schema_sql()
    checksum = hashlib.sha256(text.encode()).hexdigest()
    async with connection.transaction():
        # The owner's business: not bound by the engine session's statement_timeout (an
        # index rebuilt under the lock may take longer).
        await connection.execute(queries.MIGRATION_TIMEOUTS)
        await connection.execute(queries.SCHEMA_LOCK)
        if not force and await _schema_current(connection, checksum):
            return False
        found = await read_schema_version(connection)
        if found is not None and found > SCHEMA_VERSION:
            # A newer engine migrated this database: applying this older text would put
            # back functions the newer one replaced (while both versions' workers run).
            raise SchemaMismatch(found, SCHEMA_VERSION)
        if await connection.fetchval(queries.SCHEMA_PRESENT):
            await connection.execute(queries.LOCK_ENGINE_TABLES)
        await connection.execute(text)
        await connection.execute(queries.RECORD_SCHEMA_CHECKSUM, SCHEMA_VERSION, checksum)
    return True


def schema_checksum() -> str:
    """The sha256 (hex) of ``schema.sql``, recorded when it is applied."""
    return hashlib.sha256(schema_sql().encode()).hexdigest()


async def _schema_current(connection: asyncpg.Connection, checksum: str) -> bool:
    if not await connection.fetchval(queries.SCHEMA_PRESENT):
        return False
    if not await connection.fetchval(queries.SCHEMA_HAS_CHECKSUM):
        return False
    recorded = await connection.fetchval(queries.SCHEMA_CHECKSUM, SCHEMA_VERSION)
    return bool(recorded == checksum)


async def read_schema_version(connection: asyncpg.Connection) -> int | None:
    """The newest applied schema version, or None when the schema is missing."""
    if not await connection.fetchval(queries.SCHEMA_PRESENT):
        return None
    version = await connection.fetchval(queries.SCHEMA_VERSION)
    return None if version is None else int(version)


async def _release_connection(connection: asyncpg.Connection) -> None:
    """What a pooled connection needs on release: only a rollback of an abandoned transaction.

    asyncpg's default reset runs ``RESET ALL; UNLISTEN *; CLOSE ALL; ...`` on every release:
    a second round trip for every statement. The engine leaves no session state on pooled
    connections (LISTEN and heartbeats use dedicated connections, settings are transaction-
    local; the tenant is a startup parameter, which ``RESET ALL`` would keep anyway), so that
    reset buys nothing; code handed a pooled connection (``ctx.transaction``) must likewise
    use ``SET LOCAL``, never ``SET``.
    """
    if connection.is_in_transaction():
        await connection.execute("ROLLBACK")


class Database:
    """A pool plus the error translation every statement goes through."""

    def __init__(self, pool: asyncpg.Pool, dsn: str, *, tenant: str = DEFAULT_TENANT,
                 tasks_max: int | None = None,
                 required: dict[str, str] | None = None, pooler: str | None = None,
                 listen_dsn: str | None = None, role_carries: bool = False) -> None:
        self.pool = pool
        self.dsn = dsn
        self.dsn_redacted = redact_dsn(dsn)
        self.tenant = validate_tenant(tenant)
        """The one tenant every connection of this database is bound to."""
        self.tasks_max = tasks_max
        """The engine's cap on the tenant's tasks (None: only the administrator's)."""
        self.required = required_settings() if required is None else dict(required)
        """The settings every connection sends at its start (decision 35)."""
        self.pooler = pooler
        """``"transaction"``, ``"session"`` or None (:mod:`wal_engine.store.pooler`)."""
        self.listen_dsn = listen_dsn
        """A direct DSN for LISTEN (through a transaction pooler), or None."""
        self.role_carries = role_carries
        """Through a transaction pooler: the login role's own defaults carry the tenant
        and the required settings, so transactions need not."""

    def session_settings(self, application_name: str) -> dict[str, str]:
        """Startup parameters for another connection of this database (same tenant); only
        the application name when the login role carries the rest through a transaction
        pooler."""
        if self.role_carries:
            return {"application_name": application_name}
        return session_settings(self.tenant, application_name, tasks_max=self.tasks_max,
                                required=self.required)

    @property
    def listens(self) -> bool:
        """Whether a worker can LISTEN (directly, through a session pooler, or on
        ``listen_dsn``); through a transaction pooler without one it polls."""
        return self.pooler != poolers.TRANSACTION or self.listen_dsn is not None

    async def connect_session(self, application_name: str, *,
                              listen: bool = False) -> asyncpg.Connection:
        """A dedicated session of this database (sweep, LISTEN, renewals); LISTEN goes to
        ``listen_dsn`` when there is one."""
        if listen and self.listen_dsn is not None:
            return await connect_once(self.listen_dsn, session_settings(
                self.tenant, application_name, tasks_max=self.tasks_max,
                required=self.required))
        return await connect_once(self.dsn, self.session_settings(application_name),
                                  pooler=self.pooler)

    @classmethod
    async def open(
        cls,
        dsn: str | None = None,
        *,
        min_size: int = limits.pool_size_min,
        max_size: int = limits.pool_size_max,
        migrate: bool = True,
        application_name: str = "wal-engine:pool",
        require_synchronous_commit: bool = True,
        statement_timeout_ms: int = limits.statement_timeout_ms,
        development: bool | None = None,
        tenant: str | None = None,
        tasks_max: int | None = None,
        pooler: str | None = None,
        listen_dsn: str | None = None,
    ) -> Database:
        """Resolve the DSN, open a pool, run the security self-test, apply or check the
        schema, check durability.

        The self-test (:mod:`wal_engine.security.roles`) refuses a superuser, a BYPASSRLS role or
        an owner of the log unless ``development`` is true; None decides from the setup
        (the embedded server and ``WAL_ENGINE_DEVELOPMENT=1`` are development setups).
        Every connection is bound to ``tenant`` by a startup parameter, and sends the
        settings the engine depends on (:func:`wal_engine.security.roles.required_settings`).
        A tenant's own login role (:mod:`wal_engine.security.tenants`) serves the tenant it is
        mapped to: ``tenant`` (default ``WAL_ENGINE_TENANT``) may only repeat it. Other
        roles serve ``tenant`` (default ``"default"``); a role that is neither mapped nor
        able to take the owner's rights would see nothing and is refused. Only a role that
        could take the owner's rights migrates; ``tasks_max`` caps the tenant's tasks.
        ``pooler`` (default ``WAL_ENGINE_POOLER``) and ``listen_dsn`` (default
        ``WAL_ENGINE_LISTEN_DSN``): see :mod:`wal_engine.store.pooler`.
        """
        capture_driver_logs()
        requested = requested_tenant(tenant)
        pooler = poolers.resolve_pooler(pooler)
        listen_dsn = poolers.resolve_listen_dsn(listen_dsn)
        if tasks_max is not None and tasks_max < 0:
            raise ConfigurationError("tasks_max must be >= 0")
        embedded_dsn = not dsn and not os.environ.get(DSN_ENV)
        resolved = await resolve_dsn(dsn)
        if statement_timeout_ms < 1:
            raise ConfigurationError("statement_timeout_ms must be at least 1")
        required = required_settings(synchronous_commit=require_synchronous_commit,
                                     read_only=dsn_requests_read_only(resolved),
                                     statement_timeout_ms=statement_timeout_ms)
        first = await connect_once(resolved, session_settings(
            requested or DEFAULT_TENANT, application_name, tasks_max=tasks_max,
            required=required), pooler=pooler)
        role_carries = False
        try:
            report = await enforce_runtime_role(
                first, development=development, embedded_dsn=embedded_dsn,
                require_synchronous_commit=False, required=required)
            try:
                chosen = await _tenant_of_role(first, report, requested)
                await _prepare_database(first, resolved, migrate, report.may_administer,
                                        require_synchronous_commit)
                if pooler == poolers.TRANSACTION:
                    role_carries = await poolers.role_carries(
                        first, report, chosen, tasks_max, required)
            except asyncpg.InsufficientPrivilegeError as error:
                raise TenantRoleRefused(report.role, no_privileges(report.role, error)
                                        ) from error
        except (asyncpg.PostgresError, *CONNECTION_ERRORS) as error:
            # The checks' own statements (self-test, tenant, schema version) run on a bare
            # connection: refused or cut, they are the engine's errors, not the driver's.
            raise _open_failure(resolved, error) from error
        finally:
            await first.close()
        settings = ({"application_name": application_name} if role_carries else
                    session_settings(chosen, application_name, tasks_max=tasks_max,
                                     required=required))
        try:
            pool = await asyncpg.create_pool(
                resolved,
                connect=connect_any,  # Each host of a multi-host DSN on its own timeout.
                min_size=min_size,
                max_size=max_size,
                timeout=limits.connect_timeout_s,
                command_timeout=limits.command_timeout_s,
                reset=_release_connection,
                **poolers.pool_options(pooler, settings),
            )
        except Exception as error:
            raise connect_failure(resolved, error) from error
        assert pool is not None
        return cls(pool, resolved, tenant=chosen, tasks_max=tasks_max, required=required,
                   pooler=pooler, listen_dsn=listen_dsn, role_carries=role_carries)

    async def close(self) -> None:
        """Close the pool (waits for connections in use to be released)."""
        await self.pool.close()

    async def fetch(self, query: str, *args: Any, task_id: str | None = None,
                    fresh: bool = False, connection: asyncpg.Connection | None = None
                    ) -> list[Any]:
        """Run ``query`` on a pooled connection; engine errors come back typed.

        ``fresh`` uses a new connection outside the pool (used to resolve an ambiguous
        commit after the pooled connection broke); ``connection`` runs it on the caller's
        connection, inside the caller's transaction.
        """
        attempts = 1

        def count(error: BaseException, attempt: int, delay_s: float) -> None:
            nonlocal attempts
            attempts = attempt + 1
            log.info("statement_retried", sqlstate=getattr(error, "sqlstate", None),
                     attempt=attempt, delay_s=round(delay_s, 3))

        try:
            return await retrying(
                STATEMENT_RETRY,
                lambda: self._fetch_once(query, args, task_id, fresh, connection),
                # Rolled back whole: outside a caller's transaction it may simply run again.
                retry_if=sqlstate.is_transient if connection is None else _never,
                key=task_id or "", on_retry=count)
        except asyncpg.PostgresError as error:
            if not sqlstate.is_transient(error):
                raise sqlstate.typed(error, task_id) from error
            # Rolled back whole on every attempt (or inside the caller's transaction).
            raise DatabaseUnavailable(
                self.dsn_redacted, f"SQLSTATE {error.sqlstate} (attempt {attempts}): "
                                   f"{error}") from error

    async def _fetch_once(self, query: str, args: tuple[Any, ...], task_id: str | None,
                          fresh: bool, connection: asyncpg.Connection | None) -> list[Any]:
        sent = connection is not None
        try:
            if connection is not None:
                return list(await connection.fetch(query, *args))
            if fresh:
                own = await connect_once(self.dsn, self.session_settings("wal-engine:resolve"),
                                         pooler=self.pooler)
                try:
                    sent = True
                    return list(await own.fetch(query, *args))
                finally:
                    await own.close()
            async with self.pool.acquire() as pooled:
                sent = True
                try:
                    return list(await pooled.fetch(query, *args))
                except asyncpg.exceptions.InternalClientError as stuck:
                    sent = not drop_if_stuck(pooled, stuck)
                    raise
        except Exception as error:
            translated = self.translate(error, task_id, sent=sent)
            if translated is error:
                raise
            raise translated from error

    def translate(self, error: Exception, task_id: str | None = None, *,
                  sent: bool = True) -> Exception:
        """The typed error for a driver error raised by a statement of this database (the
        one place, through :func:`wal_engine.store.sqlstate.translate_failure`), else
        ``error`` itself (a transient SQLSTATE, or no driver's error); a SQLSTATE the
        engine has no error of its own for is :class:`~wal_engine.errors.DatabaseError`. A
        disconnect is :class:`ConnectionLost`, whose ``sent`` says whether a statement may
        be in flight."""
        if isinstance(error, OverflowError):
            # A stored value this client cannot represent (a timestamp in the year 20000,
            # -infinity) planted outside the engine: a typed error, not a crash of the
            # reader (RELIABILITY.md B8).
            return CorruptionError(f"a stored value is out of range: {error}")
        translated = sqlstate.translate_failure(error, self.dsn_redacted, task_id=task_id,
                                                sent=sent)
        if translated is None:
            return error
        if isinstance(translated, TaskQuotaExceeded):
            return TaskQuotaExceeded(self.tenant, translated.tasks_max)
        return translated

    @contextlib.asynccontextmanager
    async def acquire(self, task_id: str | None = None) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection whose driver errors (in the block too) come back typed, as
        from :meth:`fetch`: use it instead of ``pool.acquire()``."""
        sent = False
        try:
            async with self.pool.acquire() as connection:
                sent = True
                try:
                    yield connection
                except asyncpg.exceptions.InternalClientError as stuck:
                    drop_if_stuck(connection, stuck)
                    raise
        except Exception as error:
            translated = self.translate(error, task_id, sent=sent)
            if translated is error:
                raise
            raise translated from error

    async def fetchrow(self, query: str, *args: Any, task_id: str | None = None) -> Any:
        """Like :meth:`fetch` for at most one row."""
        rows = await self.fetch(query, *args, task_id=task_id)
        return rows[0] if rows else None


def no_privileges(role: str, error: BaseException) -> str:
    """Why a role that PostgreSQL refuses the engine's tables cannot run the engine, and
    what to run (a role made by hand, or a database migrated without ``security.sql``)."""
    return (f"role {role!r} lacks the engine's privileges on this database ({error}): the "
            "schema was applied without its roles, or this role is not one `wal-engine "
            "setup` made; run `wal-engine setup --dsn ADMIN_DSN` as a superuser and connect "
            "with the DSN it prints (docs/security.md)")


def _open_failure(dsn: str, error: BaseException) -> BaseException:
    """The typed error for a statement of ``Database.open``'s first session: a refused
    one is its own error or :class:`DatabaseError`, a lost connection or a transient
    SQLSTATE (nothing was changed) :class:`DatabaseUnavailable`."""
    translated = connect_failure(dsn, error)
    if translated is not error:
        return translated
    return DatabaseUnavailable(redact_dsn(dsn), f"{type(error).__name__}: {error}")


def _never(_error: BaseException) -> bool:
    return False


async def _tenant_of_role(connection: asyncpg.Connection, report: RoleReport,
                          requested: str | None) -> str:
    """The tenant this engine serves: the one its login role is mapped to, else (for a
    role that may name its tenant by the setting) the requested one or ``"default"``."""
    mapped = None
    if await connection.fetchval(queries.TENANT_ROLES_PRESENT):
        mapped = await connection.fetchrow(queries.TENANT_OF_ROLE)
    if mapped is None:
        if report.may_administer or report.bypassrls:
            return requested or DEFAULT_TENANT
        raise TenantRoleRefused(
            report.role, f"role {report.role!r} is not the login role of a tenant of this "
            "database, so row security shows it nothing: connect as a tenant's role "
            "(`wal-engine tenant create TENANT`, docs/security.md)")
    tenant = str(mapped["tenant"])
    if not mapped["enabled"]:
        raise TenantRoleRefused(
            report.role, f"tenant {tenant!r} is disabled (`wal-engine tenant enable`)")
    if requested is not None and requested != tenant:
        raise TenantRoleRefused(
            report.role, f"role {report.role!r} is the login role of tenant {tenant!r}, "
            f"not of {requested!r}")
    return tenant


async def _prepare_database(
    connection: asyncpg.Connection, dsn: str, migrate: bool, may_migrate: bool,
    require_synchronous_commit: bool
) -> None:
    if migrate and may_migrate:
        try:
            await apply_schema(connection)
        except asyncpg.PostgresError as error:
            if error.sqlstate not in TRANSIENT_SQLSTATES:
                raise
            raise DatabaseUnavailable(
                redact_dsn(dsn),
                f"the schema could not be applied (SQLSTATE {error.sqlstate}: {error}); a "
                "session holding a lock on the engine tables delays migrations") from error
    elif migrate and not await _schema_current(connection, schema_checksum()):
        # A runtime role never takes the schema lock nor runs DDL (the owner's business):
        # it runs on the schema version it finds, checked below.
        log.info("schema_not_applied", reason="the role may not migrate; run "
                 "`wal-engine migrate` as the owner")
    found = await read_schema_version(connection)
    if found != SCHEMA_VERSION:
        raise SchemaMismatch(found, SCHEMA_VERSION)
    if require_synchronous_commit:
        setting = await connection.fetchval(queries.SYNCHRONOUS_COMMIT)
        if setting == "off":
            raise ConfigurationError(
                "synchronous_commit is off: acknowledged appends could be lost in a crash "
                "(RELIABILITY.md P15); turn it on or pass require_synchronous_commit=False"
            )
