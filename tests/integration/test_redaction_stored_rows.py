"""S14 in the stored rows: the battery of secret formats and evasions, passed through the
public API as tool results, tool errors, signal payloads, names and dedup keys, and cancel
reasons and requesters, never reaches wal_events or wal_signals."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from tests.secret_samples import EVASIONS, FORMATS, STRUCTURED_EVASIONS
from wal_engine import blobs
from wal_engine.engine import connect
from wal_engine.runtime.context import AgentContext, ToolError
from wal_engine.state_machine import Status

FAST: dict[str, Any] = {"lease_ttl_ms": 2000, "heartbeat_ms": 300, "poll_ms": 50,
                        "sweep_ms": 200}
TEXTS = {**FORMATS, **EVASIONS}
SECRETS = sorted({secret for secret, _ in TEXTS.values()}
                 | {secret for secret, _ in STRUCTURED_EVASIONS.values()})
SHORT = sorted(name for name, (_, text) in FORMATS.items() if len(text) <= 150)[:16]
"""Formats whose text is short enough to go into a signal name or a dedup key."""


async def _stored_text(dsn: str) -> str:
    """Every stored payload, signal name, dedup key and cancel field, as one text."""
    connection = await asyncpg.connect(dsn)
    try:
        events = await connection.fetch(
            "SELECT task_id, payload FROM wal_events LIMIT 100000")
        signals = await connection.fetch(
            "SELECT name, dedup_key, payload FROM wal_signals LIMIT 100000")
    finally:
        await connection.close()
    # A compressed row (decision 71) is searched in its content, as any reader sees it.
    parts = [blobs.decompress_row(bytes(row["payload"]), row["task_id"]).decode()
             for row in events]
    for row in signals:
        parts += [row["name"], row["dedup_key"] or "", bytes(row["payload"]).decode()]
    return "\n".join(parts)


async def test_s14_no_secret_of_the_battery_reaches_the_stored_rows(database_dsn: str) -> None:
    """A task records every text as a tool result and as a tool error, receives them as a
    signal (payload, name, dedup key); another task is cancelled with them as reason and
    requester: no secret appears in any stored row, and the controls are there."""
    engine = await connect(database_dsn, migrate=False, pool_size_max=4)
    texts = [text for _, text in TEXTS.values()]
    structured = [value for _, value in STRUCTURED_EVASIONS.values()]

    def fail(args: Any) -> Any:
        raise ValueError(f"upstream said: {TEXTS[args['name']][1]}")

    @engine.agent("battery")
    async def battery(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.tool("fetch", lambda args: {"pages": texts, "values": structured}, {})
        failed = 0
        for name in sorted(TEXTS):
            try:
                await ctx.tool("fail", fail, {"name": name})
            except ToolError:
                failed += 1
        signal = await ctx.wait_for_signal("webhook", timeout_s=60)
        return {"failed": failed, "signal_keys": sorted(signal)}

    try:
        task_id = await engine.submit("battery", {"q": "control-input"})
        idle = await engine.submit("battery", None)
        for index, name in enumerate(SHORT):
            text = FORMATS[name][1]
            await engine.signal(idle, f"hook {text}", {"n": index},
                                dedup_key=f"delivery {text}")
        await engine.cancel(idle, reason="\n".join(texts[:40]),
                            requested_by="\n".join(FORMATS[name][1] for name in SHORT))
        worker = engine.worker(concurrency=1, **FAST)
        running = asyncio.create_task(worker.run())
        try:
            for _ in range(600):
                if (await engine.head(task_id)).status is Status.WAITING:
                    break
                await asyncio.sleep(0.05)
            await engine.signal(task_id, "webhook", {"texts": texts, "values": structured})
            state = await engine.wait(task_id, timeout_s=60)
        finally:
            worker.stop()
            await running
    finally:
        await engine.close()
    assert state.status is Status.COMPLETED, state
    assert state.output["failed"] == len(TEXTS)
    stored = await _stored_text(database_dsn)
    assert "control-input" in stored and "upstream said" in stored
    assert "hook the tool printed [REDACTED:" in stored and "delivery " in stored
    leaked = [secret for secret in SECRETS if secret in stored]
    assert leaked == [], [stored[stored.index(s) - 80:stored.index(s) + 20] for s in leaked]
