"""Names agent code gives (a tool's, a model's, a transaction's, a message's, the signal a
task waits for) hold a secret: the stored rows hold only its redacted form, and the task
resumes on another worker, and replays, without a NonDeterminismError (the journal matches
the recorded, redacted name against the redacted form of the name the code asks for)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from wal_engine import blobs
from wal_engine.engine import connect
from wal_engine.runtime.context import AgentContext, LlmResponse
from wal_engine.runtime.replayer import replay_events
from wal_engine.state_machine import Status

FAST: dict[str, Any] = {"lease_ttl_ms": 2000, "heartbeat_ms": 300, "poll_ms": 50,
                        "sweep_ms": 200}
GITHUB_TOKEN = "ghp_" + "aB3dE5" * 6
PASSWORD = "hunter2hunter2"
TOOL = f"call_{GITHUB_TOKEN}"
"""A tool named after a token (36 characters after ``ghp_``, as GitHub issues them)."""
OTHER_TOOL = f"password={PASSWORD}"
MODEL = f"gpt token={GITHUB_TOKEN}"
TRANSACTION = f"record password={PASSWORD}"
MESSAGE_NAME = f"password={PASSWORD}"
SIGNAL = f"hook {GITHUB_TOKEN}"
SECRETS = (GITHUB_TOKEN, PASSWORD)


async def _stored_rows(dsn: str) -> str:
    """Every stored payload, signal name and dedup key, and the task rows' awaited signal
    names, as one text."""
    connection = await asyncpg.connect(dsn)
    try:
        events = await connection.fetch(
            "SELECT task_id, payload FROM wal_events LIMIT 100000")
        signals = await connection.fetch(
            "SELECT name, dedup_key, payload FROM wal_signals LIMIT 100000")
        tasks = await connection.fetch("SELECT waiting_signal FROM wal_tasks LIMIT 1000")
    finally:
        await connection.close()
    # A compressed row (decision 71) is searched in its content, as any reader sees it.
    parts = [blobs.decompress_row(bytes(row["payload"]), row["task_id"]).decode()
             for row in events]
    for row in signals:
        parts += [row["name"], row["dedup_key"] or "", bytes(row["payload"]).decode()]
    parts += [row["waiting_signal"] or "" for row in tasks]
    return "\n".join(parts)


async def _until(engine: Any, task_id: str, status: Status, timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await engine.head(task_id)).status is not status:
        assert asyncio.get_running_loop().time() < deadline, f"never {status}"
        await asyncio.sleep(0.05)


async def test_secret_names_are_stored_redacted_and_the_task_resumes_and_replays(
        database_dsn: str) -> None:
    """The first worker is stopped while the token-named tool runs: the task is handed back
    and a second engine's worker re-runs the code from the top against the journal (every
    name matched in its redacted form), waits for a signal whose name holds a token (the
    sender names it as given), and completes. Each tool acted once; no secret is in any
    stored row; the history replays to the same ending."""
    started, release = asyncio.Event(), asyncio.Event()
    acted: list[str] = []

    async def gated(args: Any) -> Any:
        acted.append("gated")
        started.set()
        await release.wait()
        return {"n": args["n"]}

    async def plain(args: Any) -> Any:
        acted.append("plain")
        return {"n": args["n"]}

    def llm(request: Any) -> LlmResponse:
        acted.append("llm")
        return LlmResponse(content="ok", input_tokens=1, output_tokens=1)

    async def write(connection: Any, args: Any) -> Any:
        acted.append("transaction")
        return {"one": await connection.fetchval("SELECT 1")}

    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.message("user", "hello", name=MESSAGE_NAME)
        first = await ctx.tool(TOOL, gated, {"n": 1})
        reply = await ctx.llm(MODEL, llm, {"q": 2})
        written = await ctx.transaction(TRANSACTION, write, {"n": 3})
        signal = await ctx.wait_for_signal(SIGNAL, timeout_s=60)
        last = await ctx.tool(OTHER_TOOL, plain, {"n": 4})
        return {"first": first, "reply": reply, "written": written, "signal": signal,
                "last": last}

    engine = await connect(database_dsn, migrate=False, pool_size_max=4)
    try:
        engine.agent("named")(agent)
        task_id = await engine.submit("named", {"q": "control-input"})
        worker = engine.worker(concurrency=1, **FAST)
        running = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(started.wait(), 30)
            worker.stop()  # Mid-task: the run hands the task back at its next command.
            release.set()
        finally:
            await asyncio.wait_for(running, 30)
        head = await engine.head(task_id)
        assert head.status not in (Status.COMPLETED, Status.FAILED), head
        assert acted == ["gated"]
    finally:
        await engine.close()

    second = await connect(database_dsn, migrate=False, pool_size_max=4)
    try:
        second.agent("named")(agent)
        worker = second.worker(concurrency=1, **FAST)
        running = asyncio.create_task(worker.run())
        try:
            await _until(second, task_id, Status.WAITING)
            await second.signal(task_id, SIGNAL, {"approved": True})
            state = await second.wait(task_id, timeout_s=60)
        finally:
            worker.stop()
            await running
        history = await second.history(task_id)
    finally:
        await second.close()

    assert state.status is Status.COMPLETED, state
    assert state.output["signal"] == {"approved": True} and state.output["last"] == {"n": 4}
    assert acted == ["gated", "llm", "transaction", "plain"]
    stored = await _stored_rows(database_dsn)
    assert "control-input" in stored
    assert "call_[REDACTED:github_token]" in stored and "password=[REDACTED]" in stored
    assert [secret for secret in SECRETS if secret in stored] == []
    report = await replay_events(history, agent)
    assert report.outcome == "completed" and report.divergence is None, report
    assert report.output_matches is True
    assert report.calls_replayed == report.calls_recorded == 5


async def test_secret_names_of_approvals_are_stored_redacted_and_replay(
        engine: Any, database_dsn: str) -> None:
    """A tool call that needs approval and a bare ``ctx.approval``, both named after a
    secret: the approvals are answered by call id, the task completes, the names are stored
    redacted (the approval request's tool, the decision's value kind), and the history
    replays with each decision matched."""
    acted: list[int] = []

    async def wire(args: Any) -> Any:
        acted.append(args["amount"])
        return "sent"

    async def guarded(ctx: AgentContext, task_input: Any) -> Any:
        sent = await ctx.tool(TOOL, wire, {"amount": 10}, approval=True)
        decision = await ctx.approval(OTHER_TOOL, {"amount": 20})
        return {"sent": sent, "approved": decision.approved}

    engine.agent("guarded")(guarded)
    task_id = await engine.submit("guarded")
    worker = engine.worker(concurrency=1, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        await _until(engine, task_id, Status.WAITING)
        await engine.approve(task_id, "tool-0", approver="alice")
        pending: list[str] = []
        for _ in range(600):  # The second request (the first may still be undecided).
            pending = [call_id for call_id, approval in
                       (await engine.state(task_id)).approvals.items()
                       if approval.approved is None and call_id != "tool-0"]
            if pending:
                break
            await asyncio.sleep(0.05)
        await engine.approve(task_id, pending[0], approver="bob", approved=False)
        state = await engine.wait(task_id, timeout_s=60)
    finally:
        worker.stop()
        await running
    assert state.status is Status.COMPLETED, state
    assert state.output == {"sent": "sent", "approved": False} and acted == [10]
    stored = await _stored_rows(database_dsn)
    assert "call_[REDACTED:github_token]" in stored
    assert "approval:password=[REDACTED]" in stored
    assert [secret for secret in SECRETS if secret in stored] == []
    report = await replay_events(await engine.history(task_id), guarded)
    assert report.outcome == "completed" and report.divergence is None, report
