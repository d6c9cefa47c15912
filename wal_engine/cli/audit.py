"""Reading commands: ``tasks``, ``history``, ``show``, ``verify`` (``--anchor``: see
:mod:`wal_engine.cli.anchoring`). None of them writes; each reads a streaming standby
instead of the primary with ``--replica DSN`` (:func:`wal_engine.cli.common.open_reader`),
and then first says how far behind it is."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Final

import click
from rich.table import Table

from wal_engine import limits
from wal_engine.audit.anchor import load_public_key
from wal_engine.chain import VerifyReport
from wal_engine.cli.anchoring import check_anchor, read_anchor_file, read_key
from wal_engine.cli.common import (
    EXIT_FINDING,
    console,
    development_option,
    dsn_option,
    emit,
    json_option,
    open_reader,
    progress,
    replica_option,
    run,
    short_hash,
)
from wal_engine.cli.render import (
    event_json,
    head_json,
    state_json,
    summary,
    verify_json,
)
from wal_engine.cli.retention import check_archive
from wal_engine.state_machine import Status
from wal_engine.store import Store

COUNT_TASKS: Final = """
SELECT count(*) AS tasks FROM wal_tasks WHERE tenant = current_setting('wal.tenant', true)
"""
verify_page_tasks: Final = 500
verify_concurrency: Final = 4
"""Tasks verified at once (each holds one pooled connection while it streams its log)."""
messages_shown_max: Final = 20
by_version_rows_max: Final = 10_000


@click.command()
@click.option("--status", type=click.Choice([s.value for s in Status], case_sensitive=False),
              help="Only tasks with this status.")
@click.option("--agent", default=None, help="Only tasks of this agent.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True,
              help="Most tasks listed.")
@click.option("--after", "after_task_id", default="", metavar="TASK",
              help="List tasks whose id sorts after TASK (paging).")
@click.option("--by-version", is_flag=True,
              help="Count tasks by agent, agent version and status instead (what still "
                   "runs on each version during a deploy).")
@dsn_option
@replica_option
@development_option
@json_option
def tasks(status: str | None, agent: str | None, limit: int, after_task_id: str,
          by_version: bool, dsn: str | None, replica: str | None, as_json: bool) -> None:
    """List tasks (ordered by id), optionally filtered by status and agent."""
    if by_version:
        run(_tasks_by_version(dsn, replica, as_json), dsn=replica or dsn)
        return
    run(_tasks(status, agent, limit, after_task_id, dsn, replica, as_json),
        dsn=replica or dsn)


async def _tasks_by_version(dsn: str | None, replica: str | None, as_json: bool) -> None:
    from wal_engine.store import queries

    async with open_reader(dsn, replica, as_json=as_json) as engine:
        rows = await engine.database.fetch(queries.TASKS_BY_VERSION, by_version_rows_max,
                                           [status.value for status in Status])
    if as_json:
        for row in rows:
            emit({"agent": row["agent"], "agent_version": row["agent_version"],
                  "status": row["status"], "tasks": row["tasks"]})
        return
    table = Table(title="tasks by agent version")
    for column in ("agent", "version", "status", "tasks"):
        table.add_column(column, justify="right" if column == "tasks" else "left")
    for row in rows:
        table.add_row(row["agent"], row["agent_version"] or "(not pinned yet)", row["status"],
                      str(row["tasks"]))
    console().print(table)


async def _tasks(status: str | None, agent: str | None, limit: int, after_task_id: str,
                 dsn: str | None, replica: str | None, as_json: bool) -> None:
    async with open_reader(dsn, replica, as_json=as_json) as engine:
        heads = await engine.store.list_tasks(
            status=None if status is None else status.upper(), agent=agent,
            after_task_id=after_task_id, limit=limit)
    if as_json:
        for head in heads:
            emit(head_json(head))
        return
    table = Table(title=f"{len(heads)} task(s)")
    for column in ("task", "agent", "status", "seq", "epoch", "owner", "attempts", "updated"):
        table.add_column(column, no_wrap=column in ("task", "status"))
    for head in heads:
        table.add_row(head.task_id, head.agent, str(head.status), str(head.head_seq),
                      str(head.lease_epoch), head.lease_owner or "", str(head.attempts),
                      head.updated_at.strftime("%Y-%m-%d %H:%M:%S"))
    out = console()
    out.print(table)
    if len(heads) == limit:
        out.print(f"more may follow: --after {heads[-1].task_id}")


@click.command()
@click.argument("task_id", metavar="TASK")
@click.option("--from", "from_seq", type=click.IntRange(1), default=1, show_default=True,
              help="First seq shown.")
@click.option("--to", "to_seq", type=click.IntRange(1), default=None, help="Last seq shown.")
@dsn_option
@replica_option
@development_option
@json_option
def history(task_id: str, from_seq: int, to_seq: int | None, dsn: str | None,
            replica: str | None, as_json: bool) -> None:
    """Print a task's events in seq order (streamed page by page)."""
    run(_history(task_id, from_seq, to_seq, dsn, replica, as_json), dsn=replica or dsn)


