"""Commands that run things: ``worker``, ``replay``, ``timeline``, ``migrate``, ``demo``,
``bench``."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, NoReturn

import click
import msgspec

from wal_engine.cli.common import (
    EXIT_DATABASE,
    EXIT_FINDING,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CliError,
    console,
    development_option,
    dsn_option,
    emit,
    fail,
    install_agents,
    json_option,
    open_engine,
    open_reader,
    progress,
    read_only_dsn,
    replica_option,
    run,
)
from wal_engine.errors import ConfigurationError, SchemaMismatch
from wal_engine.runtime.replayer import DeployCheck, ReplayReport, replay_timeout_s_default

WAIT_FOR_DB_S_DEFAULT: Final = 60.0
"""How long ``wal-engine worker`` waits for a database that is away at start: a worker
started with (or before) its database, or during a failover, comes up with it instead of
exiting (a Patroni failover takes 10-30 s)."""
BENCHMARK_SUITE: Final = "benchmarks.suite"
"""The side-by-side suite (``python -m benchmarks``), at the repository root, not in the wheel."""


@click.command()
@click.option("--agents", "agents_spec", required=True, metavar="MODULE:ATTR",
              help="A function registering agents on an Engine (register(engine)), or a "
                   "mapping of agent names to agent functions.")
@click.option("--concurrency", type=click.IntRange(1, 10_000), default=8, show_default=True,
              help="Most tasks run at once.")
@click.option("--worker-id", default=None, help="Default: host-pid-random.")
@click.option("--lease-ttl-ms", type=click.IntRange(100), default=None,
              help="Lease time to live (default 45000).")
@click.option("--heartbeat-ms", type=click.IntRange(10), default=None,
              help="Lease renewal interval, at most a third of the TTL (default 15000).")
@click.option("--poll-ms", type=click.IntRange(10), default=None,
              help="Fallback claim interval (default 1000).")
@click.option("--sweep-ms", type=click.IntRange(10), default=None,
              help="Longest wait between two sweeps for expired leases (default 5000).")
@click.option("--drain-timeout-s", type=click.FloatRange(0), default=None,
              help="How long a graceful stop waits for runs to reach a durable point "
                   "(default 30).")
@click.option("--recovery-attempts-max", type=click.IntRange(1), default=None,
              help="Claims of a task whose runs were lost before it is dead-lettered "
                   "(default 20).")
@click.option("--sync-threads", type=click.IntRange(0), default=None,
              help="Threads running plain `def` tools and LLM functions (default 0: the "
                   "concurrency plus 4).")
@click.option("--stall-warn-ms", type=click.IntRange(1), default=None,
              help="An event loop stalled this long is logged with the code it is stuck in "
                   "(default 1000).")
@click.option("--stall-abandon-ms", type=click.IntRange(1), default=None,
              help="An event loop stalled this long stops renewing its leases, so other "
                   "workers take its tasks over; at least the lease TTL (default 600000).")
@click.option("--until-idle", is_flag=True,
              help="Return once no task is running and none is due.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              envvar="WAL_ENGINE_METRICS_PORT",
              help="Serve Prometheus metrics on this port (needs the metrics extra).")
@click.option("--metrics-addr", default="0.0.0.0", show_default=True,
              help="Address the metrics server binds.")
@click.option("--wait-for-db", "wait_for_db_s", type=click.FloatRange(0),
              default=WAIT_FOR_DB_S_DEFAULT, envvar="WAL_ENGINE_WAIT_FOR_DB",
              metavar="SECONDS", show_default=True,
              help="Wait up to SECONDS for a database that is away at start (refused, "
                   "unanswered, starting up, failing over), with bounded backoff, logging "
                   "database_waiting, then database_ready; past it, exit 4. A wrong "
                   "password or database name exits 4 at once. 0: no wait.")
@dsn_option
@development_option
def worker(agents_spec: str, concurrency: int, worker_id: str | None, lease_ttl_ms: int | None,
           heartbeat_ms: int | None, poll_ms: int | None, sweep_ms: int | None,
           drain_timeout_s: float | None, recovery_attempts_max: int | None,
           sync_threads: int | None, stall_warn_ms: int | None, stall_abandon_ms: int | None,
           until_idle: bool, metrics_port: int | None, metrics_addr: str,
           wait_for_db_s: float, dsn: str | None) -> None:
    """Run a worker for the agents of MODULE:ATTR until SIGTERM (then hand tasks back)."""
    timings = {name: value for name, value in (("lease_ttl_ms", lease_ttl_ms),
                                               ("heartbeat_ms", heartbeat_ms),
                                               ("poll_ms", poll_ms), ("sweep_ms", sweep_ms),
                                               ("drain_timeout_s", drain_timeout_s),
                                               ("sync_threads", sync_threads),
                                               ("stall_warn_ms", stall_warn_ms),
                                               ("stall_abandon_ms", stall_abandon_ms))
               if value is not None}
    engine_options: dict[str, Any] = ({} if recovery_attempts_max is None
                                      else {"recovery_attempts_max": recovery_attempts_max})
    if wait_for_db_s > 0:
        engine_options["connect_wait_s"] = wait_for_db_s
    run(_worker(agents_spec, concurrency, worker_id, timings, until_idle, metrics_port,
                metrics_addr, dsn, engine_options), dsn=dsn, log_level="info")


async def _run_worker(runner: Any, until_idle: bool) -> None:
    """Run the worker; SIGTERM and Ctrl-C drain it, a second Ctrl-C stops it at once."""
    from wal_engine.cli.stopping import StopHandlers

    running = asyncio.create_task(runner.run(until_idle=until_idle))
    # Signal handlers need the main thread (a test runner may call us from another).
    if threading.current_thread() is not threading.main_thread():
        await running
        return
    handlers = StopHandlers(runner, running)
    handlers.install()
    try:
        await running
    except asyncio.CancelledError:
        if not handlers.forced:
            raise
        if runner.sync_calls_running():
            _exit_now(runner.sync_calls_running())
        raise CliError("interrupted: stopped before the drain ended", EXIT_INTERRUPTED) from None
    finally:
        handlers.remove()


def _exit_now(running: int) -> NoReturn:
    """End the process at once, with the threads of its sync calls: Python would otherwise
    wait for them before exiting, and a thread could act after the lease it ran under
    lapsed. Dying with it is a crash, which the next owner handles (the call is in doubt,
    escalated with the reconcile grace or looked up)."""
    try:
        fail(f"interrupted: stopped before the drain ended; {running} sync call(s) still "
             "running end with the process", EXIT_INTERRUPTED)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)


async def _worker(agents_spec: str, concurrency: int, worker_id: str | None,
                  timings: dict[str, Any], until_idle: bool, metrics_port: int | None,
                  metrics_addr: str, dsn: str | None, engine_options: dict[str, Any]
                  ) -> None:
    from wal_engine.observability import metrics

    server = None if metrics_port is None else metrics.serve(metrics_port, metrics_addr)
    try:
        async with open_engine(dsn, write=True, **engine_options) as engine:
            await install_agents(engine, agents_spec)
            try:
                runner = engine.worker(concurrency=concurrency, worker_id=worker_id, **timings)
            except (ValueError, ConfigurationError) as error:
                raise CliError(f"worker settings: {error}", EXIT_USAGE) from error
            await _run_worker(runner, until_idle)
    finally:
        if server is not None:
            await asyncio.to_thread(server.shutdown)
            server.server_close()


@click.command()
@click.argument("task_id", metavar="[TASK]", required=False)
@click.option("--all", "all_tasks", is_flag=True,
              help="The deploy gate: every live task and a sample of finished ones.")
@click.option("--since", type=click.DateTime(), default=None,
              help="With --all: only tasks updated at or after this time (UTC).")
@click.option("--finished", "finished_sample", type=click.IntRange(0, 10_000), default=20,
              show_default=True, help="With --all: how many recently finished tasks too.")
@click.option("--agents", "agents_spec", required=True, metavar="MODULE:ATTR",
              help="Today's agents (as for `worker`).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1), show_default=True,
              default=replay_timeout_s_default, help="Longest the code may run, in seconds.")
@dsn_option
@development_option
@json_option
def replay(task_id: str | None, all_tasks: bool, since: dt.datetime | None,
           finished_sample: int, agents_spec: str, timeout_s: float, dsn: str | None,
           as_json: bool) -> None:
    """Re-run today's agent code against TASK's recorded history (or, with --all, every
    live task's: the check before a deploy); report the first non-determinism (exit 1).
    Nothing is called and nothing is written."""
    if (task_id is None) == (not all_tasks):
        raise click.UsageError("give a TASK or --all (not both)")
    if all_tasks:
        check = run(_replay_all(agents_spec, since, finished_sample, timeout_s, dsn, as_json),
                    dsn=dsn)
        if not check.ok:
            raise SystemExit(EXIT_FINDING)
        return
    assert task_id is not None
    report = run(_replay(task_id, agents_spec, timeout_s, dsn), dsn=dsn)
    if as_json:
        emit({**msgspec.to_builtins(report), "ok": report.ok})
    else:
        _print_replay(report)
    if not report.ok:
        raise SystemExit(EXIT_FINDING)


async def _replay(task_id: str, agents_spec: str, timeout_s: float,
                  dsn: str | None) -> ReplayReport:
    from wal_engine.runtime.replayer import check_history
    from wal_engine.store.connection import resolve_dsn

    # Every transaction of this session is read-only: even a bug cannot write.
    async with open_engine(read_only_dsn(await resolve_dsn(dsn))) as engine:
        await install_agents(engine, agents_spec)
        with progress() as bars:
            return await check_history(engine, task_id, timeout_s=timeout_s,
                                       on_progress=bars.update)


async def _replay_all(agents_spec: str, since: dt.datetime | None, finished_sample: int,
                      timeout_s: float, dsn: str | None, as_json: bool) -> DeployCheck:
    from wal_engine.runtime.replayer import check_tasks
    from wal_engine.store.connection import resolve_dsn

    def each(report: ReplayReport) -> None:
        if as_json:
            emit({**msgspec.to_builtins(report), "ok": report.ok})
        elif not report.ok:
            _print_replay(report)

    after = None if since is None else since.replace(tzinfo=dt.UTC)
    async with open_engine(read_only_dsn(await resolve_dsn(dsn))) as engine:
        await install_agents(engine, agents_spec)
        check = await check_tasks(engine, since=after, finished_sample=finished_sample,
                                  timeout_s=timeout_s, on_task=each)
    summary_line = (f"{check.checked} task(s) replayed ({check.live} live, {check.finished} "
                    f"finished), {len(check.divergent)} divergent, {check.skipped} skipped "
                    "(agent or version this code does not run)")
    if as_json:
        emit({"checked": check.checked, "live": check.live, "finished": check.finished,
              "skipped": check.skipped, "divergent": [r.task_id for r in check.divergent],
              "ok": check.ok})
    else:
        console().print(("ok: " if check.ok else "[red]NOT SAFE TO DEPLOY[/]: ") + summary_line)
    return check


def _print_replay(report: ReplayReport) -> None:
    out = console()
    out.print(f"task {report.task_id} (agent {report.agent}, {report.recorded_status}): "
              f"{report.events} events, {report.calls_replayed} of {report.calls_recorded} "
              f"recorded calls replayed")
    divergence = report.divergence
    if divergence is not None:
        out.print(f"[red]NON-DETERMINISM[/] ({divergence.kind}) at seq {divergence.seq}: "
                  f"{divergence.detail}")
        out.print(f"fork point: `wal-engine fork {report.task_id} --at {divergence.fork_point}`")
        return
    if report.outcome == "timed_out":
        out.print(f"[red]timed out[/]: {report.error}")
        return
    if report.outcome == "reached_end":
        out.print(f"ok: today's code matches the whole history; it stops at {report.stopped_at}")
    elif report.outcome == "completed":
        same = {True: "; same output", False: "; [yellow]different output[/]", None: ""}
        out.print(f"ok: today's code matches the history and returns"
                  f"{same[report.output_matches]}")
    else:
        out.print(f"ok: today's code matches the history, then raises {report.error}")


def _check_html_path(_context: click.Context, _parameter: click.Parameter,
                     value: Path) -> Path:
    parent = value.expanduser().resolve().parent
    if not parent.is_dir():
        raise click.BadParameter(f"directory {str(parent)!r} does not exist")
    return value


@click.command()
@click.argument("task_id", metavar="TASK")
@click.option("--html", "html_path", required=True, type=click.Path(dir_okay=False,
              writable=True, path_type=Path), callback=_check_html_path,
              help="The HTML file to write (its directory must exist).")
@click.option("--from", "from_seq", type=click.IntRange(1), default=1, help="First seq drawn.")
@click.option("--to", "to_seq", type=click.IntRange(1), default=None, help="Last seq drawn.")
@dsn_option
@replica_option
@development_option
@json_option
def timeline(task_id: str, html_path: Path, from_seq: int, to_seq: int | None,
             dsn: str | None, replica: str | None, as_json: bool) -> None:
    """Write TASK's life as a self-contained HTML timeline (click an event for its payload)."""
    events = run(_timeline(task_id, html_path, from_seq, to_seq, dsn, replica, as_json),
                 dsn=replica or dsn)
    if as_json:
        emit({"task_id": task_id, "file": str(html_path), "events": events})
    else:
        console().print(f"timeline of {task_id} ({events} events) written to {html_path}")


async def _timeline(task_id: str, html_path: Path, from_seq: int, to_seq: int | None,
                    dsn: str | None, replica: str | None, as_json: bool) -> int:
    from wal_engine.audit.timeline import write_timeline

    async with open_reader(dsn, replica, as_json=as_json) as engine:
        return await write_timeline(engine.store, task_id, html_path, from_seq=from_seq,
                                    to_seq=to_seq)


@click.command()
@dsn_option
@json_option
def migrate(dsn: str | None, as_json: bool) -> None:
    """Apply the wal-engine schema (idempotent; refuses a newer schema)."""
    result = run(_migrate(dsn), dsn=dsn)
    if as_json:
        emit(result)
        return
    before = result["schema_version_before"]
    was = "no schema" if before is None else f"schema version {before}"
    console().print(f"{result['dsn']}: {was} -> schema version {result['schema_version']}")
    if result["next"]:
        click.echo(f"next: {result['next']}", err=True)


async def _migrate(dsn: str | None) -> dict[str, Any]:
    from wal_engine.cli.setup import missing_roles_hint
    from wal_engine.store.connection import (
        SCHEMA_VERSION,
        _connect_once,
        apply_schema,
        read_schema_version,
        redact_dsn,
        resolve_dsn,
    )

    with progress() as bars:
        bars.update("migrating", 0, 3)
        resolved = await resolve_dsn(dsn)
        connection = await _connect_once(resolved)
        try:
            before = await read_schema_version(connection)
            bars.update("migrating", 1, 3)
            if before is not None and before > SCHEMA_VERSION:
                raise SchemaMismatch(before, SCHEMA_VERSION)
            await apply_schema(connection)
            bars.update("migrating", 2, 3)
            after = await read_schema_version(connection)
            hint = await missing_roles_hint(connection)
            bars.update("migrating", 3, 3)
        finally:
            await connection.close()
    return {"dsn": redact_dsn(resolved), "schema_version_before": before,
            "schema_version": after, "applied": before != after, "next": hint}


@click.command()
@dsn_option
def demo(dsn: str | None) -> None:
    """Run the crash-and-resume demo end to end on the embedded PostgreSQL."""
    from wal_engine.cli.demo_show import run_demo

    if not run(run_demo(dsn=dsn), dsn=dsn):
        raise SystemExit(EXIT_FINDING)


@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("arguments", nargs=-1, type=click.UNPROCESSED)
def bench(arguments: tuple[str, ...]) -> None:
    """Run the benchmark suite side by side, as `python -m benchmarks ARGS` (from a checkout
    of the repository; `wal-engine bench --help` lists its options: --quick, --dsn, ...)."""
    entry = _benchmark_entry()
    saved = sys.argv
    sys.argv = ["wal-engine bench", *arguments]
    try:
        entry()  # Parses sys.argv like `python -m benchmarks`; exits with the suite's code.
    finally:
        sys.argv = saved


def _benchmark_entry() -> Callable[[], None]:
    """The suite's entry point, imported on demand (it pulls in the peers' harness)."""
    hint = ("the benchmark suite lives in the repository (benchmarks/), not in the wheel: "
            "run `wal-engine bench` from an editable install of a checkout "
            "(pip install -e '.[bench]')")
    try:
        suite = importlib.import_module(BENCHMARK_SUITE)
    except ModuleNotFoundError as error:
        if error.name in ("benchmarks", BENCHMARK_SUITE):
            fail(f"cannot import {BENCHMARK_SUITE}: {hint}", EXIT_DATABASE)
        fail(f"the benchmark suite needs module {error.name!r}: pip install -e '.[bench]'",
             EXIT_DATABASE)
    entry: Callable[[], None] | None = getattr(suite, "entry", None)
    if entry is None or not callable(entry):
        fail(f"{BENCHMARK_SUITE} ({getattr(suite, '__file__', '?')}) has no entry(): {hint}",
             EXIT_DATABASE)
    return entry
