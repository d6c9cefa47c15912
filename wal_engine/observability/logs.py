"""Logging configuration for the entry points (the CLI and workers); never run on import.

The library only ever calls ``structlog.get_logger(__name__)`` and binds context; an
application that configures structlog itself keeps its configuration. The ``wal-engine``
command and worker processes call :func:`configure_logging` once at start:

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
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=StreamLoggerFactory(stream),
        # Not cached: a cached logger would keep this configuration even inside
        # ``structlog.testing.capture_logs``, which tests rely on.
        cache_logger_on_first_use=False,
    )
    _configured = True


def reset_logging() -> None:
    """Forget the configuration (tests): structlog's defaults apply again."""
    global _configured
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    _configured = False
