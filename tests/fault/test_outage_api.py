"""The public API through a database outage (issue 22, part A): every call of the Engine
either rides the outage (a call safe to repeat, or one whose attempt never reached the
server, is made again with a bounded, jittered backoff) or raises DatabaseUnavailable
saying whether it may have applied; never a driver's or a socket's error. Workers keep
their tasks through an outage shorter than the lease and hand them over cleanly after a
longer one; a process started during an outage waits for the database.

The outages are real: the module's own embedded server stopped and started again
(``crashable``), a fault proxy that refuses or swallows answers, sessions terminated with
``pg_terminate_backend``, a multi-host DSN whose first host refuses."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from structlog.testing import capture_logs

from tests.fault.standby import free_port, with_hosts
from tests.fault.support import deep_count
from wal_engine import limits
from wal_engine.dsn import redact_dsn
from wal_engine.engine import Engine, connect
from wal_engine.errors import DatabaseUnavailable, WalError
from wal_engine.observability.logs import DriverLogBridge, capture_driver_logs
from wal_engine.testing.crash import connect_engine
from wal_engine.testing.postgres import DatabaseFactory, TestServer
from wal_engine.testing.processes import wait_until
from wal_engine.testing.proxy import FaultProxy

ROOT = Path(__file__).resolve().parents[2]
ACTED: Counter[tuple[str, int]] = Counter()
"""Effects of the ``steps`` agent's tool, by (task, step): acted once each, or not."""
PAUSE: dict[str, asyncio.Event] = {}
"""A ``steps`` task pauses between two steps on the event under its id (set by a test)."""
PAUSED: dict[str, asyncio.Event] = {}


def register(engine: Engine) -> None:
    """The agents of these tests."""

    @engine.agent("waits")
    async def waits(ctx: Any, args: Any) -> Any:
        return await ctx.wait_for_signal("go")

    @engine.agent("steps")
    async def steps(ctx: Any, args: Any) -> Any:
        total = 0
        for step in range(args["steps"]):
            def act(index: int, task_id: str = ctx.task_id,
                    delay_s: float = args.get("delay_s", 0.0)) -> int:
                ACTED[(task_id, index)] += 1
                time.sleep(delay_s)  # A sync tool's own latency (on the worker's threads).
                return index

            total += await ctx.tool("act", act, step, idempotent=False)
            if step == args.get("pause_after") and ctx.task_id in PAUSE:
                PAUSED.setdefault(ctx.task_id, asyncio.Event()).set()
                await PAUSE[ctx.task_id].wait()  # Between two calls: nothing in doubt.
        return total


async def _stop(server: TestServer) -> None:
    assert server.embedded is not None
    await asyncio.to_thread(server.embedded.stop, "immediate")


async def _start(server: TestServer) -> None:
    assert server.embedded is not None
    await asyncio.to_thread(server.embedded.start)


def _raw(error: BaseException) -> bool:
    return not isinstance(error, WalError)


def _errors_at_error_level(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry.get("log_level") in ("error", "critical")]


async def _signals(dsn: str, task_id: str) -> Counter[str]:
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch("SELECT name FROM wal_signals WHERE task_id = $1",
                                      task_id)
    finally:
        await connection.close()
    return Counter(row["name"] for row in rows)


# ----------------------------------------------------------------------------- the API


