"""Resume, snapshots and forks against PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from replay import AgentState, UpcasterRegistry, encode_state, fold
from replay import snapshot as snapshot_module
from replay.snapshot import STATE_FORMAT, SnapshotSegments
from tests.helpers import claim
from tests.strategies import histories
from wal_engine import events as ev
from wal_engine.errors import (
    ForkPointInvalid,
    ReplayError,
    SnapshotCorrupt,
    TaskAlreadyExists,
    UnknownTask,
)
from wal_engine.runtime.resume import (
    delete_snapshots,
    fork,
    latest_snapshot_seq,
    read_state,
    resume,
    save_snapshot,
)
from wal_engine.state_machine import Status
from wal_engine.store import Database, Store

_numbers = itertools.count()
few_examples = settings(max_examples=8, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture,
                                               HealthCheck.too_slow])


def steps(count: int) -> list[ev.Event]:
    """``count`` agent steps: messages, an LLM call, a tool call and a checkpoint each."""
    out: list[ev.Event] = []
    for n in range(count):
        out += [
            ev.MessageAppended(role="user", content=f"question {n}"),
            ev.LlmCallIntended(call_id=f"l{n}", model="m", request_hash="h",
                               idempotency_key=f"k{n}"),
            ev.LlmCallCompleted(call_id=f"l{n}", response={"text": f"answer {n}"},
                                input_tokens=10, output_tokens=5, cost_usd=0.01),
            ev.ToolCallIntended(call_id=f"t{n}", tool="search", args={"n": n}, args_hash="a",
                                idempotency_key=f"i{n}"),
            ev.ToolCallCompleted(call_id=f"t{n}", result={"rows": [n]}),
            ev.StepCheckpointed(step=n, next_action={"after": n}),
            ev.StepStarted(step=n + 1),
        ]
    return out


async def seeded(store: Store, events: list[ev.Event], *, submitted: ev.TaskSubmitted | None = None
                 ) -> str:
    """A task created, claimed (seq 2) and then given ``events`` (from seq 3)."""
    task_id = f"task-{next(_numbers)}"
    first = submitted or ev.TaskSubmitted(agent="agent", input={"q": 1})
    await store.create_task(task_id, first.agent, input=first.input, budget=first.budget)
    await claim(store.database)
    head = await store.read_head(task_id)
    for start in range(0, len(events), 500):
        result = await store.append_events(
            task_id, events[start:start + 500], epoch=head.lease_epoch,
            expected_seq=head.head_seq, prev_hash=head.head_hash,
        )
        head = await store.read_head(task_id)
        assert result.head_seq == head.head_seq
    return task_id


async def folded(store: Store, task_id: str, to_seq: int | None = None) -> AgentState:
    """The fold of the task's stored rows (up to ``to_seq``), read the slow way."""
    rows = await store.history(task_id)
    return fold(rows[:to_seq] if to_seq else rows, task_id=task_id)


# ----------------------------------------------------------------------------- resume


async def test_resume_without_snapshot_folds_the_whole_log(store: Store) -> None:
    """With no snapshot, resume folds every event and matches a fold of the history."""
    task_id = await seeded(store, steps(3))
    resumed = await read_state(store, task_id)
    assert resumed.snapshot_seq is None and resumed.events_folded == 23
    assert resumed.round_trips == 1
    assert resumed.state == await folded(store, task_id)
    assert resumed.state.status is Status.RUNNING and resumed.state.usage.llm_calls == 3


async def test_resume_with_snapshot_reads_only_the_tail(store: Store) -> None:
    """With a snapshot, resume reads the head, the snapshot and the tail in one round trip."""
    task_id = await seeded(store, steps(5))
    await save_snapshot(store.database, await folded(store, task_id, 20))
    resumed = await read_state(store, task_id)
    assert (resumed.snapshot_seq, resumed.events_folded, resumed.round_trips) == (20, 17, 1)
    assert resumed.state == await folded(store, task_id)
    assert await resume(store, task_id) == resumed.state


async def test_snapshot_without_hash_takes_the_logs_hash(store: Store) -> None:
    """A snapshot folded without hashes resumes with the log's hash at its seq."""
    task_id = await seeded(store, steps(2))
    state = await folded(store, task_id)
    await save_snapshot(store.database, msgspec.structs.replace(state, last_hash=b""))
    assert await resume(store, task_id) == state


