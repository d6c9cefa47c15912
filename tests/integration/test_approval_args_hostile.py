"""What an approver is shown of a planned call's arguments when they are huge or hostile:
a credential stays redacted in the request and in ``wal-engine pending``, control
characters cannot rewrite the operator's terminal, a multi-MiB argument is stored and
listed whole in ``--json`` but cut in the human listing, and the tool still receives the
arguments it was given, once, after the approval."""

from __future__ import annotations

from typing import Any

from tests.integration.test_cli_agents import cli, drive, lines
from tests.secret_samples import FORMATS
from wal_engine.engine import Engine
from wal_engine.errors import InvalidPayload
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.crash import run_worker_until_idle

SECRET, _ = FORMATS["openai_project"]
HUGE_CHARS = 3 * 1024 * 1024
HOSTILE = {
    "note": "wire it\x1b[2J\x1b[31mAPPROVED\x1b[0m\r\nroot# ",
    "auth": f"Authorization: Bearer {SECRET}",
    "deep": [[[[[[{"k": "v"}]]]]]],
}


async def test_huge_and_hostile_arguments_reach_the_approver_safely(engine: Engine) -> None:
    received: list[Any] = []

    async def wire(args: dict[str, Any]) -> str:
        received.append(args)
        return "sent"

    @engine.agent("approve-huge")
    async def huge(ctx: AgentContext, _: Any) -> Any:
        return await ctx.tool("wire", wire, {"blob": "x" * HUGE_CHARS}, approval=True)

    @engine.agent("approve-hostile")
    async def hostile(ctx: AgentContext, _: Any) -> Any:
        return await ctx.tool("wire", wire, HOSTILE, approval=True)

    @engine.agent("approve-nul")
    async def nul(ctx: AgentContext, _: Any) -> Any:
        try:
            return await ctx.tool("wire", wire, {"nul": "a\x00b"}, approval=True)
        except InvalidPayload as error:
            return f"refused: {error}"

    dsn = engine.database.dsn
    nul_task = await engine.submit("approve-nul", task_id="appr-nul")
    huge_task = await engine.submit("approve-huge", task_id="appr-huge")
    hostile_task = await engine.submit("approve-hostile", task_id="appr-hostile")
    await run_worker_until_idle(engine)
    assert received == []  # Nothing acts before a person approves.
    # Arguments PostgreSQL cannot store: a typed error at the call, no request written.
    refused = await engine.state(nul_task)
    assert "NUL character" in refused.output and not refused.approvals

    listed = {item["task_id"]: item for item in
              lines((await cli("pending", "--dsn", dsn, "--json")).stdout)}
    assert listed[huge_task]["arguments"] == {"blob": "x" * HUGE_CHARS}
    shown = listed[hostile_task]["arguments"]
    assert SECRET not in repr(shown) and "[REDACTED" in shown["auth"]
    assert shown["note"] == HOSTILE["note"]
    assert shown["deep"] == HOSTILE["deep"]

    human = (await cli("pending", "--dsn", dsn)).stdout
    assert SECRET not in human
    assert "\x1b" not in human and "\r" not in human  # repr shows escapes, never sends them
    huge_line = next(line for line in human.splitlines() if huge_task in line)
    assert len(huge_line) < 2000 and f"{HUGE_CHARS + 12:,} characters" in huge_line
    assert "--json" in huge_line

    for task in (huge_task, hostile_task):
        call_id = listed[task]["call_id"]
        await engine.approve(task, call_id, approver="ops@example.com")
    assert (await drive(engine, huge_task)).output == "sent"
    assert (await drive(engine, hostile_task)).output == "sent"
    # The tool got the arguments its agent gave, once each: the redaction is the log's.
    assert sorted(received, key=len) == sorted([{"blob": "x" * HUGE_CHARS}, HOSTILE], key=len)
