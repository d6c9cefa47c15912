"""What every ``wal-engine`` command shares: options, the error contract, output, progress.

The error contract: an error is one line on standard error (``error: ...``) and a non-zero
exit code, never a traceback. The codes:

====  ==================================================================================
0     success
1     a finding: ``verify`` found a broken chain, ``replay`` a non-determinism, or the log
      cannot be read (corruption)
2     bad usage: an unknown option, bad JSON, an invalid input or budget
3     refused: unknown task, a task id taken by another submission, a finished task
4     the database: unreachable (the DSN is named without its password), no wal-engine
      schema or another version of it, or a configuration the engine refuses (a role the
      security self-test refuses, a missing optional package)
70    an internal error (a bug: please report it; ``WAL_ENGINE_DEBUG=1`` prints its traceback)
130   interrupted
====  ==================================================================================
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar

import asyncpg
import click
import orjson
from rich.console import Console

from wal_engine.dsn import Dsn
from wal_engine.errors import (
    ConfigurationError,
    CorruptionError,
    DatabaseError,
    DatabaseUnavailable,
    InvalidDsn,
    InvalidInput,
    ReplicaUnavailable,
    SchemaMismatch,
    WalError,
)
from wal_engine.observability.logs import configure_logging
from wal_engine.security.roles import DEVELOPMENT_ENV
from wal_engine.store.connection import DSN_ENV, TENANT_ENV, redact_dsn, resolve_tenant

if TYPE_CHECKING:
    from wal_engine.engine import Engine

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

EXIT_FINDING: Final = 1
EXIT_USAGE: Final = 2
EXIT_REFUSED: Final = 3
EXIT_DATABASE: Final = 4
EXIT_INTERNAL: Final = 70
EXIT_INTERRUPTED: Final = 130

piped_width_chars: Final = 160
"""Width of human output written to a pipe or file (a terminal's own width otherwise)."""

cli_pool_size_max: Final = 4

DEBUG_ENV: Final = "WAL_ENGINE_DEBUG"
"""Set to print the traceback of an internal error (a bug) before its one-line report."""

DEVELOPMENT_META: Final = "wal_engine.development"
"""Key of the click context's ``meta`` that ``--development`` sets."""


class CliError(Exception):
    """An error the CLI reports as one line with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# ----------------------------------------------------------------------------- options


def dsn_option(function: F) -> F:
    """``--dsn``: the database (default ``WAL_ENGINE_DSN``, else the embedded server)."""
    return click.option(
        "--dsn", envvar=DSN_ENV, default=None, metavar="DSN",
        help=f"PostgreSQL DSN (default: {DSN_ENV}, else the embedded server).",
    )(function)


def development_option(function: F) -> F:
    """``--development``: a refusal of the security self-test is only logged (a superuser
    DSN on a laptop).

    Without it the engine decides from the setup, as :func:`wal_engine.engine.connect`
    does: the embedded server and ``WAL_ENGINE_DEVELOPMENT=1`` are development setups;
    any other role that could rewrite the log (superuser, BYPASSRLS, owner) is refused.
    """
    return click.option(
        "--development", is_flag=True, expose_value=False, callback=_remember_development,
        help="Development setup: run even as a superuser or owner of the log (default: "
             f"only on the embedded server or with {DEVELOPMENT_ENV}=1).",
    )(function)


def _remember_development(context: click.Context, _parameter: click.Parameter,
                          value: bool) -> bool:
    if value:
        context.meta[DEVELOPMENT_META] = True
    return value


def development_requested() -> bool | None:
    """True when the running command was given ``--development``; otherwise None, so the
    engine decides from the setup (never False: the flag only relaxes, nothing tightens)."""
    context = click.get_current_context(silent=True)
    return True if context is not None and context.meta.get(DEVELOPMENT_META) else None


def _check_tenant(_context: click.Context, _parameter: click.Parameter,
                  value: str | None) -> str | None:
    try:
        return None if value is None else resolve_tenant(value)
    except InvalidInput as error:
        raise click.BadParameter(str(error)) from error


def tenant_option(function: F) -> F:
    """``--tenant`` (on the command group): the tenant whose tasks every command sees."""
    return click.option(
        "--tenant", envvar=TENANT_ENV, default=None, metavar="TENANT",
        callback=_check_tenant,
        help=f"The tenant to work on (default: {TENANT_ENV}, else 'default').",
    )(function)


def current_tenant() -> str | None:
    """The ``--tenant`` given to the command group, if any."""
    context = click.get_current_context(silent=True)
    if context is None:
        return None
    tenant = context.find_root().params.get("tenant")
    return tenant if isinstance(tenant, str) else None


_json_errors = False
"""Whether errors are reported as JSON (the command was given ``--json``)."""


def _remember_json(_context: click.Context, _parameter: click.Parameter, value: bool) -> bool:
    global _json_errors
    if value:
        _json_errors = True
    return value


def json_option(function: F) -> F:
    """``--json``: one JSON object per line on standard output, for scripts; an error is
    then one JSON object on standard error too (``{"error": ..., "exit_code": ...}``)."""
    return click.option("--json", "as_json", is_flag=True, callback=_remember_json,
                        help="One JSON object per line (stable keys), for scripts; errors "
                             "as JSON on standard error.")(function)


def parse_json(text: str, what: str) -> Any:
    """Parse a JSON argument; a bad one is a usage error naming the option."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise CliError(f"{what} is not valid JSON: {error}", EXIT_USAGE) from error


# ----------------------------------------------------------------------------- running


def run(coroutine: Coroutine[Any, Any, T], *, dsn: str | None = None,
        log_level: str = "warning") -> T:
    """Run a command's coroutine under the error contract (see the module docstring)."""
    try:
        configure_logging(default_level=log_level)
        return asyncio.run(coroutine)
    except CliError as error:
        fail(error.message, error.code, dsn)
    except click.ClickException:
        raise
    except KeyboardInterrupt:
        fail("interrupted", EXIT_INTERRUPTED, dsn)
    except BrokenPipeError:
        _quiet_stdout()
        raise SystemExit(EXIT_FINDING) from None
    except WalError as error:
        fail(*describe_error(error), dsn)
    except asyncpg.PostgresError as error:
        fail(f"database error: {type(error).__name__}: {error}", EXIT_DATABASE, dsn)
    except (OSError, asyncpg.InterfaceError) as error:
        fail(f"database error: {type(error).__name__}: {error}", EXIT_DATABASE, dsn)
    except Exception as error:
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        fail(f"internal error: {type(error).__name__}: {error} (set {DEBUG_ENV}=1 for the "
             "traceback)", EXIT_INTERNAL, dsn)
    finally:
        coroutine.close()  # A coroutine never started (configuration failed) must not warn.


def describe_error(error: WalError) -> tuple[str, int]:
    """The line and exit code for an error the engine raised on purpose."""
    from wal_engine.errors import (
        ForkPointInvalid,
        TaskAlreadyExists,
        UnknownTask,
    )

    if isinstance(error, SchemaMismatch):
        if error.found is not None and error.found > error.expected:
            hint = "upgrade wal-engine to use this database"
        else:
            hint = ("run `wal-engine setup --dsn ADMIN_DSN` (production roles), or "
                    "`wal-engine migrate` (development)")
        return f"{error}; {hint}", EXIT_DATABASE
    if isinstance(error, DatabaseUnavailable | DatabaseError | ConfigurationError):
        return str(error), EXIT_DATABASE
    if isinstance(error, CorruptionError):
        return f"the log cannot be read: {error}", EXIT_FINDING
    if isinstance(error, ForkPointInvalid):
        return str(error), EXIT_USAGE
    if isinstance(error, UnknownTask | TaskAlreadyExists):
        return str(error), EXIT_REFUSED
    if isinstance(error, InvalidInput):
        return str(error), EXIT_USAGE
    return str(error), EXIT_REFUSED


def fail(message: str, code: int, dsn: str | None = None) -> NoReturn:
    """Print ``error: message`` (never a password) on one line and exit with ``code``."""
    line = " ".join(scrub(message, dsn).split())
    if _json_errors:
        click.echo(orjson.dumps({"error": line, "exit_code": code},
                                option=orjson.OPT_SORT_KEYS).decode(), err=True)
    else:
        click.echo(f"error: {line}", err=True)
    raise SystemExit(code)


def scrub(text: str, dsn: str | None) -> str:
    """``text`` without the password of ``dsn`` or of ``WAL_ENGINE_DSN``."""
    for candidate in (dsn, os.environ.get(DSN_ENV)):
        if not candidate:
            continue
        if candidate in text:
            text = text.replace(candidate, redact_dsn(candidate))
        try:
            secrets = Dsn.parse(candidate).secrets()
        except InvalidDsn:
            continue
        for secret in secrets:
            text = text.replace(secret, "***")
    return text


def _quiet_stdout() -> None:
    """After a broken pipe (``| head``): send what is left to /dev/null, exit quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class MainGroup(click.Group):
    """The command group: usage errors are one line too."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        global _json_errors
        given = list(sys.argv[1:] if args is None else args)
        # A usage error is found before --json is parsed: look for it among the options.
        _json_errors = "--json" in given[:given.index("--")] if "--" in given else (
            "--json" in given)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as error:
            message = error.format_message()
            context = getattr(error, "ctx", None)
            if context is not None:
                message += f" (see `{context.command_path} --help`)"
            fail(message, error.exit_code)
        except click.Abort:
            fail("aborted", EXIT_INTERRUPTED)
        raise SystemExit(code if isinstance(code, int) else 0)


# ----------------------------------------------------------------------------- engine


@asynccontextmanager
async def open_engine(dsn: str | None, *, write: bool = False,
                      **options: Any) -> AsyncIterator[Engine]:
    """An engine on ``dsn`` that never migrates; writers insist on synchronous commit.

    The security self-test runs as in any engine; ``--development`` (see
    :func:`development_option`) lets a superuser or an owner of the log through.
    ``options`` are more keyword arguments of :func:`~wal_engine.engine.connect`.
    """
    from wal_engine.engine import connect

    engine = await connect(dsn, migrate=False, require_synchronous_commit=write,
                           pool_size_max=cli_pool_size_max,
                           development=development_requested(), tenant=current_tenant(),
                           **options)
    try:
        yield engine
    finally:
        await engine.close()


@asynccontextmanager
async def open_reader(dsn: str | None, replica: str | None, *,
                      as_json: bool) -> AsyncIterator[Engine]:
    """An engine for a reading command: on ``dsn`` (:func:`open_engine`), or with
    ``--replica`` on that standby, every transaction read-only. The standby's status (how
    far behind it is, compared with ``dsn`` when given) is printed first, or emitted as a
    ``{"replica": ...}`` line with ``--json``.

    Raises:
        ReplicaUnavailable: The standby cannot be reached.
        NotAStandby: ``replica`` names a server that is not in recovery.
    """
    if replica is None:
        async with open_engine(dsn) as engine:
            yield engine
        return
    from wal_engine.engine import connect
    from wal_engine.store.replica import replica_status

    try:
        engine = await connect(read_only_dsn(replica), migrate=False,
                               require_synchronous_commit=False,
                               pool_size_max=cli_pool_size_max,
                               development=development_requested(), tenant=current_tenant())
    except ReplicaUnavailable:
        raise
    except DatabaseUnavailable as error:
        raise ReplicaUnavailable(redact_dsn(replica), error.reason) from error
    try:
        status = await replica_status(engine.database, replica, dsn)
        if as_json:
            emit({"replica": status.as_json()})
        else:
            console().print(status.summary(), markup=False)
        yield engine
    finally:
        await engine.close()


def replica_option(function: F) -> F:
    """``--replica DSN``: read from that streaming standby instead of the primary."""
    return click.option(
        "--replica", default=None, metavar="DSN",
        help="Read from this streaming standby instead of the primary, read-only; the "
             "output first says how far behind it is (in bytes of WAL when the primary, "
             f"--dsn or {DSN_ENV}, is reachable too).",
    )(function)


def read_only_dsn(dsn: str) -> str:
    """``dsn`` with every transaction read-only (a server setting asyncpg takes from the URL)."""
    return Dsn.parse(dsn).with_query("default_transaction_read_only", "on").render()


# ----------------------------------------------------------------------------- agents


def load_target(spec: str) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted); the working directory is importable."""
    module_name, separator, attribute = spec.partition(":")
    if not separator or not module_name or not attribute:
        raise CliError(f"--agents {spec!r} must look like module:attr", EXIT_USAGE)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise CliError(f"--agents: cannot import {module_name!r}: {error}", EXIT_USAGE) from error
    except Exception as error:  # The user's module failed while being imported.
        raise CliError(f"--agents: importing {module_name!r} raised {type(error).__name__}: "
                       f"{error}", EXIT_USAGE) from error
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as error:
            raise CliError(f"--agents: {module_name!r} has no attribute {attribute!r}",
                           EXIT_USAGE) from error
    return target


async def install_agents(engine: Engine, spec: str) -> None:
    """Register the agents ``spec`` names on ``engine``.

    ``module:attr`` is either a function taking the engine and registering agents on it
    (``register(engine)``, sync or async, like ``wal_engine.cli.demo:register``), or a mapping
    of agent names to agent functions (or :class:`~wal_engine.engine.AgentDefinition`).
    """
    from wal_engine.engine import AgentDefinition

    target = load_target(spec)
    if isinstance(target, Mapping):
        wrong = sorted(str(name) for name, entry in target.items()
                       if not isinstance(entry, AgentDefinition) and not callable(entry))
        if wrong:
            raise CliError(f"--agents {spec!r} is a mapping whose values are not agent "
                           f"functions (e.g. {', '.join(wrong[:3])}): name a register(engine) "
                           "function or a mapping of agent names to agent functions",
                           EXIT_USAGE)
        for name, entry in target.items():
            if isinstance(entry, AgentDefinition):
                engine.agents[str(name)] = entry
            else:
                engine.register(str(name), entry)
    elif callable(target) and _takes_one_argument(target):
        try:
            result = target(engine)
            if inspect.isawaitable(result):
                await result
        except (WalError, asyncpg.PostgresError):
            raise  # Reported like any engine or database error.
        except Exception as error:  # The user's register function failed.
            raise CliError(f"--agents {spec!r} raised {type(error).__name__}: {error}",
                           EXIT_USAGE) from error
    else:
        raise CliError(f"--agents {spec!r} must name a function taking an Engine, or a "
                       "mapping of agent names to agent functions", EXIT_USAGE)
    if not engine.agents:
        raise CliError(f"--agents {spec!r} registered no agent", EXIT_USAGE)


def _takes_one_argument(function: Callable[..., Any]) -> bool:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return False
    required = [p for p in signature.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


# ----------------------------------------------------------------------------- output


def console() -> Console:
    """Human output on standard output (wide when piped, so tables are not cut)."""
    return Console(width=None if sys.stdout.isatty() else piped_width_chars,
                   highlight=False)


def emit(value: Mapping[str, Any]) -> None:
    """One JSON object on one line of standard output; keys sorted (stable for scripts)."""
    click.echo(orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=_json_default)
               .decode())


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


class ProgressDisplay:
    """Progress bars on a terminal's standard error; nothing at all when it is piped."""

    def __init__(self) -> None:
        self._console = Console(stderr=True)
        self._bars: Any = None
        self._tasks: dict[str, Any] = {}

    @property
    def shown(self) -> bool:
        """Whether bars are drawn (standard error is a terminal)."""
        return bool(self._console.is_terminal)

    def update(self, phase: str, done: int, total: int | None) -> None:
        """Move the bar of ``phase`` (created on first use) to ``done`` of ``total``."""
        if self._bars is None:
            return
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = self._bars.add_task(phase, total=total)
        self._bars.update(task, completed=done, total=total)


@contextmanager
def progress() -> Iterator[ProgressDisplay]:
    """A :class:`ProgressDisplay` for the duration of a long operation (removed when done)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    display = ProgressDisplay()
    if not display.shown:
        yield display
        return
    bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=display._console, transient=True)
    display._bars = bars
    with bars:
        yield display


def short_hash(value: bytes | None, length: int = 12) -> str:
    """The first hex digits of a hash, for humans."""
    return "" if not value else value.hex()[:length]