@pytest.mark.parametrize("cycles", [
    pytest.param(1, id="ci", marks=pytest.mark.timeout(120)),
    pytest.param(deep_count(40, 20), id="deep",
                 marks=[pytest.mark.deep, pytest.mark.timeout(1800)]),
])
async def test_every_call_rides_a_restart_through_a_multi_host_dsn(
        crashable: tuple[TestServer, DatabaseFactory], cycles: int) -> None:
    """The server stopped (immediate) for 1.5 s under an engine connected through a
    multi-host DSN whose first host refuses (``target_session_attrs=read-write``): every
    call made during the outage (submit with and without a task id, signals with and
    without a dedup key, approve, cancel, fork, state, head, history, wait) returns once
    the server is back, each applied once. The deep tier repeats it."""
    server, factory = crashable
    dsn = await factory.create()
    assert server.embedded is not None and server.embedded.port is not None
    multi = with_hosts(dsn, [free_port(), server.embedded.port],
                       target_session_attrs="read-write")
    engine = await connect(multi, migrate=False, development=True, unavailable_retry_s=20)
    register(engine)
    try:
        for cycle in range(cycles):
            await _ride_one_restart(server, dsn, engine, f"c{cycle}")
    finally:
        await asyncio.wait_for(engine.close(), 20)


async def _ride_one_restart(server: TestServer, dsn: str, engine: Engine, prefix: str
                            ) -> None:
    base = await engine.submit("waits", {"n": 0}, task_id=f"{prefix}-base")
    doomed = await engine.submit("waits", {"n": 0}, task_id=f"{prefix}-doomed")
    with capture_logs() as logs:
        await _stop(server)
        started = time.monotonic()
        calls = {
            "submit(task_id)": engine.submit("waits", {"n": 1},
                                             task_id=f"{prefix}-during"),
            "submit()": engine.submit("waits", {"n": 2}),
            "signal(dedup_key)": engine.signal(base, "hook", {"v": 1}, dedup_key="d-1"),
            "signal()": engine.signal(base, "plain", {"v": 2}),
            "approve": engine.approve(base, "tool-1", approver="ops", args_hash="ab" * 32),
            "cancel": engine.cancel(doomed, reason="outage test"),
            "state": engine.state(base),
            "head": engine.head(base),
            "history": engine.history(base),
            "fork": engine.fork(base, 1),
            "wait": engine.wait(doomed, timeout_s=30),
        }
        running = {name: asyncio.ensure_future(call) for name, call in calls.items()}
        await asyncio.sleep(1.5)
        early = [name for name, task in running.items() if task.done()]
        await _start(server)
        outage_s = time.monotonic() - started
        done = await asyncio.gather(*running.values(), return_exceptions=True)
        ridden_s = time.monotonic() - started
    results = dict(zip(running, done, strict=True))
    failed = {name: repr(result) for name, result in results.items()
              if isinstance(result, BaseException)}
    assert not failed, failed
    assert not early, f"returned during the outage: {early}"
    assert results["submit(task_id)"] == f"{prefix}-during"
    assert results["cancel"] is True
    assert str(results["wait"].status) == "FAILED"
    assert (await engine.head(str(results["fork"]))).parent_task_id == base
    assert (await engine.head(str(results["submit()"]))).task_id == results["submit()"]
    sent = await _signals(dsn, base)
    assert sent["hook"] == 1 and sent["plain"] == 1 and sent["~approval:tool-1"] == 1
    retried = Counter(entry["operation"] for entry in logs
                      if entry["event"] == "database_unavailable_retrying")
    assert set(retried) >= {"submit", "signal", "state", "history"}, retried
    assert not _errors_at_error_level(logs)
    print(f"\noutage {outage_s:.1f} s, every call back {ridden_s:.1f} s after it began; "
          f"retries by operation {dict(retried)}")


