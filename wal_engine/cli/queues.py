"""Queue commands: ``queues`` (depth, running, limits, oldest wait), ``queue set``, ``queue
history`` (the audited changes of limits)."""

from __future__ import annotations

import getpass
from typing import Any

import click
from rich.table import Table

from wal_engine.cli.common import (
    EXIT_USAGE,
    CliError,
    console,
    development_option,
    dsn_option,
    emit,
    json_option,
    open_engine,
    run,
)


def parse_limit(value: str | None, option: str) -> Any:
    """``--concurrency`` and ``--worker-concurrency``: an int, ``none`` (remove), or not
    given (unchanged). The range is the engine's to check (a typed error, exit 2)."""
    from wal_engine.store.queues import UNCHANGED

    if value is None:
        return UNCHANGED
    if value.strip().lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise CliError(f"{option} must be an integer or 'none', not {value!r}",
                       EXIT_USAGE) from None


def _requester() -> str | None:
    """The operating-system user, recorded with each change (None if it cannot be told)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


@click.command()
@dsn_option
@development_option
@json_option
def queues(dsn: str | None, as_json: bool) -> None:
    """Show each queue: depth, running, limits, oldest wait."""
    run(_queues(dsn, as_json), dsn=dsn)


async def _queues(dsn: str | None, as_json: bool) -> None:
    async with open_engine(dsn) as engine:
        stats = await engine.queues()
    if as_json:
        for item in stats:
            emit({"queue": item.queue, "configured": item.configured, "depth": item.depth,
                  "running": item.running, "waiting": item.waiting,
                  "concurrency_max": item.concurrency_max,
                  "worker_concurrency_max": item.worker_concurrency_max,
                  "oldest_wait_s": item.oldest_wait_s})
        return
    table = Table(title=f"{len(stats)} queue(s)")
    for column in ("queue", "depth", "running", "waiting", "limit", "per worker",
                   "oldest wait"):
        table.add_column(column, justify="left" if column == "queue" else "right")
    for item in stats:
        table.add_row(item.queue, str(item.depth), str(item.running), str(item.waiting),
                      _limit(item.concurrency_max), _limit(item.worker_concurrency_max),
                      "-" if item.oldest_wait_s is None else f"{item.oldest_wait_s:.1f} s")
    console().print(table)


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


@click.group()
def queue() -> None:
    """Configure queues (limits are stored in the database and audited)."""


@queue.command("set")
@click.argument("name")
@click.option("--concurrency", default=None, metavar="N|none",
              help="Running tasks of the queue across every worker (none: no limit).")
@click.option("--worker-concurrency", default=None, metavar="N|none",
              help="Running tasks of the queue in one worker (none: no limit).")
@dsn_option
@development_option
@json_option
def queue_set(name: str, concurrency: str | None, worker_concurrency: str | None,
              dsn: str | None, as_json: bool) -> None:
    """Create queue NAME or change its limits (a limit not given is left as it is)."""
    run(_queue_set(name, concurrency, worker_concurrency, dsn, as_json), dsn=dsn)


async def _queue_set(name: str, concurrency: str | None, worker_concurrency: str | None,
                     dsn: str | None, as_json: bool) -> None:
    limit = parse_limit(concurrency, "--concurrency")
    worker_limit = parse_limit(worker_concurrency, "--worker-concurrency")
    async with open_engine(dsn, write=True) as engine:
        result = await engine.set_queue(name, concurrency_max=limit,
                                        worker_concurrency_max=worker_limit,
                                        requested_by=_requester())
    if as_json:
        emit({"queue": result.queue, "concurrency_max": result.concurrency_max,
              "worker_concurrency_max": result.worker_concurrency_max,
              "created": result.created, "changed": result.changed})
        return
    what = "created" if result.created else "changed" if result.changed else "unchanged"
    console().print(f"queue {result.queue} {what}: limit {_limit(result.concurrency_max)}, "
                    f"per worker {_limit(result.worker_concurrency_max)}")


@queue.command("history")
@click.argument("name", required=False)
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@dsn_option
@development_option
@json_option
def queue_history(name: str | None, limit: int, dsn: str | None, as_json: bool) -> None:
    """The audited changes of queue NAME's limits (every queue's without NAME)."""
    run(_queue_history(name, limit, dsn, as_json), dsn=dsn)


async def _queue_history(name: str | None, limit: int, dsn: str | None, as_json: bool) -> None:
    async with open_engine(dsn) as engine:
        changes = await engine.queue_changes(name, limit=limit)
    if as_json:
        for change in changes:
            emit({"change_id": change.change_id, "queue": change.queue,
                  "changed_at": change.changed_at, "changed_by": change.changed_by,
                  "requested_by": change.requested_by, "before": change.before,
                  "after": change.after})
        return
    table = Table(title=f"{len(changes)} change(s)")
    for column in ("when", "queue", "by", "requested by", "before", "after"):
        table.add_column(column)
    for change in changes:
        table.add_row(change.changed_at.isoformat(timespec="seconds"), change.queue,
                      change.changed_by, change.requested_by or "-",
                      "-" if change.before is None else _limits_text(change.before),
                      _limits_text(change.after))
    console().print(table)


def _limits_text(limits: dict[str, Any]) -> str:
    return (f"limit {_limit(limits.get('concurrency_max'))}, "
            f"per worker {_limit(limits.get('worker_concurrency_max'))}")