async def _history(task_id: str, from_seq: int, to_seq: int | None, dsn: str | None,
                   replica: str | None, as_json: bool) -> None:
    async with open_reader(dsn, replica, as_json=as_json) as engine:
        head = await engine.store.read_head(task_id)
        last = head.head_seq if to_seq is None else min(to_seq, head.head_seq)
        out = console()
        page: list[Any] = []
        first_page = True
        async for record in engine.store.stream_events(task_id, from_seq=from_seq,
                                                       to_seq=last):
            if as_json:
                emit(event_json(record))
                continue
            page.append(record)
            if len(page) == limits.read_page_events:
                out.print(_history_table(page, show_header=first_page))
                page, first_page = [], False
        if page or (first_page and not as_json):
            out.print(_history_table(page, show_header=first_page))


def _history_table(records: list[Any], *, show_header: bool) -> Table:
    table = Table(box=None, show_header=show_header, pad_edge=False)
    table.add_column("seq", justify="right", min_width=5)
    table.add_column("epoch", justify="right", min_width=5)
    table.add_column("recorded at", min_width=23, no_wrap=True)
    table.add_column("type", min_width=22, no_wrap=True)
    table.add_column("what")
    for record in records:
        stamp = "" if record.recorded_at is None else \
            record.recorded_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        table.add_row(str(record.seq), str(record.epoch), stamp, record.type, summary(record))
    return table


@click.command()
@click.argument("task_id", metavar="TASK")
@dsn_option
@replica_option
@development_option
@json_option
def show(task_id: str, dsn: str | None, replica: str | None, as_json: bool) -> None:
    """Show a task's folded state: messages, step, pending calls, usage, what it waits on."""
    run(_show(task_id, dsn, replica, as_json), dsn=replica or dsn)


