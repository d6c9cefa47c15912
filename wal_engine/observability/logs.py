"""Logging configuration for the entry points (the CLI and workers); never run on import.

The library logs through :func:`get_logger`, never configuring structlog: an application
that configured structlog gets every line through its configuration. One that did not
gets the library's lines on standard error at INFO (``WAL_ENGINE_LOG_LEVEL`` changes it),
as console lines on a terminal and JSON lines otherwise, instead of structlog's defaults
(every DEBUG line, on standard output, where they would mix into a program's own output).
The ``wal-engine`` command and worker processes call :func:`configure_logging` once at
start:

* JSON lines (one object per line, ISO timestamps in UTC) when the log stream is not a
  terminal, readable console output when it is; ``WAL_ENGINE_LOG_FORMAT=json|console``
  overrides the detection;
* the level from ``WAL_ENGINE_LOG_LEVEL`` (``debug``, ``info``, ``warning``, ``error``,
  ``critical``), else the entry point's default;
* context bound with ``structlog.contextvars`` is merged into every line: a task run binds
  ``task_id``, ``seq``, ``epoch`` and ``worker_id``, so every line it causes carries them.

Logs go to standard error, so that ``--json`` output on standard output stays parseable;
whether the output is JSON is decided by whether that stream is a terminal.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from typing import Any, Final, TextIO

import orjson
import structlog

from wal_engine.errors import ConfigurationError

LEVEL_ENV: Final = "WAL_ENGINE_LOG_LEVEL"
FORMAT_ENV: Final = "WAL_ENGINE_LOG_FORMAT"

LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_configured = False


class StreamLogger:
    """Writes each rendered line to a stream looked up at write time.

    Looking the stream up late (``sys.stderr`` by default) keeps the configuration valid
    when a test runner swaps standard error for a while and closes its replacement.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        """Write one line and flush it (a worker may be killed at any moment)."""
        stream = self._stream if self._stream is not None else sys.stderr
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


class StreamLoggerFactory:
    """structlog logger factory for :class:`StreamLogger`."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def __call__(self, *_: Any) -> StreamLogger:
        return StreamLogger(self._stream)


def parse_level(text: str) -> int:
    """The logging level named by ``text`` (case-insensitive); raises ConfigurationError."""
    level = LEVELS.get(text.strip().lower())
    if level is None:
        raise ConfigurationError(
            f"{LEVEL_ENV}={text!r} is not a log level; use one of {', '.join(LEVELS)}"
        )
    return level


def _is_terminal(stream: TextIO | None) -> bool:
    target = stream if stream is not None else sys.stderr
    isatty = getattr(target, "isatty", None)
    return bool(callable(isatty) and isatty())


def _json_lines(stream: TextIO | None) -> bool:
    chosen = os.environ.get(FORMAT_ENV, "").strip().lower()
    if chosen in ("json", "console"):
        return chosen == "json"
    if chosen:
        raise ConfigurationError(f"{FORMAT_ENV}={chosen!r} must be 'json' or 'console'")
    return not _is_terminal(stream)


def _serialize(value: Any, **_: Any) -> str:
    return orjson.dumps(value, default=str).decode()


def _processors(as_json: bool, stream: TextIO | None) -> list[Any]:
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if as_json:
        processors += [structlog.processors.dict_tracebacks,
                       structlog.processors.JSONRenderer(serializer=_serialize)]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_is_terminal(stream))
        processors += [structlog.dev.set_exc_info, renderer]
    return processors


def configure_logging(
    *,
    default_level: str = "info",
    level: str | None = None,
    json: bool | None = None,
    stream: TextIO | None = None,
    force: bool = False,
) -> None:
    """Configure structlog for a process; later calls do nothing unless ``force``.

    Args:
        default_level: The level when ``WAL_ENGINE_LOG_LEVEL`` is not set.
        level: A level that wins over the environment (tests, explicit flags).
        json: JSON lines (True) or console output (False); None detects it from the stream.
        stream: Where lines go; None means standard error, looked up at every write.
        force: Configure again even if this process already did.

    Raises:
        ConfigurationError: the level or format named in the environment is unknown.
    """
    global _configured
    if _configured and not force:
        return
    chosen = level if level is not None else os.environ.get(LEVEL_ENV) or default_level
    threshold = parse_level(chosen)
    as_json = _json_lines(stream) if json is None else json
    structlog.configure(
        processors=_processors(as_json, stream),
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=StreamLoggerFactory(stream),
        # Not cached: a cached logger would keep this configuration even inside
        # ``structlog.testing.capture_logs``, which tests rely on.
        cache_logger_on_first_use=False,
    )
    _configured = True
    capture_driver_logs(force=True)


def reset_logging() -> None:
    """Forget the configuration (tests): structlog's defaults apply again."""
    global _configured, _fallback
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    _configured = False
    _fallback = None


