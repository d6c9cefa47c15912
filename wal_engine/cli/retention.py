"""``wal-engine retention plan|run`` and the archive half of ``verify --archive`` (see
:mod:`wal_engine.audit.retention` and :mod:`wal_engine.audit.archive`).

Retention is an administrator's command: ``run`` removes rows of the append-only log through
the owner-only path of schema.sql, so its DSN must hold the owner's rights (a superuser, or
a member of the owner role); the security self-test that keeps engines off such roles is
not run. ``plan`` only reads.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import click
from rich.markup import escape

from wal_engine.audit.anchor import load_signing_key
from wal_engine.audit.archive import ArchiveReport, verify_archive
from wal_engine.audit.retention import (
    ENDINGS,
    RetentionBatch,
    RetentionPlan,
    batch_tasks_default,
    batch_tasks_max,
    plan_retention,
    run_retention,
)
from wal_engine.cli.anchoring import read_key
from wal_engine.cli.common import (
    EXIT_USAGE,
    CliError,
    console,
    current_tenant,
    dsn_option,
    emit,
    json_option,
    run,
)
from wal_engine.store import Database

_DURATION: Final = re.compile(r"(\d{1,9})([smhd])")
_UNITS: Final = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(text: str) -> dt.timedelta:
    """``30d``, ``12h``, ``15m`` or ``90s`` as a duration; bad usage otherwise."""
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        raise click.BadParameter(f"{text!r}: a whole number then s, m, h or d (e.g. 30d)")
    return dt.timedelta(**{_UNITS[found[2]]: int(found[1])})


def parse_statuses(text: str) -> list[str]:
    """``COMPLETED,FAILED,CANCELLED`` (any of them) as a list."""
    statuses = [part.strip().upper() for part in text.split(",") if part.strip()]
    bad = [status for status in statuses if status not in ENDINGS]
    if bad or not statuses:
        raise click.BadParameter(f"{text!r}: a comma-separated list of {', '.join(ENDINGS)}")
    return statuses


def _policy(older_than: str | None, before: dt.datetime | None
            ) -> tuple[dt.timedelta | None, dt.datetime | None]:
    if (older_than is None) == (before is None):
        raise click.UsageError("give exactly one of --older-than and --before")
    return (None if older_than is None else parse_duration(older_than)), before


def policy_options(command: Any) -> Any:
    """``--older-than``, ``--before`` and ``--status``."""
    command = click.option("--status", "statuses", default="COMPLETED,FAILED,CANCELLED",
                           show_default=True,
                           help="Endings of the tasks to remove (comma-separated).")(command)
    command = click.option("--before", type=click.DateTime(
        ["%Y-%m-%dT%H:%M:%S.%f%z", "%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"]),
        help="Tasks that finished before this time (UTC unless it names its offset).")(command)
    return click.option("--older-than", metavar="DURATION",
                        help="Tasks that finished longer ago than this (30d, 12h, 15m, "
                             "90s; database clock).")(command)


@asynccontextmanager
async def _administrator(dsn: str | None) -> AsyncIterator[Database]:
    database = await Database.open(dsn, migrate=False, development=True, max_size=2,
                                   min_size=1, tenant=current_tenant())
    try:
        yield database
    finally:
        await database.close()


@click.group()
def retention() -> None:
    """Archive finished tasks older than a policy, then remove them (`plan` reads only)."""


@retention.command("plan")
@policy_options
@dsn_option
@json_option
def plan(older_than: str | None, before: dt.datetime | None, statuses: str, dsn: str | None,
         as_json: bool) -> None:
    """List what `retention run` would remove now: tasks, events, bytes. Changes nothing."""
    ago, cutoff = _policy(older_than, before)
    result = run(_plan(dsn, ago, cutoff, parse_statuses(statuses)), dsn=dsn)
    view = plan_json(result)
    if as_json:
        emit(view)
        return
    statuses_text = ", ".join(f"{count} {name}" for name, count in sorted(
        result.by_status.items())) or "none"
    more = " (more may qualify: the plan stopped at its bound)" if result.truncated else ""
    console().print(f"finished before {view['finished_before']}: {result.tasks} task(s) "
                    f"({statuses_text}), {result.events} event(s), {result.bytes} byte(s)"
                    f"{more}", soft_wrap=True)
    for partition, blocker in result.partitions.items():
        if blocker is None:
            fate = "dropped whole"
        elif "/" in blocker:
            fate = f"kept (rows deleted task by task): task {escape(blocker)} is not archived"
        else:
            fate = f"kept: {escape(blocker)}"
        console().print(f"partition {partition}: {fate}", soft_wrap=True)


async def _plan(dsn: str | None, older_than: dt.timedelta | None, before: dt.datetime | None,
                statuses: list[str]) -> RetentionPlan:
    async with _administrator(dsn) as database:
        return await plan_retention(database, older_than=older_than, before=before,
                                    statuses=statuses)


def plan_json(plan: RetentionPlan) -> dict[str, Any]:
    """The plan as one JSON object."""
    return {"finished_before": plan.finished_before.astimezone(dt.UTC).isoformat(),
            "tasks": plan.tasks, "by_status": plan.by_status, "events": plan.events,
            "bytes": plan.bytes, "truncated": plan.truncated,
            "oldest": None if plan.oldest is None else plan.oldest.isoformat(),
            "newest": None if plan.newest is None else plan.newest.isoformat(),
            "partitions": plan.partitions}


@retention.command("run")
@policy_options
@click.option("--archive", "archive_dir", required=True, metavar="DIR",
              type=click.Path(file_okay=False, path_type=Path),
              help="Directory the archives are written to (one JSON-lines file per batch).")
@click.option("--key", "key_path", metavar="PEM_FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Sign each archive's anchor with this Ed25519 private key (`anchor-keygen`).")
@click.option("--batch", "batch_tasks", type=click.IntRange(1, batch_tasks_max),
              default=batch_tasks_default, show_default=True,
              help="Tasks per archive and per removing transaction.")
@dsn_option
@json_option
def run_command(older_than: str | None, before: dt.datetime | None, statuses: str,
                archive_dir: Path, key_path: Path | None, batch_tasks: int, dsn: str | None,
                as_json: bool) -> None:
    """Archive (fsynced, read back, verified), then remove, the tasks `plan` lists. Needs
    the owner's rights (an administrator's DSN)."""
    ago, cutoff = _policy(older_than, before)
    if not archive_dir.is_dir():
        raise click.BadParameter(f"{archive_dir} is not a directory", param_hint="--archive")
    key = None if key_path is None else read_key(load_signing_key, key_path, "--key")
    batches = run(_run(dsn, archive_dir, ago, cutoff, parse_statuses(statuses), key,
                       batch_tasks), dsn=dsn)
    out = console()
    for batch in batches:
        view = batch_json(batch)
        if as_json:
            emit(view)
            continue
        out.print(f"batch {batch.retention_id}: {batch.tasks} task(s), {batch.events} "
                  f"event(s) archived to {escape(batch.archive)} (sha256 {batch.sha256}, "
                  f"{'signed' if batch.signed else 'unsigned'}) and removed"
                  + (f"; partitions dropped: {', '.join(batch.partitions_dropped)}"
                     if batch.partitions_dropped else ""), soft_wrap=True)
    if not as_json:
        total = sum(batch.tasks for batch in batches)
        out.print(f"retention: {total} task(s) removed in {len(batches)} batch(es)")


async def _run(dsn: str | None, archive_dir: Path, older_than: dt.timedelta | None,
               before: dt.datetime | None, statuses: list[str], key: Any,
               batch_tasks: int) -> list[RetentionBatch]:
    async with _administrator(dsn) as database:
        return await run_retention(database, archive_dir, older_than=older_than,
                                   before=before, statuses=statuses, signing_key=key,
                                   batch_tasks=batch_tasks)


def batch_json(batch: RetentionBatch) -> dict[str, Any]:
    """One batch as one JSON object."""
    return {"retention_id": batch.retention_id, "archive": batch.archive,
            "sha256": batch.sha256, "tasks": batch.tasks, "events": batch.events,
            "signed": batch.signed, "partitions_dropped": batch.partitions_dropped}


def check_archive(path: Path, public_key: bytes | None, *, as_json: bool) -> bool:
    """``verify --archive``: verify the file offline, print the outcome; whether it holds."""
    try:
        report = verify_archive(path, public_key)
    except OSError as error:
        raise CliError(f"cannot read archive {path}: {error.strerror or error}",
                       EXIT_USAGE) from error
    if as_json:
        emit(archive_json(report))
        return report.ok
    out = console()
    for finding in report.findings:
        where = "archive" if finding.task_id is None else f"task {finding.task_id}"
        at = "" if finding.seq is None else f" at seq {finding.seq}"
        out.print(f"{escape(where)}: [red]FAILED[/]{at} ({finding.kind}): "
                  f"{escape(finding.detail)}", soft_wrap=True)
    refused = any(finding.kind == "signature" for finding in report.findings)
    signed = "signature ok" if report.signed else \
        "signature not accepted" if refused else "unsigned"
    verdict = "all ok" if report.ok else f"[red]{len(report.findings)} finding(s)[/]"
    out.print(f"archive {escape(str(path))} ({report.tasks} task(s), {report.events} "
              f"event(s), {signed}): {verdict}", soft_wrap=True)
    return report.ok


def archive_json(report: ArchiveReport) -> dict[str, Any]:
    """An archive's verification as one JSON object."""
    return {"archive": report.path, "ok": report.ok, "tenant": report.tenant,
            "tasks": report.tasks, "events": report.events, "signed": report.signed,
            "findings": [{"task_id": f.task_id, "seq": f.seq, "kind": f.kind,
                          "detail": f.detail} for f in report.findings]}