@pytest.mark.timeout(60)
async def test_a_write_that_may_have_applied_says_so(
        database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's answers swallowed (the statements run and commit, the client never
    hears): a signal without a dedup key raises DatabaseUnavailable with
    ``may_have_applied`` and is not sent again (stored once); one with a dedup key and a
    submit are made again until they land (stored once each); a read raised nothing."""
    monkeypatch.setattr(limits, "connect_timeout_s", 1.0)
    proxy = await FaultProxy.for_dsn(database_dsn).start()
    engine = await connect_engine(proxy.dsn(database_dsn), command_timeout_s=1.0,
                                  pool_size_max=4)
    engine.unavailable_retry_s = 20
    register(engine)
    try:
        base = await engine.submit("waits", {"n": 0}, task_id="base")
        # The signal statement prepared on the pooled session: under the fault, the next
        # one is executed (and commits) at once, only its answer is lost.
        await engine.signal(base, "warm-up", 0)
        proxy.set("drop_s2c")
        plain = asyncio.ensure_future(engine.signal(base, "plain", 1))
        await asyncio.sleep(0.2)
        dedup = asyncio.ensure_future(engine.signal(base, "dedup", 2, dedup_key="k-1"))
        created = asyncio.ensure_future(engine.submit("waits", {"n": 3}, task_id="in-doubt"))
        read = asyncio.ensure_future(engine.history(base))
        await asyncio.wait({plain}, timeout=10)
        assert plain.done()
        proxy.set("pass")
        error = plain.exception()
        assert isinstance(error, DatabaseUnavailable), repr(error)
        assert error.may_have_applied is True
        assert isinstance(await dedup, int)
        assert await created == "in-doubt"
        assert len(await read) == 1
        sent = await _signals(database_dsn, base)
        assert sent == Counter({"warm-up": 1, "plain": 1, "dedup": 1}), sent
        assert (await engine.head("in-doubt")).head_seq == 1
    finally:
        proxy.set("pass")
        await proxy.close()
        await asyncio.wait_for(engine.close(), 10)


@pytest.mark.timeout(60)
async def test_retries_end_at_the_deadline(
        database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database away for good: a call safe to repeat raises DatabaseUnavailable once
    ``unavailable_retry_s`` has passed (not before, not much after), with
    ``may_have_applied`` False since nothing reached the server."""
    monkeypatch.setattr(limits, "connect_timeout_s", 1.0)
    proxy = await FaultProxy.for_dsn(database_dsn).start()
    engine = await connect_engine(proxy.dsn(database_dsn), pool_size_max=2)
    engine.unavailable_retry_s = 1.0
    register(engine)
    try:
        await engine.submit("waits", None, task_id="base")
        await proxy.close()
        # The read first: its first attempt may meet the pooled session the reset cut (a
        # statement in flight, had it been a write); the others find every one refused.
        for name, call in (("state", lambda: engine.state("base")),
                           ("submit", lambda: engine.submit("waits", None, task_id="x")),
                           ("signal", lambda: engine.signal("base", "go", None))):
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable) as raised:
                await call()
            elapsed = time.monotonic() - started
            assert 0.95 <= elapsed <= 4.5, (name, elapsed)
            assert raised.value.may_have_applied is False, name
            assert not _raw(raised.value)
    finally:
        await asyncio.wait_for(engine.close(), 10)


@pytest.mark.timeout(60)
async def test_connect_waits_for_the_database(
        crashable: tuple[TestServer, DatabaseFactory]) -> None:
    """``connect(connect_wait_s=...)`` during an outage waits (``database_waiting``) and
    connects once the server is back (``database_ready``); past the wait it raises
    DatabaseUnavailable; a database that does not exist is raised at once."""
    server, factory = crashable
    dsn = await factory.create()
    await _stop(server)
    try:
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable):
            await connect(dsn, migrate=False, development=True, connect_wait_s=1.0)
        assert 0.9 <= time.monotonic() - started <= 5.0
        with capture_logs() as logs:
            connecting = asyncio.ensure_future(
                connect(dsn, migrate=False, development=True, connect_wait_s=30))
            await asyncio.sleep(1.0)
            assert not connecting.done()
            await _start(server)
            engine = await asyncio.wait_for(connecting, 30)
        await engine.close()
        events = [entry["event"] for entry in logs]
        # The engine's own lines: the server's start is logged by the test's harness, which
        # may come after the engine connected.
        ours = [event for event in events if event.startswith("database_")]
        assert "database_waiting" in ours and ours[-1] == "database_ready", events
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable):
            await connect(dsn.rsplit("/", 1)[0] + "/no_such_database", migrate=False,
                          development=True, connect_wait_s=30)
        assert time.monotonic() - started < 5.0
    finally:
        await _start(server)


