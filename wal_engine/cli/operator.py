"""Commands for the person operating tasks: ``pending`` (every task waiting on a human, with
the exact call and its arguments), ``reconcile`` (say what an escalated call really did)
and ``timer fire`` (make a durable sleep due now, for development)."""

from __future__ import annotations

from typing import Any, Final

import click

from wal_engine.cli.common import (
    EXIT_USAGE,
    console,
    development_option,
    dsn_option,
    emit,
    fail,
    json_option,
    open_engine,
    parse_json,
    run,
)
from wal_engine.payloads import decode_payload

pending_tasks_max: Final = 200
shown_chars_max: Final = 400
"""The human listing shows this many characters of a call's arguments."""

WAITING_ON_PEOPLE: Final = """
SELECT task_id, agent, waiting_signal FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true)
   AND status = 'WAITING' AND waiting_signal IS NOT NULL
 ORDER BY updated_at, task_id
 LIMIT $1
"""

FIRE_TIMER: Final = """
UPDATE wal_tasks SET wake_at = now()
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
   AND status = 'WAITING' AND wake_at IS NOT NULL AND waiting_signal IS NULL
RETURNING task_id
"""

APPROVAL_PREFIX: Final = "~approval:"
RECONCILE_PREFIX: Final = "~reconcile:"


def _kind_of(signal: str) -> tuple[str, str | None]:
    """(what the task waits for, the call id) from its waiting signal name."""
    for prefix, kind in ((APPROVAL_PREFIX, "approval"), (RECONCILE_PREFIX, "reconcile")):
        if signal.startswith(prefix):
            return kind, signal.removeprefix(prefix)
    return "signal", None


async def _pending(dsn: str | None) -> list[dict[str, Any]]:
    found = []
    async with open_engine(dsn) as engine:
        rows = await engine.database.fetch(WAITING_ON_PEOPLE, pending_tasks_max)
        for row in rows:
            kind, call_id = _kind_of(row["waiting_signal"])
            item: dict[str, Any] = {"task_id": row["task_id"], "agent": row["agent"],
                                    "waiting_for": kind, "signal": row["waiting_signal"],
                                    "call_id": call_id, "tool": None, "args_hash": None,
                                    "arguments": None}
            if call_id is not None:
                await _describe_call(engine, row["task_id"], call_id, item)
            found.append(item)
    return found


async def _describe_call(engine: Any, task_id: str, call_id: str,
                         item: dict[str, Any]) -> None:
    """Fill in the call's tool, argument hash and arguments: an approval's from its request
    (histories written before it recorded them show only the hash), a call's from its
    intent."""
    state = await engine.state(task_id)
    approval = state.approvals.get(call_id)
    if approval is not None:
        item["tool"], item["args_hash"] = approval.tool, approval.args_hash
        (requested,) = await engine.store.read_events(
            task_id, from_seq=approval.requested_seq, to_seq=approval.requested_seq, limit=1)
        asked = decode_payload(requested.payload)
        if isinstance(asked, dict):
            item["arguments"] = asked.get("args")
    call = state.calls.get(call_id)
    if call is None:
        return
    item["tool"], item["args_hash"] = call.name, call.args_hash or item["args_hash"]
    (intent,) = await engine.store.read_events(task_id, from_seq=call.seq,
                                               to_seq=call.seq, limit=1)
    payload = decode_payload(intent.payload)
    if isinstance(payload, dict):
        item["arguments"] = payload.get("args", payload.get("request"))


def _shown(arguments: Any) -> str:
    """Arguments as one line of the human listing: ``repr`` (control characters shown as
    escapes, never sent to the terminal), cut past :data:`shown_chars_max` characters (a
    multi-MiB argument would bury the listing; ``--json`` has them whole)."""
    text = repr(arguments)
    if len(text) <= shown_chars_max:
        return text
    return f"{text[:shown_chars_max]}... ({len(text):,} characters; --json shows them all)"


