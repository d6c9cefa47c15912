"""``wal-engine limiters`` (list them and their state) and ``wal-engine limiter
set|delete``: the rate limiters of :meth:`wal_engine.engine.Engine.limiter`."""

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
    run,
)
from wal_engine.cli.render import record_json


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


@click.command("limiters")
@dsn_option
@development_option
@json_option
def limiters(dsn: str | None, as_json: bool) -> None:
    """This tenant's rate limiters: limits, what the window holds, what is reserved."""
    async def _list() -> list[Any]:
        async with open_engine(dsn) as engine:
            return await engine.limiters()

    found = run(_list(), dsn=dsn)
    if as_json:
        for info in found:
            emit(record_json(info))
        return
    table = Table("name", "period s", "requests", "limit", "reserved", "tokens", "limit",
                  "reserved", "counts", "blocked until")
    for info in found:
        table.add_row(escape(info.name), f"{info.period_s:g}", str(info.requests_in_window),
                      _limit(info.requests_per_period), str(info.requests_reserved),
                      str(info.tokens_in_window), _limit(info.tokens_per_period),
                      str(info.tokens_reserved), info.token_kind,
                      "-" if info.blocked_until is None else info.blocked_until.isoformat())
    console().print(table)


@click.group("limiter")
def limiter() -> None:
    """Define or delete a rate limiter (list them with `wal-engine limiters`)."""


@limiter.command("set")
@click.argument("name")
@click.option("--requests", "requests_per_period", type=int, default=None,
              help="Calls per period.")
@click.option("--tokens", "tokens_per_period", type=int, default=None,
              help="Tokens per period.")
@click.option("--period", "period_s", type=float, default=60.0, show_default=True,
              help="The sliding window, in seconds.")
@click.option("--count", "token_kind", type=click.Choice(["input", "output", "both"]),
              default="both", show_default=True, help="Which recorded tokens count.")
@dsn_option
@development_option
@json_option
def set_(name: str, requests_per_period: int | None, tokens_per_period: int | None,
         period_s: float, token_kind: str, dsn: str | None, as_json: bool) -> None:
    """Define (or change) limiter NAME."""
    async def _set() -> Any:
        async with open_engine(dsn, write=True) as engine:
            return await engine.limiter(name, requests_per_period=requests_per_period,
                                        tokens_per_period=tokens_per_period,
                                        period_s=period_s,
                                        tokens=token_kind)  # type: ignore[arg-type]

    info = run(_set(), dsn=dsn)
    if as_json:
        emit(record_json(info))
        return
    console().print(f"limiter {escape(info.name)} saved: {_limit(info.requests_per_period)} "
                    f"requests, {_limit(info.tokens_per_period)} tokens ({info.token_kind}) "
                    f"per {info.period_s:g} s")


@limiter.command("delete")
@click.argument("name")
@dsn_option
@development_option
@json_option
def delete(name: str, dsn: str | None, as_json: bool) -> None:
    """Delete limiter NAME and its grants."""
    async def _delete() -> None:
        async with open_engine(dsn, write=True) as engine:
            await engine.delete_limiter(name)

    run(_delete(), dsn=dsn)
    if as_json:
        emit({"name": name, "deleted": True})
    else:
        console().print(f"limiter {escape(name)} deleted")