# ------------------------------------------------------------------ the library's loggers

_fallback: Any = None
"""The logger of a process that configured no structlog (built on first use)."""


def _fallback_logger() -> Any:
    """Standard error at INFO (or ``WAL_ENGINE_LOG_LEVEL``), console on a terminal, JSON
    otherwise: what :func:`configure_logging` would set, without setting it."""
    global _fallback
    if _fallback is None:
        try:
            threshold = parse_level(os.environ.get(LEVEL_ENV) or "info")
            as_json = _json_lines(None)
        except ConfigurationError:
            threshold, as_json = logging.INFO, not _is_terminal(None)
        _fallback = structlog.wrap_logger(
            StreamLogger(), processors=_processors(as_json, None),
            wrapper_class=structlog.make_filtering_bound_logger(threshold))
    return _fallback


class LibraryLogger:
    """A logger of the library: through the application's structlog configuration when it
    has one, else through the library's own (see the module docstring). Which one is
    decided at every line, so an application may configure structlog after import."""

    __slots__ = ("_context", "_name")

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        self._name = name
        self._context = context or {}

    @property
    def context(self) -> dict[str, Any]:
        """The values bound to this logger."""
        return dict(self._context)

    def bind(self, **values: Any) -> LibraryLogger:
        """A logger that adds ``values`` to every line."""
        return LibraryLogger(self._name, {**self._context, **values})

    def _target(self) -> Any:
        if structlog.is_configured():
            logger = structlog.get_logger(self._name)
        else:
            logger = _fallback_logger()
        return logger.bind(**self._context) if self._context else logger

    def debug(self, event: str, **values: Any) -> None:
        self._target().debug(event, **values)

    def info(self, event: str, **values: Any) -> None:
        self._target().info(event, **values)

    def warning(self, event: str, **values: Any) -> None:
        self._target().warning(event, **values)

    def error(self, event: str, **values: Any) -> None:
        self._target().error(event, **values)

    def exception(self, event: str, **values: Any) -> None:
        self._target().exception(event, **values)

    def critical(self, event: str, **values: Any) -> None:
        self._target().critical(event, **values)


def get_logger(name: str) -> LibraryLogger:
    """The logger for the library module ``name``."""
    return LibraryLogger(name)


# ------------------------------------------------------------------ the driver's logger

DRIVER_LOGGER: Final = "asyncpg"
DRIVER_EVENTS: Final = {
    "Failed to restore the pool connection floor; retrying": "pool_reconnect_failed",
}
"""Lines of asyncpg's own logger that have an event name of their own; any other line is
``driver_log`` with its message."""
_PY_LEVELS: Final = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
                     logging.ERROR: "error", logging.CRITICAL: "critical"}


class DriverLogBridge(logging.Handler):
    """Turns a line of asyncpg's standard-library logger into one structured record of the
    library's loggers: its exception as one ``error`` field (type and message), never the
    multi-line traceback Python's last-resort handler would print to standard error (asyncpg
    logs one each time its pool fails to reconnect while the database is away)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            template = record.msg if isinstance(record.msg, str) else str(record.msg)
            event = DRIVER_EVENTS.get(template, "driver_log")
            values: dict[str, Any] = {"logger": record.name}
            if event == "driver_log":
                values["message"] = _one_line(record.getMessage())
            if record.exc_info and record.exc_info[1] is not None:
                error = record.exc_info[1]
                values["error"] = _one_line(f"{type(error).__name__}: {error}")
                cause = error.__cause__ or error.__context__
                if cause is not None:
                    values["cause"] = _one_line(f"{type(cause).__name__}: {cause}")
            level = _PY_LEVELS.get(record.levelno, "warning")
            # In an empty context: the pool's maintenance runs in a copy of the context of
            # the task run that happened to start it, whose task_id is not this line's.
            contextvars.Context().run(getattr(get_logger(record.name), level), event,
                                      **values)
        except Exception:  # A log line must never break the driver.
            self.handleError(record)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def capture_driver_logs(*, force: bool = False) -> bool:
    """Route asyncpg's logger through :class:`DriverLogBridge` (once per process).

    Entry points (:func:`configure_logging`) always do. The library does it when it opens a
    pool (``force`` false) only if the application configured no standard-library logging
    of its own (no handler on the root logger or on ``asyncpg``): its lines would otherwise
    reach Python's last-resort handler as multi-line tracebacks. Returns whether the bridge
    is in place."""
    driver = logging.getLogger(DRIVER_LOGGER)
    if any(isinstance(handler, DriverLogBridge) for handler in driver.handlers):
        return True
    if not force and (driver.handlers or logging.getLogger().handlers):
        return False
    driver.addHandler(DriverLogBridge())
    driver.propagate = False
    return True