@click.command()
@dsn_option
@development_option
@json_option
def pending(dsn: str | None, as_json: bool) -> None:
    """Every task waiting on a person: approvals, reconciliations and signals."""
    found = run(_pending(dsn), dsn=dsn)
    if as_json:
        for item in found:
            emit(item)
        return
    out = console()
    if not found:
        out.print("nothing is waiting on a person")
    for item in found:
        task = f"{item['task_id']} ({item['agent']})"
        if item["waiting_for"] == "approval":
            shown = (_shown(item["arguments"]) if item["arguments"] is not None
                     else f"arguments sha256 {item['args_hash']}")
            out.print(f"{task}: approval of {item['tool']}({shown}): "
                      f"wal-engine approve {item['task_id']} {item['call_id']} --approver NAME",
                      soft_wrap=True, markup=False)
        elif item["waiting_for"] == "reconcile":
            out.print(f"{task}: the outcome of {item['tool']}({_shown(item['arguments'])}) is "
                      f"unknown: wal-engine reconcile {item['task_id']} {item['call_id']} "
                      "--result JSON | --failed REASON [--force]", soft_wrap=True,
                      markup=False)
        else:
            out.print(f"{task}: signal {item['signal']!r}: wal-engine signal "
                      f"{item['task_id']} {item['signal']} --payload JSON",
                      soft_wrap=True, markup=False)


@click.command()
@click.argument("task_id", metavar="TASK")
@click.argument("call_id", metavar="CALL")
@click.option("--result", "result_json", default=None, metavar="JSON",
              help="The call did happen, with this result.")
@click.option("--failed", "failed_reason", default=None, metavar="REASON",
              help="The call did not happen (or failed), for this reason.")
@click.option("--force", is_flag=True,
              help="Answer before the attempt's grace period ends: only once you know the "
                   "worker that made it is gone (its process or host stopped).")
@dsn_option
@development_option
@json_option
def reconcile(task_id: str, call_id: str, result_json: str | None, failed_reason: str | None,
              force: bool, dsn: str | None, as_json: bool) -> None:
    """Tell TASK what its escalated call CALL really did (`wal-engine pending` lists them)."""
    if (result_json is None) == (failed_reason is None):
        raise click.UsageError("give exactly one of --result JSON and --failed REASON")
    result = parse_json(result_json, "--result") if result_json is not None else None
    signal_id = run(_reconcile(task_id, call_id, result, failed_reason, force, dsn), dsn=dsn)
    if as_json:
        emit({"task_id": task_id, "call_id": call_id, "signal_id": signal_id})
    else:
        console().print(f"reconciled {call_id} of {task_id} (signal {signal_id})")


async def _reconcile(task_id: str, call_id: str, result: Any, failed: str | None,
                     force: bool, dsn: str | None) -> int:
    # engine.reconcile checks that the call is escalated and awaited, and the grace period;
    # its ReconcileRefused is reported like any refusal (exit 3).
    async with open_engine(dsn, write=True) as engine:
        return await engine.reconcile(task_id, call_id, result=result, error=failed,
                                      force=force)


@click.group()
def timer() -> None:
    """Durable timers (development)."""


@timer.command()
@click.argument("task_id", metavar="TASK")
@dsn_option
@development_option
@json_option
def fire(task_id: str, dsn: str | None, as_json: bool) -> None:
    """Make TASK's durable sleep due now (a worker then resumes it), for development."""
    fired = run(_fire(task_id, dsn), dsn=dsn)
    if not fired:
        fail(f"task {task_id!r} is not sleeping on a durable timer", EXIT_USAGE, dsn)
    if as_json:
        emit({"task_id": task_id, "fired": True})
    else:
        console().print(f"timer of {task_id} fired: the next worker poll resumes it")


async def _fire(task_id: str, dsn: str | None) -> bool:
    async with open_engine(dsn, write=True) as engine:
        await engine.head(task_id)  # Unknown task: the usual refusal.
        return bool(await engine.database.fetch(FIRE_TIMER, task_id))
