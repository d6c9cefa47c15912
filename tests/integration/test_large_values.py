"""Large values (decision 61): stored once per task in wal_blobs, content-addressed,
zstd-compressed in 1 MiB chunks, referenced by digest from the event's row, so the chain
and ``verify`` cover them. Against real PostgreSQL."""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

import orjson
import pytest

from wal_engine import blobs, limits
from wal_engine import events as ev
from wal_engine.errors import BlobCorrupt, PayloadTooLarge
from wal_engine.runtime.resume import fork, read_state
from wal_engine.store import Database, Store
from wal_engine.store.records import PendingAppend

from ..helpers import claim, claimed_task, head_args, log_snapshot


def incompressible_text(size: int, seed: int = 0) -> str:
    """``size`` characters of base64 of random bytes (an image, a PDF): zstd gets no more
    than base64's own redundancy out of it."""
    raw = os.urandom(size * 3 // 4 + 3) if seed == 0 else hashlib.shake_256(
        seed.to_bytes(8, "big")).digest(size * 3 // 4 + 3)
    return base64.b64encode(raw).decode()[:size]


FIVE_MIB = 5 * 1024 * 1024


def intended(call_id: str = "c") -> ev.ToolCallIntended:
    return ev.ToolCallIntended(call_id=call_id, tool="fetch", args_hash="0" * 64,
                               idempotency_key=f"key-{call_id}")


def result_events(result: Any, call_id: str = "c") -> list[ev.Event]:
    """A tool call's intent and its (large) result, as one batch."""
    return [intended(call_id), ev.ToolCallCompleted(call_id=call_id, result=result)]


async def _blob_rows(database: Database, task_id: str) -> list[Any]:
    return await database.fetch(
        "SELECT digest, ordinal, value_bytes, octet_length(data) AS stored FROM wal_blobs "
        "WHERE task_id = $1 ORDER BY digest, ordinal", task_id)


async def test_a_large_result_is_stored_once_in_chunks_and_read_back(store: Store) -> None:
    head = await claimed_task(store, "big-1")
    text = incompressible_text(FIVE_MIB)
    result = {"image": text, "kind": "png"}
    first = await store.append_events(
        "big-1", result_events(result, "c1"), **head_args(head, 1))
    # The same value again (a message quoting it): not stored a second time.
    second = await store.append_events(
        "big-1", [ev.MessageAppended(role="tool", content=result)], **head_args(first, 1))
    rows = await _blob_rows(store.database, "big-1")
    encoded = orjson.dumps(result, option=orjson.OPT_SORT_KEYS)
    assert {bytes(row["digest"]) for row in rows} == {hashlib.sha256(encoded).digest()}
    assert [row["ordinal"] for row in rows] == list(range(len(rows))) and len(rows) == 6
    assert all(row["value_bytes"] == len(encoded) for row in rows)
    # The row holds the digest, not the value.
    stored = await store.database.fetch(
        "SELECT seq, octet_length(payload) AS size FROM wal_events WHERE task_id = 'big-1' "
        "ORDER BY seq")
    assert all(row["size"] < 1024 for row in stored)
    history = await store.history("big-1")
    assert history[-2].decode() == ev.ToolCallCompleted(call_id="c1", result=result)
    assert history[-1].decode() == ev.MessageAppended(role="tool", content=result)
    assert history[-1].row_payload is not None and history[-1].row_payload.startswith(
        blobs.ROW_PREFIX)
    report = await store.verify_task("big-1")
    assert report.ok and report.head_seq == second.head_seq


async def test_small_payloads_keep_their_rows(store: Store) -> None:
    head = await claimed_task(store, "small-1")
    value = "x" * (limits.blob_threshold_bytes - 200)
    await store.append_events("small-1", result_events(value),
                              **head_args(head, 1))
    assert await _blob_rows(store.database, "small-1") == []
    last = (await store.history("small-1"))[-1]
    assert last.row_payload is None and last.decode().result == value  # type: ignore[attr-defined]


async def test_a_task_input_and_a_status_move_carry_large_values(store: Store) -> None:
    big_input = {"pdf": incompressible_text(300_000)}
    head, created = await store.create_task("big-in", "agent", input=big_input)
    assert created
    # Idempotent resubmission compares the full value.
    again, created_again = await store.create_task("big-in", "agent", input=big_input)
    assert not created_again and again.head_seq == head.head_seq
    await claim(store.database)
    head = await store.read_head("big-in")
    output = {"transcript": incompressible_text(2_500_000)}
    done = await store.append_events("big-in", [ev.TaskCompleted(output=output)],
                                     **head_args(head, 1))
    assert done.status is not None and done.status.value == "COMPLETED"
    state = (await read_state(store, "big-in", use_snapshot=False)).state
    assert state.output == output and state.input == big_input
    assert (await store.verify_task("big-in")).ok


async def test_a_batch_of_observations_and_group_commit(store: Store) -> None:
    heads = [await claimed_task(store, f"g{i}") for i in range(3)]
    values = [incompressible_text(200_000) for _ in range(3)]
    results = await store.append_many([
        PendingAppend(task_id=f"g{i}", epoch=1, expected_seq=head.head_seq,
                      prev_hash=head.head_hash,
                      events=[ev.MessageAppended(role="user", content=values[i] if i else "hi"),
                              ev.MessageAppended(role="user", content="small")])
        for i, head in enumerate(heads)])
    assert all(not isinstance(result, Exception) for result in results.values())
    for i in range(3):
        history = await store.history(f"g{i}")
        assert history[-2].decode().content == (values[i] if i else "hi")  # type: ignore[attr-defined]
        assert (await store.verify_task(f"g{i}")).ok
    assert await _blob_rows(store.database, "g0") == []
    assert len(await _blob_rows(store.database, "g1")) == 1


async def test_a_value_over_the_limit_is_refused_and_the_log_unchanged(store: Store) -> None:
    head = await claimed_task(store, "huge")
    before = await log_snapshot(store.database)
    too_big = "y" * (limits.payload_bytes_max + 1)
    with pytest.raises(PayloadTooLarge):
        await store.append_events("huge", result_events(too_big),
                                  **head_args(head, 1))
    assert await log_snapshot(store.database) == before
    assert await _blob_rows(store.database, "huge") == []


async def test_a_fenced_append_stores_no_chunk(store: Store) -> None:
    head = await claimed_task(store, "fenced")
    with pytest.raises(Exception):  # noqa: B017 - LeaseLost; what matters is what is stored
        await store.append_events(
            "fenced", result_events(incompressible_text(100_000)),
            **head_args(head, 7))
    assert await _blob_rows(store.database, "fenced") == []


async def test_verify_detects_a_tampered_chunk(store: Store) -> None:
    head = await claimed_task(store, "tampered")
    await store.append_events(
        "tampered", result_events(incompressible_text(FIVE_MIB)),
        **head_args(head, 1))
    assert (await store.verify_task("tampered")).ok
    async with store.database.pool.acquire() as connection:
        # The append-only trigger refuses the change; an attacker with the owner's rights
        # disables it first (the chain makes that evident, this test checks how).
        with pytest.raises(Exception, match="append-only"):
            await connection.execute("UPDATE wal_blobs SET data = data WHERE ordinal = 2")
        async with connection.transaction():
            await connection.execute("SET LOCAL session_replication_role = replica")
            forged = blobs.chunked(b"\0" * 32, b"A" * limits.blob_chunk_bytes)[0].data
            await connection.execute(
                "UPDATE wal_blobs SET data = $1 WHERE task_id = 'tampered' AND ordinal = 2",
                forged)
    report = await store.verify_task("tampered")
    assert not report.ok and report.violation is not None
    assert report.violation.kind == "blob" and report.violation.seq == 4
    assert "does not hash to its digest" in report.violation.detail
    with pytest.raises(BlobCorrupt):
        await store.history("tampered")


async def test_verify_detects_a_missing_chunk(store: Store) -> None:
    head = await claimed_task(store, "missing")
    await store.append_events(
        "missing", result_events(incompressible_text(2_000_000)),
        **head_args(head, 1))
    async with store.database.pool.acquire() as connection, connection.transaction():
        await connection.execute("SET LOCAL session_replication_role = replica")
        await connection.execute("DELETE FROM wal_blobs WHERE task_id = 'missing' "
                                 "AND ordinal = 1")
    report = await store.verify_task("missing")
    assert report.violation is not None and report.violation.kind == "blob"


async def test_a_fork_copies_the_values_its_rows_refer_to(store: Store) -> None:
    head = await claimed_task(store, "parent")
    value = incompressible_text(700_000)
    done = await store.append_events(
        "parent", result_events(value), **head_args(head, 1))
    child = await fork(store, "parent", done.head_seq, child_task_id="child")
    assert (await store.verify_task(child)).ok
    history = await store.history(child)
    assert any(getattr(record.decode(), "result", None) == value for record in history)
    assert len(await _blob_rows(store.database, "child")) == 1


async def test_the_per_task_counter_counts_stored_bytes(store: Store) -> None:
    head = await claimed_task(store, "counted")
    await store.append_events(
        "counted", result_events(incompressible_text(300_000)),
        **head_args(head, 1))
    stored = sum(row["stored"] for row in await _blob_rows(store.database, "counted"))
    counted = await store.database.fetch(
        "SELECT blob_bytes FROM wal_tasks WHERE task_id = 'counted'")
    assert counted[0]["blob_bytes"] == stored > 0


# ----------------------------------------------------------------------------- LangGraph


async def test_a_langgraph_thread_over_one_mib_stores_and_loads(store: Store) -> None:
    """The user's report (issue 21): a tool returning 600 KiB of incompressible text, twice
    in ``messages``: the second checkpoint holds 1.2 MB of history and must store, load and
    verify (before large values it failed with PayloadTooLarge on every retry)."""
    pytest.importorskip("langgraph.graph")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langgraph.graph import START, MessagesState, StateGraph

    from wal_engine.integrations.langgraph import WalCheckpointSaver, thread_task_id

    saver = WalCheckpointSaver(store, worker_id="saver-big")
    await saver.setup()
    images = [incompressible_text(600 * 1024), incompressible_text(600 * 1024)]

    def tool_node(state: MessagesState) -> dict[str, Any]:
        turn = sum(1 for message in state["messages"] if isinstance(message, ToolMessage))
        return {"messages": [ToolMessage(content=images[turn % 2], tool_call_id=f"call-{turn}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("tool", tool_node)
    builder.add_edge(START, "tool")
    graph = builder.compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": "big-thread"}}
    for turn in range(2):
        await graph.ainvoke({"messages": [HumanMessage(content=f"turn {turn}")]}, config)
    state = await graph.aget_state(config)
    tool_texts = [m.content for m in state.values["messages"] if isinstance(m, ToolMessage)]
    assert tool_texts == images
    history = [snapshot async for snapshot in graph.aget_state_history(config)]
    assert len(history) >= 4
    task_id = thread_task_id("big-thread")
    assert (await store.verify_task(task_id)).ok
    rows = await store.database.fetch(
        "SELECT max(octet_length(payload)) AS row_max FROM wal_events WHERE task_id = $1",
        task_id)
    assert rows[0]["row_max"] < 64 * 1024
    assert await _blob_rows(store.database, task_id)
    # A fresh saver (no cache of channel maps) reads the thread back from the log alone.
    fresh = WalCheckpointSaver(store, worker_id="saver-fresh")
    again = builder.compile(checkpointer=fresh)
    state = await again.aget_state(config)
    assert [m.content for m in state.values["messages"]
            if isinstance(m, ToolMessage)] == images
    assert await fresh.rebuild_index("big-thread") > 0
    await again.ainvoke({"messages": [HumanMessage(content="turn 2")]}, config)


# ----------------------------------------------------------------------------- ctx.tool


async def test_a_tool_returning_5_mib_is_stored_and_replayed_after_resume(
        engine: Any) -> None:
    """ctx.tool returns 5 MiB of base64 of random bytes (an image): stored in wal_blobs,
    the task sleeps durably, and the worker that resumes it gets the same value from the
    log (the tool does not run again); a replay of the history agrees."""
    from wal_engine.runtime.context import AgentContext
    from wal_engine.runtime.replayer import check_history
    from wal_engine.state_machine import Status

    from .test_runtime import drive

    image = incompressible_text(FIVE_MIB)
    ran = {"n": 0}
    seen: list[str] = []

    async def screenshot(_: Any) -> dict[str, Any]:
        ran["n"] += 1
        return {"png": image, "width": 1920}

    @engine.agent("shots")
    async def shots(ctx: AgentContext, _: Any) -> Any:
        shot = await ctx.tool("screenshot", screenshot, {"url": "https://example.test"})
        seen.append(hashlib.sha256(shot["png"].encode()).hexdigest())
        await ctx.sleep(0.2)  # Suspends: the next run resumes from the log.
        return {"length": len(shot["png"]), "keys": list(shot)}

    task_id = await engine.submit("shots")
    # The default lease (not the tests' 600 ms): redacting 5 MiB holds the GIL for up to a
    # second on this shared machine, longer than the fast lease (see decision 61).
    state = await drive(engine, task_id, lease_ttl_ms=10_000, heartbeat_ms=1_000)
    assert state.status is Status.COMPLETED, state.failure
    assert state.output == {"length": FIVE_MIB, "keys": ["png", "width"]}
    assert ran["n"] == 1, [(r.seq, r.type) for r in await engine.history(task_id)]
    expected = hashlib.sha256(image.encode()).hexdigest()
    assert len(seen) == 2 and set(seen) == {expected}
    assert (await engine.store.verify_task(task_id)).ok
    report = await check_history(engine, task_id)
    assert report.ok and report.output_matches
    stored = await _blob_rows(engine.database, task_id)
    assert len(stored) == 6 and sum(row["stored"] for row in stored) < FIVE_MIB


async def test_tenant_b_cannot_read_tenant_a_blobs(tenant_roles: Any) -> None:
    """Row security covers wal_blobs: tenant B's role sees none of tenant A's chunks, even
    by digest, and cannot write a chunk under tenant A."""
    from wal_engine.engine import connect

    first = await connect(await tenant_roles.dsn("a"), migrate=False, development=False)
    second = await connect(await tenant_roles.dsn("b"), migrate=False, development=False)
    try:
        head, _ = await first.store.create_task("secret-doc", "agent")
        await claim(first.database)
        head = await first.store.read_head("secret-doc")
        text = incompressible_text(200_000)
        await first.store.append_events("secret-doc", result_events(text),
                                        **head_args(head, 1))
        digests = [bytes(row["digest"]) for row in await first.database.fetch(
            "SELECT digest FROM wal_blobs")]
        assert digests
        assert await second.database.fetch("SELECT * FROM wal_blobs") == []
        assert await second.database.fetch(
            "SELECT * FROM wal_blobs WHERE digest = ANY($1::bytea[])", digests) == []
        with pytest.raises(Exception):  # noqa: B017 - the policy's WITH CHECK refuses it
            await second.database.fetch(
                "INSERT INTO wal_blobs (tenant, task_id, digest, ordinal, value_bytes, data) "
                "VALUES ('a', 'secret-doc', $1, 9, 10485760, '\\x00')", digests[0])
        history = await first.store.history("secret-doc")
        assert history[-1].decode().result == text  # type: ignore[attr-defined]
    finally:
        await first.close()
        await second.close()


# ----------------------------------------------------------------------------- migration


async def test_a_version_2_database_is_migrated_to_the_current_version(
        database_factory: Any) -> None:
    """A database of schema version 2 (no wal_blobs) gets the table, its triggers and the
    per-task counter when the schema is applied; its tasks verify and continue, now with
    large values; an engine refuses the database until then (SchemaMismatch)."""
    import asyncpg

    from wal_engine.errors import SchemaMismatch
    from wal_engine.store.connection import SCHEMA_VERSION, apply_schema

    dsn = await database_factory.create()
    admin = await asyncpg.connect(dsn)
    try:
        database = await Database.open(dsn, migrate=False)
        try:
            store = Store(database)
            head = await claimed_task(store, "old")
            await store.append_events("old", [ev.MessageAppended(role="user", content="hi")],
                                      **head_args(head, 1))
        finally:
            await database.close()
        # Back to version 2: what version 3 added, removed.
        await admin.execute("DROP TABLE wal_blobs CASCADE")
        await admin.execute("DROP FUNCTION wal_count_blob_bytes() CASCADE")
        await admin.execute("ALTER TABLE wal_tasks DROP COLUMN blob_bytes")
        await admin.execute("DELETE FROM wal_schema_version WHERE version > 2")
        await admin.execute("UPDATE wal_schema_version SET version = 2, checksum = 'v2'")
        with pytest.raises(SchemaMismatch):
            await Database.open(dsn, migrate=False)
        assert await apply_schema(admin) is True
        assert await admin.fetchval("SELECT max(version) FROM wal_schema_version") == \
            SCHEMA_VERSION == 5
        assert await apply_schema(admin) is False  # Applied: nothing to do the second time.
    finally:
        await admin.close()
    database = await Database.open(dsn, migrate=False)
    try:
        store = Store(database)
        assert (await store.verify_task("old")).ok
        head = await store.read_head("old")
        value = incompressible_text(500_000)
        await store.append_events("old", result_events(value), **head_args(head, 1))
        assert (await store.history("old"))[-1].decode().result == value  # type: ignore[attr-defined]
        assert (await store.verify_task("old")).ok
    finally:
        await database.close()


async def test_a_streamed_history_holds_a_bounded_share_of_large_values(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of a history read puts back at most ``blob_page_value_bytes_max`` bytes of
    large values (here 300 kB): it ends early, and the stream goes on after it."""
    head = await claimed_task(store, "paged")
    values = [incompressible_text(200_000) for _ in range(4)]
    for index, value in enumerate(values):
        head = await store.append_events("paged", result_events(value, f"c{index}"),
                                         **head_args(head, 1))
    monkeypatch.setattr(limits, "blob_page_value_bytes_max", 300_000)
    page = await store.read_events("paged")
    assert page[-1].payload_cut and len(page) < 2 + 2 * len(values)
    history = await store.history("paged")
    assert [r.seq for r in history] == list(range(1, 3 + 2 * len(values)))
    assert [r.decode().result for r in history  # type: ignore[attr-defined]
            if r.type == "tool_call_completed"] == values
    assert (await store.verify_task("paged")).ok


async def test_a_dumped_history_with_large_values_loads_and_verifies(
        store: Store, database_factory: Any, tmp_path: Any) -> None:
    """The testing plugin's history files hold large values whole; loading one rebuilds the
    rows and chunks the hashes cover, so the loaded task verifies."""
    from wal_engine.testing.replay import dump_history, insert_history, load_history, verify_history

    head = await claimed_task(store, "dumped")
    value = incompressible_text(300_000)
    await store.append_events("dumped", result_events(value), **head_args(head, 1))
    path = tmp_path / "history.jsonl"
    dump_history(await store.history("dumped"), path)
    records = load_history(path)
    assert verify_history(records).ok
    other = await Database.open(await database_factory.create(), migrate=False)
    try:
        await insert_history(other, records)
        loaded = Store(other)
        assert (await loaded.verify_task("dumped")).ok
        assert (await loaded.history("dumped"))[-1].decode().result == value  # type: ignore[attr-defined]
    finally:
        await other.close()
