"""Compressed event rows (decision 71): a long row is stored as one zstd frame, read back as
its content, and ``verify`` still finds every change of that content."""

from __future__ import annotations

import random
from typing import Any

import asyncpg
import pytest
import zstandard

from tests.integration.test_cli_agents import drive
from wal_engine import blobs, limits
from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext

WORDS = ("the agent tool result search query page found returned error retry value table row "
         "user asked answer because which city weather report summary plan next step").split()

def prose(seed: int, length: int) -> str:
    """Text like a conversation's (words of a small vocabulary), different for each seed."""
    generator = random.Random(seed)
    return " ".join(generator.choice(WORDS) for _ in range(length // 5))[:length]


async def stepper(ctx: AgentContext, task_input: Any) -> Any:
    """Three tool steps, each with a ~500-byte argument and a ~1 KB result."""
    results = []
    for step in range(3):
        async def work(args: Any, step: int = step) -> Any:
            return {"result": prose(1000 + step, 1000)}
        results.append(await ctx.tool("work", work, {"message": prose(step, 500)}))
    return {"steps": len(results)}


async def _rows(dsn: str, task_id: str) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(dsn)
    try:
        return list(await connection.fetch(
            "SELECT seq, type, payload FROM wal_events WHERE task_id = $1 ORDER BY seq",
            task_id))
    finally:
        await connection.close()


async def _tamper(dsn: str, task_id: str, seq: int, payload: bytes) -> None:
    """Rewrite one stored payload as a superuser would, around the append-only trigger."""
    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.execute(
                "ALTER TABLE wal_events DISABLE TRIGGER wal_events_append_only")
            await connection.execute(
                "UPDATE wal_events SET payload = $3 WHERE task_id = $1 AND seq = $2",
                task_id, seq, payload)
            await connection.execute(
                "ALTER TABLE wal_events ENABLE TRIGGER wal_events_append_only")
    finally:
        await connection.close()


async def _run(engine: Engine, task_id: str) -> None:
    engine.register("stepper", stepper)
    await engine.submit("stepper", {}, task_id=task_id)
    await drive(engine, task_id)


async def test_long_rows_are_stored_compressed_and_read_back_as_their_content(
        engine: Engine) -> None:
    """A tool step's intent and result rows are zstd frames shorter than their content; the
    history returns the content, short rows stay plain JSON, and the task verifies."""
    await _run(engine, "z-1")
    rows = {row["seq"]: row for row in await _rows(engine.database.dsn, "z-1")}
    history = await engine.history("z-1")
    compressed = 0
    for record in history:
        stored = bytes(rows[record.seq]["payload"])
        assert record.payload.startswith(b"{")
        if len(record.payload) >= limits.row_compress_bytes_min:
            assert stored.startswith(blobs.ROW_MARK)
            assert len(stored) < len(record.payload) * 0.8
            assert blobs.decompress_row(stored, "z-1") == record.payload
            compressed += 1
        else:
            assert stored == record.payload
    assert compressed == 6  # three intents and three results
    assert (await engine.store.verify_task("z-1")).ok
    assert (await engine.state("z-1")).status == "COMPLETED"


@pytest.mark.parametrize("change", ["flipped byte", "other content", "truncated frame",
                                    "another task's dictionary"])
async def test_a_changed_compressed_row_is_named_by_verify(engine: Engine, change: str) -> None:
    """Any change of a compressed row's content, or a frame that no longer decompresses, is
    a hash violation at that seq."""
    await _run(engine, "z-2")
    dsn = engine.database.dsn
    row = next(r for r in await _rows(dsn, "z-2") if r["type"] == "tool_call_completed")
    stored = bytes(row["payload"])
    content = blobs.decompress_row(stored, "z-2")
    if change == "flipped byte":
        forged = stored[:-8] + bytes([stored[-8] ^ 0x01]) + stored[-7:]
    elif change == "other content":
        forged = blobs.compress_row(content.replace(b"the ", b"one ", 1), "z-2")
    elif change == "truncated frame":
        forged = stored[:len(stored) // 2]
    else:
        forged = blobs.compress_row(content, "z-other")
    await _tamper(dsn, "z-2", row["seq"], forged)
    report = await engine.store.verify_task("z-2")
    assert report.violation is not None
    assert (report.violation.seq, report.violation.kind) == (row["seq"], "hash")


async def test_the_chain_covers_the_content_not_its_stored_form(engine: Engine) -> None:
    """The hash covers a row's content: the same content stored plain, or in a frame made
    without the dictionary, still verifies (nothing the log says changed) and reads the same."""
    await _run(engine, "z-3")
    dsn = engine.database.dsn
    before = await engine.history("z-3")
    row = next(r for r in await _rows(dsn, "z-3") if r["type"] == "tool_call_intended")
    content = blobs.decompress_row(bytes(row["payload"]), "z-3")
    parameters = zstandard.ZstdCompressionParameters.from_level(
        9, format=zstandard.FORMAT_ZSTD1_MAGICLESS)
    plain_frame = zstandard.ZstdCompressor(compression_params=parameters).compress(content)
    for stored in (content, blobs.ROW_MARK + plain_frame):
        await _tamper(dsn, "z-3", row["seq"], stored)
        assert (await engine.store.verify_task("z-3")).ok
        assert [r.payload for r in await engine.history("z-3")] == [r.payload for r in before]
