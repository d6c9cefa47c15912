"""The demo agent: a scripted LLM plans, calls tools (one flaky, one needing approval), answers.

Every tool acts through the idempotency gateway and counts its real effects in the table
``demo_effects`` (one row per idempotency key, with how often the callee was reached and how
often it acted), so the demo can show that each side effect happened exactly once although
a worker was SIGKILLed in the middle of the task.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from wal_engine.effects.gateway import IdempotencyGateway
from wal_engine.engine import Engine
from wal_engine.events import PlanNode
from wal_engine.retries import RetryPolicy, TransientError
from wal_engine.runtime.context import AgentContext, LlmResponse

AGENT_NAME: Final = "research-assistant"

EFFECTS_TABLE: Final = """
CREATE TABLE IF NOT EXISTS demo_effects (
    key        text PRIMARY KEY,
    tool       text NOT NULL,
    deliveries integer NOT NULL DEFAULT 0,
    applied    integer NOT NULL DEFAULT 0
)
"""
COUNT_DELIVERY: Final = """
INSERT INTO demo_effects (key, tool, deliveries) VALUES ($1, $2, 1)
ON CONFLICT (key) DO UPDATE SET deliveries = demo_effects.deliveries + 1
RETURNING deliveries
"""
COUNT_APPLIED: Final = "UPDATE demo_effects SET applied = applied + 1 WHERE key = $1"
EFFECT_TOTALS: Final = """
SELECT tool, deliveries, applied FROM demo_effects WHERE key LIKE 'idem:' || $1 || ':%'
 ORDER BY tool
"""


class Question(msgspec.Struct, frozen=True, kw_only=True):
    """The demo agent's input."""

    question: str
    recipient: str = "team@example.com"


def scripted_llm(request: dict[str, Any]) -> LlmResponse:
    """A deterministic stand-in for an LLM: plans first, answers from the notes after."""
    if request["phase"] == "plan":
        return LlmResponse(
            content={"steps": ["search", "fetch", "summarise", "send_report"],
                     "query": request["question"]},
            input_tokens=120, output_tokens=40, cost_usd=0.0008,
        )
    notes = request["notes"]
    return LlmResponse(
        content=f"Answer to {request['question']!r}: {notes['title']} says {notes['summary']}",
        input_tokens=600, output_tokens=90, cost_usd=0.0031,
    )


def build_tools(engine: Engine) -> dict[str, Any]:
    """The demo's tools; each acts once per idempotency key through the gateway."""
    gateway: IdempotencyGateway = engine.gateway
    database = engine.database

    async def act(tool: str, result: Any, *, flaky: bool = False) -> Any:
        from wal_engine.runtime.context import current_call

        claim = current_call()
        assert claim is not None
        deliveries = (await database.fetch(COUNT_DELIVERY, claim.key, tool))[0]["deliveries"]
        if flaky and deliveries == 1:
            raise TransientError("upstream answered 503 (first delivery fails on purpose)")

        async def effect(connection: Any) -> Any:
            # The service's effect and its dedup record commit together: once per key.
            await connection.execute(COUNT_APPLIED, claim.key)
            return result

        return await gateway.run_in_transaction(claim, effect)

    async def web_search(args: dict[str, Any]) -> Any:
        return await act("web_search", [
            {"url": "https://example.org/wal", "title": "Write-ahead logging"},
            {"url": "https://example.org/replay", "title": "Deterministic replay"},
        ])

    async def fetch_page(args: dict[str, Any]) -> Any:
        return await act("fetch_page", {
            "title": "Write-ahead logging",
            "summary": "record the intent durably before acting, then record the result",
        }, flaky=True)

    async def send_report(args: dict[str, Any]) -> Any:
        return await act("send_report", {"message_id": f"msg-{args['to']}", "sent": True})

    return {"web_search": web_search, "fetch_page": fetch_page, "send_report": send_report}


def register(engine: Engine) -> None:
    """Register the demo agent on ``engine``."""
    tools = build_tools(engine)

    @engine.agent(AGENT_NAME, input_type=Question)
    async def research_assistant(ctx: AgentContext, task_input: dict[str, Any]) -> Any:
        question = task_input["question"]
        await ctx.message("user", question)
        plan = await ctx.llm("scripted-llm", scripted_llm, {"phase": "plan",
                                                            "question": question})
        await ctx.plan([PlanNode(node_id=step, depends_on=[] if i == 0 else [previous])
                        for i, (step, previous) in enumerate(
                            zip(plan["steps"], ["", *plan["steps"]], strict=False))])
        await ctx.checkpoint(next_action="search")
        hits = await ctx.tool("web_search", tools["web_search"], {"query": plan["query"]})
        await ctx.complete_node("search")
        await ctx.checkpoint(next_action="fetch")
        notes = await ctx.tool("fetch_page", tools["fetch_page"], {"url": hits[0]["url"]},
                               retry=RetryPolicy(max_attempts=4, initial_delay_s=0.05))
        await ctx.complete_node("fetch")
        await ctx.checkpoint(next_action="summarise")
        answer = await ctx.llm("scripted-llm", scripted_llm, {
            "phase": "answer", "question": question, "notes": notes})
        await ctx.complete_node("summarise")
        await ctx.checkpoint(next_action="send_report")
        receipt = await ctx.tool("send_report", tools["send_report"],
                                 {"to": task_input["recipient"], "body": answer},
                                 approval=True)
        await ctx.complete_node("send_report")
        await ctx.message("assistant", answer)
        return {"answer": answer, "receipt": receipt}


async def prepare(engine: Engine) -> None:
    """Create the demo's effects table (idempotent)."""
    await engine.database.fetch(EFFECTS_TABLE)


# ----------------------------------------------------------------------------- the show

lease_ttl_ms: Final = 3_000
heartbeat_ms: Final = 500
phase_timeout_s: Final = 45.0


async def run_worker(dsn: str, worker_id: str) -> None:
    """A demo worker process: the demo agent, short leases, stops on SIGTERM."""
    from wal_engine.engine import connect

    engine = await connect(dsn)
    try:
        register(engine)
        await prepare(engine)
        worker = engine.worker(concurrency=4, worker_id=worker_id, lease_ttl_ms=lease_ttl_ms,
                               heartbeat_ms=heartbeat_ms, poll_ms=200, sweep_ms=500)
        await worker.run(install_signal_handlers=True)
    finally:
        await engine.close()


def main() -> None:
    """``python -m wal_engine.cli.demo worker DSN WORKER_ID`` (used by the demo's subprocesses)."""
    import asyncio
    import sys

    from wal_engine.observability.logs import configure_logging

    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        raise SystemExit("usage: python -m wal_engine.cli.demo worker DSN WORKER_ID")
    configure_logging()
    asyncio.run(run_worker(sys.argv[2], sys.argv[3]))


if __name__ == "__main__":
    main()