async def _show(task_id: str, dsn: str | None, replica: str | None, as_json: bool) -> None:
    async with open_reader(dsn, replica, as_json=as_json) as engine:
        head = await engine.head(task_id)
        state = await engine.state(task_id)
    view = state_json(state, head)
    if as_json:
        emit(view)
        return
    out = console()
    out.print(f"[bold]task[/] {view['task_id']}  agent {view['agent']}  "
              f"status [bold]{view['status']}[/]  step {view['step']}  seq {view['last_seq']}  "
              f"attempts {view['attempts']}")
    if view["parent_task_id"]:
        out.print(f"forked from {view['parent_task_id']} at seq {view['parent_seq']}")
    owner = view["lease_owner"] or "none"
    out.print(f"lease: owner {owner}, epoch {view['lease_epoch']}, "
              f"expires {view['lease_expires_at'] or '-'}")
    usage = view["usage"]
    out.print(f"usage: {usage['input_tokens']} input + {usage['output_tokens']} output tokens, "
              f"${usage['cost_usd']:.4f}, {usage['tool_calls']} tool call(s), "
              f"{usage['llm_calls']} LLM call(s); {view['calls']} call(s) journaled")
    budget = {key: value for key, value in view["budget"].items() if value is not None}
    out.print(f"budget: {_pairs(budget) or 'unlimited'}")
    if view["budget_exceeded"]:
        out.print(f"[red]budget exceeded[/]: {_pairs(view['budget_exceeded'])}")
    if view["status"] not in ("COMPLETED", "FAILED"):
        out.print(f"next action: {_plain(view['next_action'])}")
    out.print(f"waiting on: {_pairs(view['waiting_on']) if view['waiting_on'] else 'nothing'}")
    _print_messages(out, view["messages"])
    _print_pending(out, view["pending_calls"])
    for call_id, approval in view["approvals"].items():
        out.print(f"approval {call_id}: {_pairs(approval)}")
    if view["plan"]:
        done = set(view["plan_completed"])
        nodes = ", ".join(f"{node}{' (done)' if node in done else ''}" for node in view["plan"])
        out.print(f"plan: {nodes}")
    if view["env"]:
        out.print(f"env: {_pairs(view['env'])}")
    if view["status"] == "COMPLETED":
        out.print(f"output: {_plain(view['output'])}")
    if view["failure"]:
        out.print(f"[red]failure[/]: {_pairs(view['failure'])}")


def _print_messages(out: Any, messages: list[dict[str, Any]]) -> None:
    if not messages:
        out.print("messages: none")
        return
    shown = messages[-messages_shown_max:]
    cut = "" if len(shown) == len(messages) else f", last {len(shown)} shown"
    table = Table(title=f"messages ({len(messages)}{cut})", title_justify="left")
    table.add_column("role")
    table.add_column("content")
    for message in shown:
        table.add_row(message["role"], _plain(message["content"]))
    out.print(table)


def _print_pending(out: Any, pending: list[dict[str, Any]]) -> None:
    if not pending:
        out.print("pending calls: none")
        return
    table = Table(title="pending calls (in doubt)", title_justify="left")
    for column in ("call", "kind", "name", "seq", "attempt", "status", "idempotency key"):
        table.add_column(column)
    for call in pending:
        table.add_row(call["call_id"], call["kind"], call["name"], str(call["seq"]),
                      str(call.get("attempt", 1)), call.get("status", "pending"),
                      call.get("idempotency_key") or "")
    out.print(table)


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{key}={_plain(value)}" for key, value in values.items())


def _plain(value: Any) -> str:
    import orjson

    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= 200 else text[:197] + "..."


@click.command()
@click.argument("task_id", metavar="[TASK]", required=False)
@click.option("--all", "all_tasks", is_flag=True, help="Verify every task.")
@click.option("--anchor", "anchor_path", metavar="FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Check the database against an anchor (`wal-engine anchor`): a truncated "
                   "tail, a rewritten chain, a lost task. Alone, it also verifies the chains "
                   "of the anchored tasks; with TASK or --all, the chains of those.")
@click.option("--archive", "archive_path", metavar="FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Verify a retention archive (`retention run`) offline, without a "
                   "database: every chain, its task lines, its anchor and signature.")
@click.option("--public-key", "public_key_path", metavar="PEM_FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --anchor or --archive: the anchor must be signed by this Ed25519 "
                   "public key.")
