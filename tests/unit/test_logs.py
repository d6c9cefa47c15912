"""Logging configuration: JSON lines off a terminal, console on one, level from the
environment, task context on every line, and nothing configured on import."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator

import orjson
import pytest
import structlog

from wal_engine.errors import ConfigurationError
from wal_engine.observability.logs import LEVEL_ENV, configure_logging, reset_logging


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_structlog(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test configures from scratch; the process's configuration comes back after."""
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    monkeypatch.delenv("WAL_ENGINE_LOG_FORMAT", raising=False)
    saved = structlog.get_config()
    reset_logging()
    yield
    reset_logging()
    structlog.configure(**saved)


def test_json_lines_when_not_a_terminal_with_the_task_context_bound() -> None:
    """Off a terminal every line is one JSON object carrying the bound task context."""
    stream = io.StringIO()
    configure_logging(stream=stream)
    structlog.contextvars.bind_contextvars(task_id="t-1", seq=7, epoch=2, worker_id="w-1")
    structlog.get_logger("wal_engine.runtime.run").info("task_completed", output_bytes=3)
    (line,) = stream.getvalue().splitlines()
    record = orjson.loads(line)
    assert record["event"] == "task_completed" and record["level"] == "info"
    assert (record["task_id"], record["seq"], record["epoch"], record["worker_id"]) == \
        ("t-1", 7, 2, "w-1")
    assert record["timestamp"].endswith("Z") and record["output_bytes"] == 3


def test_console_output_on_a_terminal() -> None:
    """On a terminal lines are for humans, not JSON."""
    stream = Terminal()
    configure_logging(stream=stream)
    structlog.get_logger("x").warning("lease_lost", task_id="t-2")
    text = stream.getvalue()
    assert "lease_lost" in text and "t-2" in text and not text.lstrip().startswith("{")


def test_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """WAL_ENGINE_LOG_LEVEL=warning drops info lines."""
    monkeypatch.setenv(LEVEL_ENV, "WARNING")
    stream = io.StringIO()
    configure_logging(stream=stream, default_level="debug")
    log = structlog.get_logger("x")
    log.info("quiet")
    log.warning("loud")
    assert [orjson.loads(line)["event"] for line in stream.getvalue().splitlines()] == ["loud"]


def test_an_unknown_level_or_format_is_a_configuration_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in the environment is reported, not silently ignored."""
    monkeypatch.setenv(LEVEL_ENV, "loud")
    with pytest.raises(ConfigurationError, match="WAL_ENGINE_LOG_LEVEL"):
        configure_logging(stream=io.StringIO())
    monkeypatch.setenv(LEVEL_ENV, "info")
    monkeypatch.setenv("WAL_ENGINE_LOG_FORMAT", "xml")
    with pytest.raises(ConfigurationError, match="WAL_ENGINE_LOG_FORMAT"):
        configure_logging(stream=io.StringIO())


def test_format_override_and_configured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """WAL_ENGINE_LOG_FORMAT wins over detection; a second call changes nothing."""
    monkeypatch.setenv("WAL_ENGINE_LOG_FORMAT", "json")
    terminal = Terminal()
    configure_logging(stream=terminal)
    configure_logging(stream=io.StringIO(), level="critical")
    structlog.get_logger("x").info("still_here")
    assert orjson.loads(terminal.getvalue())["event"] == "still_here"


def test_lines_go_to_the_current_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a stream, each line goes to whatever sys.stderr is when it is written."""
    configure_logging(json=True)
    structlog.get_logger("x").info("to_stderr")
    captured = capsys.readouterr()
    assert orjson.loads(captured.err)["event"] == "to_stderr" and captured.out == ""


def test_importing_the_library_configures_nothing() -> None:
    """A library never configures logging on import (only entry points do)."""
    code = ("import structlog, wal_engine.engine, wal_engine.runtime.worker, wal_engine.cli, "
            "wal_engine.observability.logs, wal_engine.audit.timeline, "
            "wal_engine.runtime.replayer; "
            "print(structlog.is_configured())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "False"


LIBRARY_LINES = (
    "import structlog; from wal_engine.observability.logs import get_logger; "
    "log = get_logger('wal_engine.engine').bind(task_id='t-9'); "
    "log.debug('debug_line'); log.info('info_line', n=1); "
    "print('program output', structlog.is_configured())"
)


def test_an_unconfigured_application_gets_info_lines_on_stderr() -> None:
    """No structlog configuration: the library's INFO lines go to standard error (JSON off
    a terminal), DEBUG lines are dropped, standard output stays the program's, and the
    library configured nothing."""
    result = subprocess.run([sys.executable, "-c", LIBRARY_LINES], capture_output=True,
                            text=True, timeout=60, check=True,
                            env={**_clean_env(), "WAL_ENGINE_LOG_FORMAT": ""})
    assert result.stdout == "program output False\n"
    (line,) = result.stderr.splitlines()
    record = orjson.loads(line)
    assert (record["event"], record["level"], record["task_id"], record["n"]) == \
        ("info_line", "info", "t-9", 1)


def test_the_level_of_an_unconfigured_application_comes_from_the_environment() -> None:
    result = subprocess.run([sys.executable, "-c", LIBRARY_LINES], capture_output=True,
                            text=True, timeout=60, check=True,
                            env={**_clean_env(), LEVEL_ENV: "debug"})
    assert [orjson.loads(line)["event"] for line in result.stderr.splitlines()] == \
        ["debug_line", "info_line"]


def test_an_application_configuration_made_after_import_is_used() -> None:
    """The application configures structlog after the library's loggers exist: their lines
    go through its configuration (here structlog's capture), with the bound values."""
    from wal_engine.observability.logs import get_logger

    log = get_logger("wal_engine.runtime.run").bind(task_id="t-3")
    with structlog.testing.capture_logs() as captured:
        log.debug("run_detail", seq=4)
    assert captured == [{"event": "run_detail", "log_level": "debug", "task_id": "t-3",
                         "seq": 4}]


def _clean_env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items()
            if key not in (LEVEL_ENV, "WAL_ENGINE_LOG_FORMAT")}
