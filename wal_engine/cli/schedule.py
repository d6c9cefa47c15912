"""``wal-engine schedule add|list|pause|resume|delete``: cron and interval schedules
(:meth:`wal_engine.engine.Engine.schedule`); every running worker fires their ticks."""

from __future__ import annotations

from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from wal_engine.cli.common import (
    console,
    development_option,
    dsn_option,
    emit,
    json_option,
    open_engine,
    parse_json,
    run,
)
from wal_engine.cli.render import record_json


def _shown(info: Any, as_json: bool, verb: str) -> None:
    if as_json:
        emit(record_json(info))
        return
    when = info.cron if info.cron is not None else f"every {info.every_s} s"
    state = "paused" if info.paused else f"next tick {_time(info.next_tick)}"
    console().print(f"schedule {escape(info.name)} {verb}: {escape(info.agent)} "
                    f"{escape(when)} ({escape(info.time_zone)}), catch-up {info.catch_up}, "
                    f"{state}")


def _time(value: Any) -> str:
    return "-" if value is None else value.isoformat()


@click.group()
def schedule() -> None:
    """Schedules: submit a task at every tick of a cron expression or interval."""


@schedule.command("add")
@click.argument("name")
@click.argument("agent")
@click.option("--cron", default=None, metavar="EXPR",
              help="A cron expression (5 fields, or 6 with leading seconds; @daily...).")
@click.option("--every", "every_s", type=int, default=None, metavar="SECONDS",
              help="Tick every SECONDS instead (at multiples of it since 1970 UTC).")
@click.option("--input", "input_json", default="null", metavar="JSON",
              help="Each task's input as JSON.")
@click.option("--tz", default=None, metavar="ZONE",
              help="The IANA time zone of --cron (default UTC).")
@click.option("--catch-up", type=click.Choice(["skip", "one", "all"]), default="one",
              show_default=True, help="What to do with ticks missed while no worker ran.")
@click.option("--catch-up-max", type=int, default=100, show_default=True,
              help="At most this many missed ticks fired at once (--catch-up all).")
@click.option("--replace", is_flag=True, help="Rewrite a schedule of this name.")
@dsn_option
@development_option
@json_option
def add(name: str, agent: str, cron: str | None, every_s: int | None, input_json: str,
        tz: str | None, catch_up: str, catch_up_max: int, replace: bool, dsn: str | None,
        as_json: bool) -> None:
    """Submit a task for AGENT at every tick of schedule NAME."""
    value = parse_json(input_json, "--input")

    async def _add() -> Any:
        async with open_engine(dsn, write=True) as engine:
            return await engine.schedule(name, agent, cron=cron, every_s=every_s, input=value,
                                         tz=tz, catch_up=catch_up,  # type: ignore[arg-type]
                                         catch_up_max=catch_up_max, replace=replace)

    _shown(run(_add(), dsn=dsn), as_json, "saved")


@schedule.command("list")
@dsn_option
@development_option
@json_option
def list_(dsn: str | None, as_json: bool) -> None:
    """This tenant's schedules."""
    async def _list() -> list[Any]:
        async with open_engine(dsn) as engine:
            return await engine.schedules()

    found = run(_list(), dsn=dsn)
    if as_json:
        for info in found:
            emit(record_json(info))
        return
    table = Table("name", "agent", "when", "zone", "catch-up", "state", "next tick",
                  "ticks", "last task", "last error")
    for info in found:
        when = info.cron if info.cron is not None else f"every {info.every_s} s"
        table.add_row(escape(info.name), escape(info.agent), escape(when),
                      escape(info.time_zone), info.catch_up,
                      "paused" if info.paused else "active", _time(info.next_tick),
                      str(info.ticks_fired), escape(info.last_task_id or "-"),
                      escape((info.last_error or "-")[:80]))
    console().print(table)


def _one(verb: str, method: str) -> Any:
    @dsn_option
    @development_option
    @json_option
    @click.argument("name")
    def command(name: str, dsn: str | None, as_json: bool) -> None:
        async def _act() -> Any:
            async with open_engine(dsn, write=True) as engine:
                return await getattr(engine, method)(name)

        info = run(_act(), dsn=dsn)
        if info is None:
            if as_json:
                emit({"name": name, "deleted": True})
            else:
                console().print(f"schedule {escape(name)} deleted")
            return
        _shown(info, as_json, verb)

    return command


schedule.command("pause", help="Stop firing schedule NAME until it is resumed.")(
    _one("paused", "pause_schedule"))
schedule.command("resume", help="Fire schedule NAME again from its next tick after now "
                                "(ticks of the pause are not fired).")(
    _one("resumed", "resume_schedule"))
schedule.command("delete", help="Delete schedule NAME (its tasks stay).")(
    _one("deleted", "delete_schedule"))