async def test_snapshot_at_the_head_needs_no_tail(store: Store) -> None:
    """A snapshot at the head is the whole answer."""
    task_id = await seeded(store, steps(2))
    state = await folded(store, task_id)
    await save_snapshot(store.database, state)
    resumed = await read_state(store, task_id)
    assert (resumed.snapshot_seq, resumed.events_folded) == (state.last_seq, 0)
    assert resumed.state == state


async def test_long_tail_is_read_in_pages(store: Store) -> None:
    """A tail longer than a page is streamed page by page and folds to the same state."""
    task_id = await seeded(store, steps(4))
    await save_snapshot(store.database, await folded(store, task_id, 5))
    resumed = await read_state(store, task_id, page_events=7)
    assert resumed.events_folded == 25 and resumed.round_trips == 4  # 7 + 7 + 7 + 4
    assert resumed.state == await folded(store, task_id)


@few_examples
@given(history=histories(max_events=40), data=st.data())
async def test_resume_is_the_same_with_and_without_snapshot(
    store: Store, history: list[tuple[int, ev.Event]], data: st.DataObject
) -> None:
    """For generated histories, resume from any snapshot equals resume from the log."""
    assume(len(history) > 2 and isinstance(history[1][1], ev.TaskClaimed))
    submitted = history[0][1]
    assert isinstance(submitted, ev.TaskSubmitted)
    task_id = await seeded(store, [event for _, event in history[2:]], submitted=submitted)
    plain = await read_state(store, task_id)
    at = data.draw(st.integers(1, len(history)), label="snapshot seq")
    with pytest.MonkeyPatch.context() as patch:  # Tiny segments: every field segmented.
        patch.setattr(snapshot_module, "segment_items", data.draw(st.integers(1, 3)))
        await save_snapshot(store.database, await folded(store, task_id, at))
        with_snapshot = await read_state(store, task_id)
    assert with_snapshot.snapshot_seq == at
    assert with_snapshot.state == plain.state == await folded(store, task_id)
    assert encode_state(with_snapshot.state) == encode_state(plain.state)


async def test_resume_of_an_unknown_task(store: Store) -> None:
    """Resuming a task that does not exist raises UnknownTask."""
    with pytest.raises(UnknownTask):
        await resume(store, "no-such-task")


