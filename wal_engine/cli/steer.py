"""Commands that steer tasks: ``submit``, ``signal``, ``approve``, ``cancel``, ``fork``."""

from __future__ import annotations

from typing import Any

import click
import msgspec

from wal_engine.cli.common import (
    EXIT_USAGE,
    CliError,
    console,
    development_option,
    dsn_option,
    emit,
    install_agents,
    json_option,
    open_engine,
    parse_json,
    run,
)
from wal_engine.events import Budget


def parse_budget(items: tuple[str, ...]) -> Budget | None:
    """``max_steps=10,max_tokens=5000`` (repeatable) into a :class:`Budget`."""
    if not items:
        return None
    values: dict[str, str] = {}
    for item in items:
        for pair in item.split(","):
            if not pair.strip():
                continue
            key, separator, value = pair.partition("=")
            key = key.strip()
            if not separator or key not in Budget.__struct_fields__:
                fields = ", ".join(Budget.__struct_fields__)
                raise CliError(f"--budget {pair.strip()!r} must be NAME=VALUE with NAME one "
                               f"of {fields}", EXIT_USAGE)
            values[key] = value.strip()
    try:
        return msgspec.convert(values, Budget, strict=False)
    except msgspec.ValidationError as error:
        raise CliError(f"--budget is invalid: {error}", EXIT_USAGE) from error


async def _warn_if_no_worker_serves(engine: Any, agent: str) -> None:
    """A warning on standard error when no worker registered ``agent`` recently (the task
    would wait until one does): the agents that workers did register, or that none did."""
    from wal_engine.runtime.registry import recent_agents, recent_window_s_default

    served = await recent_agents(engine.database)
    if agent in served:
        return
    hours = recent_window_s_default // 3600
    seen = (f"workers registered: {', '.join(sorted(served))}" if served
            else "no worker registered any agent")
    click.echo(f"warning: no worker registered agent {agent!r} in the last {hours} h "
               f"({seen}); the task waits until a `wal-engine worker --agents ...` serving "
               f"it starts (submit --agents MODULE:ATTR checks the name)", err=True)


@click.command()
@click.argument("agent")
@click.option("--input", "input_json", default="null", metavar="JSON",
              help="The task's input as JSON.")
@click.option("--task-id", default=None, metavar="ID",
              help="Choose the task id (a repeated identical submission is a no-op).")
@click.option("--budget", "budget_items", multiple=True, metavar="NAME=VALUE,...",
              help="Budget, e.g. max_steps=20,max_tokens=50000,max_cost_usd=1.5.")
@click.option("--agents", "agents_spec", default=None, metavar="MODULE:ATTR",
              help="Load the agents to validate the input against the agent's input type.")
@click.option("--queue", "queue_name", default="default", show_default=True,
              help="The queue (made by `wal-engine queue set`) whose limits hold it.")
@click.option("--priority", type=int, default=0, show_default=True,
              help="Higher is claimed first; equal priorities oldest first.")
@click.option("--partition-key", default=None,
              help="Tasks of one key in one queue run one at a time, in submission order.")
@click.option("--dedup-id", default=None,
              help="Refused while a live task of the queue holds the same id.")
@dsn_option
@development_option
@json_option
def submit(agent: str, input_json: str, task_id: str | None, budget_items: tuple[str, ...],
           agents_spec: str | None, queue_name: str, priority: int, partition_key: str | None,
           dedup_id: str | None, dsn: str | None, as_json: bool) -> None:
    """Queue a task for AGENT."""
    placement = {"queue": queue_name, "priority": priority, "partition_key": partition_key,
                 "dedup_id": dedup_id}
    run(_submit(agent, input_json, task_id, budget_items, agents_spec, placement, dsn,
                as_json), dsn=dsn)


async def _submit(agent: str, input_json: str, task_id: str | None,
                  budget_items: tuple[str, ...], agents_spec: str | None,
                  placement: dict[str, Any], dsn: str | None, as_json: bool) -> None:
    task_input = parse_json(input_json, "--input")
    budget = parse_budget(budget_items)
    async with open_engine(dsn, write=True) as engine:
        if agents_spec is not None:
            await install_agents(engine, agents_spec)
            if agent not in engine.agents:
                known = ", ".join(sorted(engine.agents))
                raise CliError(f"agent {agent!r} is not registered by {agents_spec} "
                               f"(it registers: {known})", EXIT_USAGE)
        chosen = await engine.submit(agent, task_input, budget=budget, task_id=task_id,
                                     **placement)
        if agents_spec is None:
            await _warn_if_no_worker_serves(engine, agent)
        head = await engine.head(chosen)
    if as_json:
        emit({"task_id": chosen, "agent": head.agent, "status": str(head.status),
              "head_seq": head.head_seq})
        return
    console().print(f"submitted task {chosen} (agent {head.agent}, {head.status})")


@click.command()
@click.argument("task_id", metavar="TASK")
@click.argument("name")
@click.option("--payload", "payload_json", default="null", metavar="JSON",
              help="The signal's payload as JSON.")
@click.option("--dedup-key", default=None, help="Store a repeated delivery only once.")
@dsn_option
@development_option
@json_option
def signal(task_id: str, name: str, payload_json: str, dedup_key: str | None, dsn: str | None,
           as_json: bool) -> None:
    """Send the signal NAME to a task (a task waiting for it resumes)."""
    run(_signal(task_id, name, payload_json, dedup_key, dsn, as_json), dsn=dsn)