@dsn_option
@replica_option
@development_option
@json_option
def verify(task_id: str | None, all_tasks: bool, anchor_path: Path | None,
           archive_path: Path | None, public_key_path: Path | None, dsn: str | None,
           replica: str | None, as_json: bool) -> None:
    """Verify hash chains, contiguous seqs and legal transitions; exit 1 on the first bad seq
    (or, with --anchor, on anything the anchor saw that the database no longer holds; with
    --archive, on anything wrong in the archive)."""
    if archive_path is not None:
        if task_id is not None or all_tasks or anchor_path is not None:
            raise click.UsageError("--archive is verified alone (no TASK, --all or --anchor)")
        public_key = None if public_key_path is None else read_key(
            load_public_key, public_key_path, "--public-key")
        if not check_archive(archive_path, public_key, as_json=as_json):
            raise SystemExit(EXIT_FINDING)
        return
    if task_id is not None and all_tasks:
        raise click.UsageError("name a TASK or pass --all (not both)")
    if anchor_path is None and task_id is None and not all_tasks:
        raise click.UsageError("name a TASK, pass --all, or pass --anchor FILE")
    if public_key_path is not None and anchor_path is None:
        raise click.UsageError("--public-key needs --anchor FILE or --archive FILE")
    ok = run(_verify(task_id, all_tasks, anchor_path, public_key_path, dsn, replica, as_json),
             dsn=replica or dsn)
    if not ok:
        raise SystemExit(EXIT_FINDING)


async def _verify(task_id: str | None, all_tasks: bool, anchor_path: Path | None,
                  public_key_path: Path | None, dsn: str | None, replica: str | None,
                  as_json: bool) -> bool:
    # The anchor and the key are read first: a bad file is reported before connecting.
    anchor = None if anchor_path is None else read_anchor_file(anchor_path)
    public_key = None if public_key_path is None else read_key(load_public_key,
                                                               public_key_path, "--public-key")
    async with open_reader(dsn, replica, as_json=as_json) as engine:
        ok = True
        if anchor is not None and anchor_path is not None:
            chains_named = task_id is not None or all_tasks
            ok = await check_anchor(engine.database, anchor, anchor_path, public_key,
                                    check_chains=not chains_named, as_json=as_json)
        if task_id is not None:
            report = await engine.store.verify_task(task_id)
            _print_verify(report, as_json, single=True)
            return ok and report.ok
        if all_tasks:
            chains_ok = await _verify_all(engine.store, as_json)
            return ok and chains_ok
        return ok


async def _verify_all(store: Store, as_json: bool) -> bool:
    row = await store.database.fetchrow(COUNT_TASKS)
    total = int(row["tasks"])
    checked = failed = events = 0
    after = ""
    limiter = asyncio.Semaphore(verify_concurrency)

    async def one(task: str) -> VerifyReport:
        async with limiter:
            return await store.verify_task(task)

    with progress() as bars:
        bars.update("verifying tasks", 0, total)
        while True:
            heads = await store.list_tasks(after_task_id=after, limit=verify_page_tasks)
            if not heads:
                break
            reports = await asyncio.gather(*(one(head.task_id) for head in heads))
            for report in reports:
                checked, events = checked + 1, events + report.events
                failed += 0 if report.ok else 1
                _print_verify(report, as_json, single=False)
            bars.update("verifying tasks", checked, max(total, checked))
            after = heads[-1].task_id
    for report in await store.verify_orphans(limit=verify_page_tasks):
        failed += 1
        _print_verify(report, as_json, single=False)
    if not as_json:
        verdict = "all ok" if failed == 0 else f"[red]{failed} failed[/]"
        console().print(f"verified {checked} task(s), {events} event(s): {verdict}")
    return failed == 0


def _print_verify(report: VerifyReport, as_json: bool, *, single: bool) -> None:
    if as_json:
        emit(verify_json(report))
        return
    violation = report.violation
    if violation is None:
        if single:
            console().print(f"task {report.task_id}: ok ({report.events} events, head seq "
                            f"{report.head_seq}, hash {short_hash(report.head_hash)})")
        return
    console().print(f"task {report.task_id}: [red]FAILED[/] at seq {violation.seq} "
                    f"({violation.kind}): {violation.detail}")