async def test_resume_reads_old_versions_through_upcasters(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows written at an old event version are upcast on resume."""
    task_id = await seeded(store, [ev.MessageAppended(role="user", content="old")])
    monkeypatch.setattr(ev.MessageAppended, "VERSION", 2)
    registry = UpcasterRegistry()
    registry.register("message_appended", 1, lambda payload: {**payload, "name": "upcast"})
    resumed = await read_state(store, task_id, registry=registry)
    assert resumed.state.messages == [ev.MessageAppended(role="user", content="old",
                                                         name="upcast")]


# ----------------------------------------------------------------------------- snapshots


async def _snapshot_seqs(database: Database, task_id: str) -> list[int]:
    rows = await database.fetch(
        "SELECT seq FROM wal_snapshots WHERE task_id = $1 ORDER BY seq", task_id)
    return [row["seq"] for row in rows]


async def test_retention_keeps_the_latest_snapshots(store: Store) -> None:
    """Saving snapshots keeps only the newest keep_latest per task."""
    task_id = await seeded(store, steps(3))
    for seq in (5, 10, 15, 20):
        await save_snapshot(store.database, await folded(store, task_id, seq), keep_latest=2)
    assert await _snapshot_seqs(store.database, task_id) == [15, 20]
    await save_snapshot(store.database, await folded(store, task_id, 22), keep_latest=1)
    assert await _snapshot_seqs(store.database, task_id) == [22]
    assert await latest_snapshot_seq(store.database, task_id) == 22


async def test_saving_the_same_snapshot_twice_is_harmless(store: Store) -> None:
    """A second snapshot at the same seq is ignored (same bytes; first writer wins)."""
    task_id = await seeded(store, steps(1))
    state = await folded(store, task_id)
    assert await save_snapshot(store.database, state) is True
    assert await save_snapshot(store.database, state) is False


async def test_snapshots_of_another_format_are_ignored(store: Store) -> None:
    """A snapshot in an unknown state format is skipped and the log is folded instead."""
    task_id = await seeded(store, steps(1))
    await store.database.fetch(
        "INSERT INTO wal_snapshots (task_id, seq, state, state_format) VALUES ($1, 5, $2, $3)",
        task_id, b"future format", STATE_FORMAT + 1)
    resumed = await read_state(store, task_id)
    assert resumed.snapshot_seq is None and resumed.state == await folded(store, task_id)


async def test_corrupt_snapshot_is_reported_not_swallowed(store: Store) -> None:
    """Undecodable bytes, or a snapshot of another chain, raise SnapshotCorrupt."""
    task_id = await seeded(store, steps(1))
    await store.database.fetch(
        "INSERT INTO wal_snapshots (task_id, seq, state, state_format) VALUES ($1, 4, $2, $3)",
        task_id, b"\xc1garbage", STATE_FORMAT)
    with pytest.raises(SnapshotCorrupt) as caught:
        await resume(store, task_id)
    assert caught.value.seq == 4
    await delete_snapshots(store.database, task_id)
    wrong = msgspec.structs.replace(await folded(store, task_id, 4), last_hash=b"x" * 32)
    await save_snapshot(store.database, wrong)
    with pytest.raises(SnapshotCorrupt, match="hash"):
        await resume(store, task_id)
    await delete_snapshots(store.database, task_id)
    assert await resume(store, task_id) == await folded(store, task_id)


# ----------------------------------------------------------------------------- segments


async def _segments(database: Database, task_id: str) -> list[tuple[str, int, bytes, int]]:
    rows = await database.fetch(
        "SELECT field, ordinal, digest, octet_length(data) AS size FROM wal_snapshot_segments"
        " WHERE task_id = $1 ORDER BY field, ordinal, digest", task_id)
    return [(row["field"], row["ordinal"], row["digest"], row["size"]) for row in rows]


async def _referenced(database: Database, task_id: str) -> set[bytes]:
    rows = await database.fetch(
        "SELECT DISTINCT unnest(segments) AS digest FROM wal_snapshots WHERE task_id = $1",
        task_id)
    return {row["digest"] for row in rows}


async def test_segments_are_stored_compressed_as_sent(store: Store,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments are zstd frames (format 4), and the column is not compressed again."""
    monkeypatch.setattr(snapshot_module, "segment_items", 4)
    task_id = await seeded(store, steps(6))
    await save_snapshot(store.database, await folded(store, task_id))
    rows = await store.database.fetch(
        "SELECT substring(data FOR 4) AS magic FROM wal_snapshot_segments WHERE task_id = $1",
        task_id)
    assert rows and {row["magic"] for row in rows} == {b"\x28\xb5\x2f\xfd"}
    storage = await store.database.fetch(
        "SELECT attstorage FROM pg_attribute"
        " WHERE attrelid = 'wal_snapshot_segments'::regclass AND attname = 'data'")
    assert [row["attstorage"] for row in storage] == [b"e"]  # "char"
    assert await resume(store, task_id) == await folded(store, task_id)


async def test_consecutive_snapshots_store_shared_segments_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later snapshot refers to its predecessor's segments instead of storing them again."""
    monkeypatch.setattr(snapshot_module, "segment_items", 4)
    task_id = await seeded(store, steps(6))
    writer = SnapshotSegments()
    first = await folded(store, task_id, 30)
    await save_snapshot(store.database, first, segments=writer)
    stored = await _segments(store.database, task_id)
    assert len(stored) == 1 + 2  # 4 messages, 8 calls at seq 30.
    last = await folded(store, task_id)
    to_send = writer.encode(last).new
    assert {segment.digest for segment in to_send}.isdisjoint(row[2] for row in stored)
    await save_snapshot(store.database, last, segments=writer)
    after = await _segments(store.database, task_id)
    assert len(after) == len(stored) + len(to_send) == 1 + 3  # 6 messages, 12 calls.
    assert set(stored) <= set(after)
    assert {row[2] for row in after} == await _referenced(store.database, task_id)
    assert sum(row[3] for row in after) == (sum(row[3] for row in stored)
                                            + sum(len(segment.data) for segment in to_send))
    resumed = await read_state(store, task_id)
    assert resumed.state == last and resumed.segments.encode(last).new == []


async def test_changed_pending_call_gets_a_new_segment_and_the_old_one_is_pruned(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment holding a pending call changes digest when the call completes; the old
    segment goes once no kept snapshot refers to it."""
    monkeypatch.setattr(snapshot_module, "segment_items", 2)
    task_id = await seeded(store, [
        ev.ToolCallIntended(call_id="a", tool="t", args_hash="h", idempotency_key="ka"),
        ev.ToolCallIntended(call_id="b", tool="t", args_hash="h", idempotency_key="kb"),
        ev.ToolCallCompleted(call_id="a", result=1),
        ev.MessageAppended(role="user", content="x"),
        ev.MessageAppended(role="user", content="y"),
    ])

    async def calls_digests() -> list[bytes]:
        return [row[2] for row in await _segments(store.database, task_id) if row[0] == "calls"]

    await save_snapshot(store.database, await folded(store, task_id, 4), keep_latest=2)
    (pending,) = await calls_digests()
    await save_snapshot(store.database, await folded(store, task_id, 5), keep_latest=2)
    assert len(await calls_digests()) == 2 and pending in await calls_digests()
    await save_snapshot(store.database, await folded(store, task_id, 7), keep_latest=2)
    (completed,) = await calls_digests()
    assert completed != pending
    assert {row[2] for row in await _segments(store.database, task_id)} == \
        await _referenced(store.database, task_id)
    assert await resume(store, task_id) == await folded(store, task_id)


async def test_missing_or_altered_segment_makes_resume_raise(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deleted or altered segment row is a corrupt snapshot (reported, as any other)."""
    monkeypatch.setattr(snapshot_module, "segment_items", 2)
    task_id = await seeded(store, steps(2))
    state = await folded(store, task_id, 15)
    await save_snapshot(store.database, state)
    await store.database.fetch(
        "DELETE FROM wal_snapshot_segments WHERE task_id = $1 AND field = 'calls'"
        " AND ordinal = 1", task_id)
    with pytest.raises(SnapshotCorrupt, match="missing") as caught:
        await resume(store, task_id)
    assert caught.value.seq == 15
    await delete_snapshots(store.database, task_id)
    assert await _segments(store.database, task_id) == []
    await save_snapshot(store.database, state)
    await store.database.fetch(
        "WITH gone AS (DELETE FROM wal_snapshot_segments WHERE task_id = $1"
        " AND field = 'messages' RETURNING *)"
        " INSERT INTO wal_snapshot_segments (tenant, task_id, field, ordinal, digest, data)"
        " SELECT tenant, task_id, field, ordinal, digest,"
        " data || '\\x00'::bytea FROM gone", task_id)
    with pytest.raises(SnapshotCorrupt, match="digest"):
        await resume(store, task_id)


async def test_writer_whose_segments_vanished_sends_them_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that believes segments stored (they were deleted meanwhile) writes a whole
    snapshot anyway: the store refuses the row, the writer sends every segment."""
    monkeypatch.setattr(snapshot_module, "segment_items", 2)
    task_id = await seeded(store, steps(3))
    writer = SnapshotSegments()
    await save_snapshot(store.database, await folded(store, task_id, 16), segments=writer)
    await delete_snapshots(store.database, task_id)
    assert await save_snapshot(store.database, await folded(store, task_id), segments=writer)
    resumed = await read_state(store, task_id)
    assert resumed.snapshot_seq == 23 and resumed.state == await folded(store, task_id)


async def test_fork_of_a_task_with_segmented_snapshots(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forking reads the log, not snapshots; both parent and child resume to their folds."""
    monkeypatch.setattr(snapshot_module, "segment_items", 2)
    task_id = await seeded(store, steps(3))
    await save_snapshot(store.database, await folded(store, task_id, 16))
    child = await fork(store, task_id, 16)
    assert await resume(store, child) == await folded(store, child)
    await save_snapshot(store.database, await folded(store, child))
    assert (await read_state(store, child)).snapshot_seq is not None
    assert await resume(store, child) == await folded(store, child)
    assert await resume(store, task_id) == await folded(store, task_id)


async def test_resume_checks_the_head(store: Store) -> None:
    """A head that disagrees with its log is a ReplayError."""
    task_id = await seeded(store, steps(1))
    await store.database.fetch(
        "UPDATE wal_tasks SET status = 'RESUMING', status_path = ARRAY['RESUMING'] "
        "WHERE task_id = $1", task_id)
    with pytest.raises(ReplayError, match="head says RESUMING"):
        await resume(store, task_id)


# ----------------------------------------------------------------------------- fork


async def _child_checks(store: Store, parent: str, child: str, at_seq: int) -> AgentState:
    """Check a fork's child against its parent; return the child's resumed state."""
    report = await store.verify_task(child)
    assert report.ok, report.violation
    parent_rows = await store.history(parent)
    child_rows = await store.history(child)
    assert [(r.type, r.version, r.payload) for r in child_rows[1:at_seq]] == [
        (r.type, r.version, r.payload) for r in parent_rows[1:at_seq]]
    assert all(r.epoch == 0 for r in child_rows)
    submitted = child_rows[0].decode()
    assert isinstance(submitted, ev.TaskSubmitted)
    assert (submitted.parent_task_id, submitted.parent_seq) == (parent, at_seq)
    assert child_rows[at_seq].decode() == ev.TaskForked(parent_task_id=parent, parent_seq=at_seq)
    head = await store.read_head(child)
    assert (head.parent_task_id, head.parent_seq, head.lease_epoch) == (parent, at_seq, 0)
    state = await resume(store, child)
    assert (state.parent_task_id, state.parent_seq) == (parent, at_seq)
    assert state.status is head.status
    return state


async def test_fork_mid_step_is_resumable_and_verifies(store: Store) -> None:
    """Forking a RUNNING prefix gives a verifiable RESUMING child that a worker can claim."""
    parent = await seeded(store, steps(3))
    child = await fork(store, parent, 12, child_task_id="child-1")
    assert child == "child-1"
    state = await _child_checks(store, parent, child, 12)
    assert state.status is Status.RESUMING and state.last_seq == 14
    assert state.calls == (await folded(store, parent, 12)).calls
    rows = await claim(store.database, "w9")
    assert [row["task_id"] for row in rows] == [child]
    resumed = await resume(store, child)
    assert resumed.status is Status.RUNNING and resumed.attempts == 2


async def test_fork_at_submission_is_queued(store: Store) -> None:
    """Forking at seq 1 gives a QUEUED child whose claim is a first claim."""
    parent = await seeded(store, steps(1))
    child = await fork(store, parent, 1)
    state = await _child_checks(store, parent, child, 1)
    assert state.status is Status.QUEUED and state.input == {"q": 1}
    await claim(store.database)
    assert (await resume(store, child)).attempts == 1


async def test_fork_of_a_waiting_prefix_is_woken(store: Store) -> None:
    """A prefix that leaves the task WAITING is woken in the child, ready to be claimed."""
    parent = await seeded(store, [ev.TimerStarted(timer_id="z", wake_at_ms=10**13,
                                                  duration_ms=10**9)])
    child = await fork(store, parent, 3)
    state = await _child_checks(store, parent, child, 3)
    assert state.status is Status.RESUMING and state.waiting_on is not None


async def test_fork_of_a_checkpointed_prefix_and_of_a_fork(store: Store) -> None:
    """A CHECKPOINTED prefix is released; a fork of a fork verifies too."""
    parent = await seeded(store, steps(2))
    child = await fork(store, parent, 8)
    assert (await _child_checks(store, parent, child, 8)).next_action == {"after": 0}
    grandchild = await fork(store, child, 9)
    state = await _child_checks(store, child, grandchild, 9)
    assert state.parent_task_id == child


@pytest.mark.parametrize("at_seq", [0, -1, 99])
async def test_fork_outside_the_history_is_refused(store: Store, at_seq: int) -> None:
    """A fork point below 1 or beyond the head is refused and writes nothing."""
    parent = await seeded(store, steps(1))
    with pytest.raises(ForkPointInvalid) as caught:
        await fork(store, parent, at_seq)
    assert caught.value.at_seq == at_seq
    assert len(await store.list_tasks()) == 1


async def test_fork_at_a_terminal_event_is_refused(store: Store) -> None:
    """The terminal event ends a history: nothing can continue from it."""
    parent = await seeded(store, [ev.TaskCompleted(output=1)])
    with pytest.raises(ForkPointInvalid, match="COMPLETED"):
        await fork(store, parent, 3)
    assert (await _child_checks(store, parent, await fork(store, parent, 2), 2)).status is (
        Status.RESUMING)


async def test_fork_of_unknown_task_or_onto_existing_id(store: Store) -> None:
    """Unknown parents and taken child ids are refused."""
    with pytest.raises(UnknownTask):
        await fork(store, "no-such-task", 1)
    parent = await seeded(store, steps(1))
    await fork(store, parent, 2, child_task_id="taken")
    with pytest.raises(TaskAlreadyExists):
        await fork(store, parent, 2, child_task_id="taken")


@few_examples
@given(history=histories(max_events=40), data=st.data())
async def test_fork_anywhere_gives_a_verifiable_claimable_child(
    store: Store, history: list[tuple[int, ev.Event]], data: st.DataObject
) -> None:
    """For generated histories, a fork at any non-terminal seq verifies and can be claimed."""
    assume(len(history) > 2 and isinstance(history[1][1], ev.TaskClaimed))
    submitted = history[0][1]
    assert isinstance(submitted, ev.TaskSubmitted)
    parent = await seeded(store, [event for _, event in history[2:]], submitted=submitted)
    last = len(history) - 1 if fold(history, task_id=parent).terminal else len(history)
    at_seq = data.draw(st.integers(1, last), label="at_seq")
    child = await fork(store, parent, at_seq)
    state = await _child_checks(store, parent, child, at_seq)
    assert state.status in (Status.QUEUED, Status.RESUMING)
    prefix = await folded(store, parent, at_seq)
    for name in ("messages", "calls", "env", "plan", "usage", "signal_ids"):
        assert getattr(state, name) == getattr(prefix, name)


async def test_worker_drops_a_corrupt_snapshot_and_folds_the_log(
    database_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot is derived data: a worker resuming a task whose snapshot lost a segment
    (a racing fenced writer's pruning, or bit rot) folds the log instead, drops the bad
    snapshot, and the task completes as if nothing happened."""
    from wal_engine.engine import connect
    from wal_engine.runtime.context import AgentContext
    from wal_engine.runtime.resume import SnapshotPolicy

    monkeypatch.setattr(snapshot_module, "segment_items", 2)
    engine = await connect(database_dsn, migrate=False, snapshot_policy=SnapshotPolicy(
        on_checkpoint=True, every_events=None, min_events=1))
    try:
        @engine.agent("segmented")
        async def segmented(ctx: AgentContext, task_input: Any) -> Any:
            total = 0
            for n in range(6):
                total += await ctx.tool("add", lambda args: args["n"], {"n": n})
                await ctx.checkpoint(next_action=n)
            go = await ctx.wait_for_signal("go")
            return total + go

        task_id = await engine.submit("segmented")
        worker = engine.worker(concurrency=1, poll_ms=20)
        running = asyncio.create_task(worker.run(until_idle=True))
        await running
        assert (await engine.head(task_id)).status is Status.WAITING
        assert await _segments(engine.database, task_id)
        await engine.database.fetch(
            "DELETE FROM wal_snapshot_segments WHERE task_id = $1 AND ordinal = 0", task_id)
        with pytest.raises(SnapshotCorrupt):
            await resume(engine.store, task_id)
        await engine.signal(task_id, "go", 100)
        worker = engine.worker(concurrency=1, poll_ms=20)
        await worker.run(until_idle=True)
        state = await engine.state(task_id)
        assert state.status is Status.COMPLETED and state.output == 115
        assert (await engine.store.verify_task(task_id)).ok
        assert await resume(engine.store, task_id) == await folded(engine.store, task_id)
    finally:
        await engine.close()


async def test_a_checkpoint_does_not_wait_for_its_snapshot(database_dsn: str) -> None:
    """Snapshots are written in the background (decision 72): with the snapshot table
    locked, the agent still checkpoints, calls its tool and completes; the run then waits
    for its writer before the worker lets the task go, and the snapshot lands once the lock
    is released."""
    import asyncpg

    from wal_engine.engine import connect
    from wal_engine.runtime.context import AgentContext
    from wal_engine.runtime.resume import SnapshotPolicy

    engine = await connect(database_dsn, migrate=False, snapshot_policy=SnapshotPolicy(
        on_checkpoint=True, every_events=None, min_events=1))
    blocker = await asyncpg.connect(database_dsn)
    try:
        @engine.agent("background_snapshot")
        async def agent(ctx: AgentContext, task_input: Any) -> Any:
            first = await ctx.tool("one", lambda args: 1, {})
            await ctx.checkpoint()
            return first + await ctx.tool("two", lambda args: 2, {})

        task_id = await engine.submit("background_snapshot")
        transaction = blocker.transaction()
        await transaction.start()
        await blocker.execute("LOCK TABLE wal_snapshots IN EXCLUSIVE MODE")
        worker = engine.worker(concurrency=1, poll_ms=20)
        running = asyncio.create_task(worker.run(until_idle=True))
        try:
            state = await engine.wait(task_id, timeout_s=20)
            assert state.status is Status.COMPLETED and state.output == 3
            assert await _snapshot_seqs(engine.database, task_id) == []
            assert not running.done()  # The run waits for its snapshot writer.
        finally:
            await transaction.rollback()
        await asyncio.wait_for(running, 20)
        seqs = await _snapshot_seqs(engine.database, task_id)
        assert len(seqs) == 1 and seqs[0] < state.last_seq
        assert await resume(engine.store, task_id) == await folded(engine.store, task_id)
    finally:
        await blocker.close()
        await engine.close()