async def _signal(task_id: str, name: str, payload_json: str, dedup_key: str | None,
                  dsn: str | None, as_json: bool) -> None:
    payload = parse_json(payload_json, "--payload")
    async with open_engine(dsn, write=True) as engine:
        await engine.head(task_id)  # Unknown task: a clear error before anything is sent.
        signal_id = await engine.signal(task_id, name, payload, dedup_key=dedup_key)
    if as_json:
        emit({"task_id": task_id, "name": name, "signal_id": signal_id})
        return
    console().print(f"signal {name!r} sent to task {task_id} (signal {signal_id})")


@click.command()
@click.argument("task_id", metavar="TASK")
@click.argument("call_id", metavar="CALL")
@click.option("--approver", required=True, help="Who approves (recorded in the log).")
@click.option("--reject", is_flag=True, help="Refuse the call instead (the task fails).")
@click.option("--comment", default=None, help="A comment recorded with the decision.")
@dsn_option
@development_option
@json_option
def approve(task_id: str, call_id: str, approver: str, reject: bool, comment: str | None,
            dsn: str | None, as_json: bool) -> None:
    """Approve (or --reject) the exact call CALL that a task waits on."""
    run(_approve(task_id, call_id, approver, reject, comment, dsn, as_json), dsn=dsn)


async def _approve(task_id: str, call_id: str, approver: str, reject: bool,
                   comment: str | None, dsn: str | None, as_json: bool) -> None:
    async with open_engine(dsn, write=True) as engine:
        signal_id = await engine.approve(task_id, call_id, approver=approver,
                                         approved=not reject, comment=comment)
    if as_json:
        emit({"task_id": task_id, "call_id": call_id, "approved": not reject,
              "approver": approver, "signal_id": signal_id})
        return
    verdict = "rejected" if reject else "approved"
    console().print(f"call {call_id} of task {task_id} {verdict} by {approver}")


@click.command()
@click.argument("task_id", metavar="TASK")
@click.option("--reason", default="cancelled", show_default=True, help="Recorded in the log.")
@click.option("--by", "requested_by", default=None, help="Who cancels (recorded in the log).")
@dsn_option
@development_option
@json_option
def cancel(task_id: str, reason: str, requested_by: str | None, dsn: str | None,
           as_json: bool) -> None:
    """Cancel a task: it fails at once and its worker is fenced."""
    run(_cancel(task_id, reason, requested_by, dsn, as_json), dsn=dsn)


async def _cancel(task_id: str, reason: str, requested_by: str | None, dsn: str | None,
                  as_json: bool) -> None:
    async with open_engine(dsn, write=True) as engine:
        cancelled = await engine.cancel(task_id, reason=reason, requested_by=requested_by)
        head = await engine.head(task_id)
    if as_json:
        emit({"task_id": task_id, "cancelled": cancelled, "status": str(head.status)})
        return
    if cancelled:
        console().print(f"task {task_id} cancelled")
    else:
        console().print(f"task {task_id} had already finished ({head.status}); nothing changed")


@click.command()
@click.argument("task_id", metavar="TASK")
@click.option("--at", "at_seq", type=click.IntRange(1), default=None, metavar="SEQ",
              help="Keep the history up to and including this seq.")
@click.option("--at-divergence", "agents_spec", default=None, metavar="MODULE:ATTR",
              help="Fork where today's agents (as for `worker`) first diverge from TASK's "
                   "history, so that the new task continues on the new code.")
@dsn_option
@development_option
@json_option
def fork(task_id: str, at_seq: int | None, agents_spec: str | None, dsn: str | None,
         as_json: bool) -> None:
    """Start a new task from TASK's history up to SEQ (it continues with today's code)."""
    if (at_seq is None) == (agents_spec is None):
        raise click.UsageError("give --at SEQ or --at-divergence MODULE:ATTR (one of them)")
    if agents_spec is not None:
        at_seq = run(_divergence_point(task_id, agents_spec, dsn), dsn=dsn)
    assert at_seq is not None
    run(_fork(task_id, at_seq, dsn, as_json), dsn=dsn)


async def _divergence_point(task_id: str, agents_spec: str, dsn: str | None) -> int:
    """The fork point of the first divergence of today's agents from TASK's history."""
    from wal_engine.cli.common import install_agents
    from wal_engine.runtime.replayer import check_history

    async with open_engine(dsn) as engine:
        await install_agents(engine, agents_spec)
        report = await check_history(engine, task_id)
    if report.divergence is None:
        raise click.ClickException(f"today's code does not diverge from task {task_id}'s "
                                   "history: nothing to fork at")
    if report.divergence.fork_point < 1:
        raise click.ClickException("the code diverges at the task's first event: submit it "
                                   "again instead")
    return report.divergence.fork_point


async def _fork(task_id: str, at_seq: int, dsn: str | None, as_json: bool) -> None:
    async with open_engine(dsn, write=True) as engine:
        child = await engine.fork(task_id, at_seq)
        head = await engine.head(child)
    result: dict[str, Any] = {"task_id": child, "parent_task_id": task_id, "parent_seq": at_seq,
                              "status": str(head.status), "head_seq": head.head_seq}
    if as_json:
        emit(result)
        return
    console().print(f"forked task {task_id} at seq {at_seq}: new task {child} "
                    f"({head.status}, {head.head_seq} events)")