# ----------------------------------------------------------------------------- workers


async def _steps_worker(engine: Engine, lease_ttl_ms: int) -> tuple[Any, asyncio.Task[None]]:
    worker = engine.worker(concurrency=2, lease_ttl_ms=lease_ttl_ms,
                           heartbeat_ms=lease_ttl_ms // 4, poll_ms=100, sweep_ms=200)
    return worker, asyncio.ensure_future(worker.run())


@pytest.mark.timeout(120)
async def test_a_worker_keeps_its_tasks_through_an_outage_shorter_than_the_lease(
        crashable: tuple[TestServer, DatabaseFactory]) -> None:
    """The server stopped for 1.5 s while a worker holds two tasks (lease 6 s): once it is
    back the same runs go on under their first claim (epoch 1), each tool acted once,
    and the outage is logged at warning as what it is (no error, no task_run_crashed)."""
    server, factory = crashable
    dsn = await factory.create()
    engine = await connect(dsn, migrate=False, development=True)
    register(engine)
    ids = ["short-1", "short-2"]
    for task_id in ids:
        PAUSE[task_id] = asyncio.Event()
        await engine.submit("steps", {"steps": 4, "pause_after": 1}, task_id=task_id)
    try:
        with capture_logs() as logs:
            worker, running = await _steps_worker(engine, 6000)
            for task_id in ids:
                await asyncio.wait_for(PAUSED.setdefault(task_id, asyncio.Event()).wait(), 20)
            await _stop(server)
            await asyncio.sleep(1.5)
            await _start(server)
            for task_id in ids:
                PAUSE[task_id].set()
            states = [await engine.wait(task_id, timeout_s=30) for task_id in ids]
            worker.stop()
            await asyncio.wait_for(running, 30)
        assert [state.output for state in states] == [6, 6]
        for task_id in ids:
            assert (await engine.head(task_id)).lease_epoch == 1, task_id
            assert [ACTED[(task_id, step)] for step in range(4)] == [1, 1, 1, 1]
        events = Counter(entry["event"] for entry in logs)
        assert "task_run_crashed" not in events
        assert not _errors_at_error_level(logs), _errors_at_error_level(logs)
        assert events["worker_database_ready"] == 1
    finally:
        for task_id in ids:
            PAUSE.pop(task_id, None)
        await asyncio.wait_for(engine.close(), 20)


@pytest.mark.timeout(120)
async def test_a_worker_hands_its_tasks_over_after_an_outage_longer_than_the_lease(
        crashable: tuple[TestServer, DatabaseFactory]) -> None:
    """The server stopped for 3 s while a worker holds a task (lease 1.2 s): the lease
    lapses, the run stops trusting it and gives the task up (a warning), the task is
    claimed again and finishes from the log: each tool acted once, no error-level line."""
    server, factory = crashable
    dsn = await factory.create()
    engine = await connect(dsn, migrate=False, development=True)
    register(engine)
    task_id = "long-1"
    PAUSE[task_id] = asyncio.Event()
    await engine.submit("steps", {"steps": 4, "pause_after": 1}, task_id=task_id)
    try:
        with capture_logs() as logs:
            worker, running = await _steps_worker(engine, 1200)
            await asyncio.wait_for(PAUSED.setdefault(task_id, asyncio.Event()).wait(), 20)
            await _stop(server)
            await asyncio.sleep(3.0)
            await _start(server)
            PAUSE[task_id].set()
            state = await engine.wait(task_id, timeout_s=30)
            worker.stop()
            await asyncio.wait_for(running, 30)
        assert state.output == 6
        assert (await engine.head(task_id)).lease_epoch >= 2
        assert [ACTED[(task_id, step)] for step in range(4)] == [1, 1, 1, 1]
        events = Counter(entry["event"] for entry in logs)
        assert "task_run_crashed" not in events
        assert not _errors_at_error_level(logs), _errors_at_error_level(logs)
        assert events["task_run_fenced"] + events["task_run_given_up"] >= 1, events
    finally:
        PAUSE.pop(task_id, None)
        await asyncio.wait_for(engine.close(), 20)


CLI_ENV = {"PYTHONPATH": str(ROOT), "WAL_ENGINE_LOG_FORMAT": "json"}


@pytest.mark.timeout(60)
async def test_a_worker_started_during_an_outage_waits_for_the_database(
        crashable: tuple[TestServer, DatabaseFactory]) -> None:
    """``engine.worker().run(until_idle=True)`` started while the server is down does not
    return as if idle: it waits, logs ``worker_database_ready`` once the server is back,
    runs the queued task and then returns."""
    server, factory = crashable
    dsn = await factory.create()
    engine = await connect(dsn, migrate=False, development=True)
    register(engine)
    task_id = await engine.submit("steps", {"steps": 2})
    try:
        with capture_logs() as logs:
            await _stop(server)
            worker = engine.worker(concurrency=1, lease_ttl_ms=3000, heartbeat_ms=500,
                                   poll_ms=100, sweep_ms=200)
            running = asyncio.ensure_future(worker.run(until_idle=True))
            await asyncio.wait({running}, timeout=1.5)
            assert not running.done() and not worker.database_ready
            await _start(server)
            await asyncio.wait_for(running, 30)
        assert worker.database_ready and worker.claimed == 1
        assert (await engine.head(task_id)).status.value == "COMPLETED"
        events = [entry["event"] for entry in logs]
        assert events.count("worker_database_ready") == 1
        assert events.count("worker_database_unavailable") == 1, events
        assert not _errors_at_error_level(logs)
    finally:
        await _start(server)
        await asyncio.wait_for(engine.close(), 20)


def _cli_worker_command(dsn: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "wal_engine.cli", "worker", "--agents",
            "tests.integration.test_cli_agents:register", "--concurrency", "2",
            "--lease-ttl-ms", "3000", "--heartbeat-ms", "500", "--poll-ms", "100",
            "--development", "--dsn", dsn, *extra]


@pytest.mark.timeout(120)
async def test_the_cli_worker_waits_for_the_database(
        crashable: tuple[TestServer, DatabaseFactory]) -> None:
    """``wal-engine worker --wait-for-db`` started while the server is down waits for it
    (``database_waiting``), says when it is ready (``database_ready``,
    ``worker_database_ready``) and runs a task; with nothing to wait for it exits 4 only
    after the wait. Its log is JSON lines only: no traceback."""
    server, factory = crashable
    dsn = await factory.create()
    refused = with_hosts(dsn, [free_port()])
    started = time.monotonic()
    gone = await asyncio.to_thread(
        subprocess.run, _cli_worker_command(refused, "--wait-for-db", "1.5"), cwd=ROOT,
        capture_output=True, timeout=60, env={**os.environ, **CLI_ENV})
    assert gone.returncode == 4, gone.stderr.decode()[-2000:]
    assert time.monotonic() - started >= 1.5
    assert b"Traceback" not in gone.stderr
    await _stop(server)
    process = subprocess.Popen(  # noqa: ASYNC220 (started, then awaited on a thread)
        _cli_worker_command(dsn, "--wait-for-db", "60"), cwd=ROOT,
                               env={**os.environ, **CLI_ENV}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    assert process.stderr is not None
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, b"")),
                              daemon=True)
    reader.start()
    try:
        await wait_until(lambda: any(b'"database_waiting"' in line for line in list(lines)),
                         "the worker to wait for the database", 60, 0.05)
        assert process.poll() is None
        await _start(server)
        engine = await connect(dsn, migrate=False, development=True)
        try:
            task_id = await engine.submit("cli-echo", {"q": "hello"})
            state = await engine.wait(task_id, timeout_s=30)
            assert str(state.status) == "COMPLETED"
        finally:
            await engine.close()
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 30)
        await asyncio.to_thread(reader.join, 10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = b"".join(lines)
    assert process.returncode == 0, stderr.decode()[-2000:]
    records = [orjson.loads(line) for line in stderr.splitlines() if line.strip()]
    events = [record["event"] for record in records]
    assert "database_waiting" in events and "database_ready" in events, events
    assert events.index("database_ready") < events.index("worker_database_ready")
    assert b"Traceback" not in stderr


# ----------------------------------------------------------------------------- logs


@pytest.mark.timeout(60)
async def test_the_drivers_pool_log_is_one_structured_record(database_dsn: str) -> None:
    """asyncpg's pool, failing to reconnect while the database is away, logs "Failed to
    restore the pool connection floor" with a traceback: bridged, it is one record
    (``pool_reconnect_failed``) with the error on one line and no traceback."""
    driver = logging.getLogger("asyncpg")
    before = (list(driver.handlers), driver.propagate)
    assert capture_driver_logs(force=True)
    assert any(isinstance(handler, DriverLogBridge) for handler in driver.handlers)
    assert capture_driver_logs(force=True)  # Once: no second bridge.
    assert sum(isinstance(handler, DriverLogBridge) for handler in driver.handlers) == 1
    proxy = await FaultProxy.for_dsn(database_dsn).start()
    pool = await asyncpg.create_pool(proxy.dsn(database_dsn), min_size=1, max_size=1)
    try:
        with capture_logs() as logs:
            await proxy.close()  # The pooled session is reset, new ones refused.
            await wait_until(lambda: _async_true(any(
                entry["event"] == "pool_reconnect_failed" for entry in logs)),
                "the pool to log its failed reconnect", 15, 0.05)
        record = next(entry for entry in logs if entry["event"] == "pool_reconnect_failed")
        assert record["logger"] == "asyncpg.pool" and record["log_level"] == "warning"
        assert "\n" not in record["error"] and "exc_info" not in record, record
        assert record["error"].startswith(("ConnectionRefusedError", "ConnectionResetError",
                                           "ConnectionDoesNotExistError", "OSError"))
        assert "task_id" not in record
    finally:
        await asyncio.wait_for(pool.close(), 10)
        driver.handlers[:], driver.propagate = before


async def _async_true(value: bool) -> bool:
    return value


@pytest.mark.timeout(60)
async def test_terminated_sessions_are_ridden(database_dsn: str) -> None:
    """``pg_terminate_backend`` on the engine's pooled sessions, mid-statement and
    between statements, for 3 s: asyncpg raises ConnectionDoesNotExistError,
    AdminShutdownError and ``InternalClientError: cannot switch to state 12`` (a session
    the server ended while it was idle); every submit and read is made again on a fresh
    session and returns, none raises."""
    engine = await connect(database_dsn, migrate=False, development=True, pool_size_max=4)
    register(engine)
    admin = await asyncpg.connect(database_dsn)
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + 3.0

    async def calls(worker: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            try:
                task_id = await engine.submit("waits", {"blob": "x" * 50_000},
                                              task_id=f"t{worker}-{n}")
                await engine.history(task_id)
                outcomes["ok"] += 1
            except Exception as error:
                outcomes[type(error).__name__] += 1

    async def terminate() -> int:
        killed = 0
        while time.monotonic() < deadline:
            killed += len(await admin.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                "current_database() AND application_name = 'wal-engine:pool'"))
            await asyncio.sleep(0.01)
        return killed

    try:
        with capture_logs() as logs:
            killed, *_ = await asyncio.gather(terminate(), *(calls(k) for k in range(4)))
    finally:
        await admin.close()
        await asyncio.wait_for(engine.close(), 10)
    causes = Counter(match.group(1) for entry in logs
                     if entry["event"] == "database_unavailable_retrying"
                     for match in [re.search(r"(\w+Error)", entry["error"].split(":", 2)[-1])]
                     if match)
    print(f"\nsessions terminated {killed}, calls {dict(outcomes)}, retried after "
          f"{dict(causes)}")
    assert set(outcomes) == {"ok"}, outcomes
    assert killed > 0 and causes


# ----------------------------------------------------------------------------- DSNs


@pytest.mark.timeout(60)
async def test_multi_host_dsn_serves_every_session_and_hides_its_password(
        database_dsn: str) -> None:
    """A multi-host DSN (a refusing host first, a password that must never be printed):
    connect(), the pool, and a worker's dedicated sessions (heartbeat, sweep, listen) all
    reach the server; the redacted DSN and an outage's error hide the password."""
    from wal_engine.dsn import Dsn

    with_password = Dsn.parse(database_dsn)
    import msgspec

    with_password = msgspec.structs.replace(with_password, password="s3cret-pw")
    port = with_password.ports[0]
    assert port is not None
    multi = with_hosts(with_password.render(), [free_port(), port],
                       target_session_attrs="read-write")
    assert "s3cret-pw" not in redact_dsn(multi) and redact_dsn(multi).count("127.0.0.1") == 2
    engine = await connect(multi, migrate=False, development=True)
    register(engine)
    try:
        worker = engine.worker(concurrency=1, lease_ttl_ms=3000, heartbeat_ms=500,
                               poll_ms=100, sweep_ms=200)
        running = asyncio.ensure_future(worker.run())
        task_id = await engine.submit("steps", {"steps": 2})
        assert (await engine.wait(task_id, timeout_s=30)).output == 1
        admin = await asyncpg.connect(database_dsn)
        try:
            names = {row["application_name"] for row in await admin.fetch(
                "SELECT application_name FROM pg_stat_activity "
                "WHERE datname = current_database()")}
        finally:
            await admin.close()
        for role in ("heartbeat", "sweep", "listen"):
            assert f"wal-engine:{worker.worker_id}:{role}" in names, names
        worker.stop()
        await asyncio.wait_for(running, 30)
    finally:
        await engine.close()
    nowhere = with_hosts(with_password.render(), [free_port(), free_port()])
    with pytest.raises(DatabaseUnavailable) as raised:
        await connect(nowhere, migrate=False, development=True)
    assert "s3cret-pw" not in str(raised.value)


@pytest.mark.timeout(60)
async def test_a_silent_first_host_does_not_hide_the_next_one(
        database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-host DSN whose first host accepts the TCP connection and then says nothing
    (a lost node behind a load balancer, a partition): asyncpg's timeout covers the whole
    host list, so that host took all of it and the next was never tried. Each host now has
    the timeout to itself, and the host that answered is tried first afterwards: connect()
    succeeds after one timeout, and the worker's sessions and the pool's next connections
    go straight to the answering host."""
    from wal_engine.dsn import Dsn
    from wal_engine.store.connection import connect_once

    monkeypatch.setattr(limits, "connect_timeout_s", 1.0)
    silent = await FaultProxy.for_dsn(database_dsn).start()
    silent.set("blackhole")
    port = Dsn.parse(database_dsn).ports[0]
    assert port is not None
    multi = with_hosts(database_dsn, [silent.port, port], target_session_attrs="read-write")
    try:
        started = time.monotonic()
        engine = await connect(multi, migrate=False, development=True)
        first_s = time.monotonic() - started
        try:
            started = time.monotonic()
            session = await connect_once(multi)
            again_s = time.monotonic() - started
            await session.close()
            assert await engine.submit("waits", None, task_id="through") == "through"
        finally:
            await engine.close()
    finally:
        await silent.close()
    print(f"\nconnect() past a silent first host {first_s:.2f} s, the next session "
          f"{again_s:.3f} s")
    assert 0.9 <= first_s < 5.0
    assert again_s < 0.5
