"""The LangGraph saver on real PostgreSQL: storage shape, leases, retention, copies, bridges."""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip(
    "langgraph.checkpoint.base",
    reason="the [langgraph] extra is not installed: pip install 'wal-engine[langgraph]'",
)

from langgraph.checkpoint.base import Checkpoint
from langgraph.checkpoint.base.id import uuid6

from wal_engine.errors import IllegalTransition
from wal_engine.integrations.langgraph import (
    AGENT,
    WalCheckpointSaver,
    thread_task_id,
)
from wal_engine.integrations.langgraph.codec import next_version
from wal_engine.store import Store

BIG_TEXT = "lorem ipsum dolor sit amet " * 400
"""About 11 kB: a channel value whose repetition per checkpoint would show in the log."""


@pytest.fixture
async def saver(store: Store) -> WalCheckpointSaver:
    """A saver with its index tables set up, on the test's fresh database."""
    created = WalCheckpointSaver(store, worker_id="saver-a")
    await created.setup()
    return created


class Thread:
    """Writes a linear chain of checkpoints to one thread, like LangGraph's loop does."""

    def __init__(self, saver: WalCheckpointSaver, thread_id: Any, namespace: str = "") -> None:
        self.saver = saver
        self.thread_id = thread_id
        self.namespace = namespace
        self.parent: str | None = None
        self.versions: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        self.step = -1

    async def put(self, changes: dict[str, Any], **metadata: Any) -> dict[str, Any]:
        """Store the next checkpoint with ``changes`` applied; return its config."""
        self.step += 1
        for channel, value in changes.items():
            self.versions[channel] = self.saver.get_next_version(
                max(self.versions.values(), default=None), None)
            self.values[channel] = value
        checkpoint: Checkpoint = {
            "v": 4, "id": str(uuid6(clock_seq=self.step)),
            "ts": dt.datetime.now(dt.UTC).isoformat(),
            "channel_values": dict(self.values), "channel_versions": dict(self.versions),
            "versions_seen": {"node": dict(self.versions)}, "updated_channels": list(changes),
        }
        configurable = {"thread_id": self.thread_id, "checkpoint_ns": self.namespace}
        if self.parent is not None:
            configurable["checkpoint_id"] = self.parent
        new_versions = {channel: self.versions[channel] for channel in changes}
        stored = await self.saver.aput(
            {"configurable": configurable}, checkpoint,
            {"source": "loop", "step": self.step, "parents": {}, **metadata}, new_versions,
        )
        self.parent = stored["configurable"]["checkpoint_id"]
        return dict(stored)


async def types_of(store: Store, thread_id: str) -> list[str]:
    """The event types of a thread's task, in log order."""
    return [record.type for record in await store.history(thread_task_id(thread_id))]


async def test_a_checkpoint_stores_only_the_channels_that_changed(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """An unchanged large channel is stored once, not per checkpoint, and still read back."""
    thread = Thread(saver, "incremental")
    await thread.put({"document": BIG_TEXT, "counter": 0})
    for counter in range(1, 30):
        last = await thread.put({"counter": counter})
    sizes = await store.database.fetch(
        "SELECT octet_length(payload) AS size FROM wal_events"
        " WHERE task_id = $1 AND type = 'graph_checkpoint_saved' ORDER BY seq",
        thread_task_id("incremental"))
    assert sizes[0]["size"] > len(BIG_TEXT) // 10
    assert max(row["size"] for row in sizes[1:]) < 1024
    loaded = await saver.aget_tuple({"configurable": last["configurable"]})
    assert loaded is not None
    assert loaded.checkpoint["channel_values"] == {"document": BIG_TEXT, "counter": 29}


async def test_old_checkpoints_read_their_own_values(saver: WalCheckpointSaver) -> None:
    """A checkpoint deep in a long thread reads its values as they were, through few refs."""
    thread = Thread(saver, "history")
    await thread.put({"document": "v0", "counter": 0})
    configs = [await thread.put({"counter": step}) for step in range(1, 300)]
    middle = await saver.aget_tuple({"configurable": configs[149]["configurable"]})
    latest = await saver.aget_tuple({"configurable": {"thread_id": "history",
                                                      "checkpoint_ns": ""}})
    assert middle is not None and latest is not None
    assert middle.checkpoint["channel_values"] == {"document": "v0", "counter": 150}
    assert latest.checkpoint["channel_values"] == {"document": "v0", "counter": 299}
    assert latest.parent_config is not None
    assert latest.parent_config["configurable"]["checkpoint_id"] == configs[-2][
        "configurable"]["checkpoint_id"]
    row = await saver.database.fetchrow(
        "SELECT ref_seqs FROM wal_graph_checkpoints WHERE task_id = $1 AND checkpoint_id = $2",
        thread_task_id("history"), latest.config["configurable"]["checkpoint_id"])
    assert len(row["ref_seqs"]) == 1  # The value stored at step 0, whatever the thread's length.


async def test_plain_values_are_auditable_json(saver: WalCheckpointSaver, store: Store) -> None:
    """Plain JSON values are stored as themselves, readable through wal_events_json."""
    thread = Thread(saver, "audit")
    await thread.put({"answer": "forty-two", "score": 42, "items": [1, 2, 3]})
    row = await store.database.fetchrow(
        "SELECT payload -> 'values' -> 'answer' ->> 'j' AS answer,"
        "       payload -> 'values' -> 'score' ->> 'j' AS score,"
        "       payload -> 'values' -> 'items' ->> 't' AS items_type"
        "  FROM wal_events_json WHERE task_id = $1 AND type = 'graph_checkpoint_saved'",
        thread_task_id("audit"))
    assert (row["answer"], row["score"], row["items_type"]) == ("forty-two", "42", "msgpack")


async def test_concurrent_writes_of_one_saver_serialise(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """Forty concurrent put_writes on one thread all land, in one epoch, chain intact."""
    thread = Thread(saver, "concurrent")
    config = await thread.put({"counter": 0})
    await asyncio.gather(*(
        saver.aput_writes(config, [("channel", index)], f"task-{index:02d}")
        for index in range(40)
    ))
    loaded = await saver.aget_tuple(config)
    assert loaded is not None and loaded.pending_writes is not None
    assert sorted(write[2] for write in loaded.pending_writes) == list(range(40))
    history = await store.history(thread_task_id("concurrent"))
    assert [record.seq for record in history] == list(range(1, len(history) + 1))
    assert {record.epoch for record in history[2:]} == {1}
    assert (await store.verify_task(thread_task_id("concurrent"))).ok


async def test_a_forgotten_head_is_read_again_without_a_takeover(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """A saver that lost its cached head (evicted, or an append of unknown outcome) keeps its
    lease: it reads the head again instead of orphaning itself."""
    thread = Thread(saver, "forgetful")
    await thread.put({"counter": 0})
    saver.thread_log.heads.clear()
    await thread.put({"counter": 1})
    types = await types_of(store, "forgetful")
    assert types.count("task_claimed") == 1 and "task_orphaned" not in types
    assert (await store.verify_task(thread_task_id("forgetful"))).ok


async def test_a_cancelled_thread_refuses_further_writes(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """Cancelling the thread's task fences the saver for good: the next put is refused,
    nothing is appended, and reads still work."""
    thread = Thread(saver, "cancelled")
    config = await thread.put({"counter": 0})
    await store.database.fetch("SELECT wal_cancel_task($1, 'operator', 'test')",
                               thread_task_id("cancelled"))
    history = await store.history(thread_task_id("cancelled"))
    with pytest.raises(IllegalTransition):
        await thread.put({"counter": 1})
    assert await store.history(thread_task_id("cancelled")) == history
    assert await saver.aget_tuple(config) is not None
    assert (await store.verify_task(thread_task_id("cancelled"))).ok


async def test_repeated_writes_are_read_once_and_special_writes_replace(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """Writes saved twice read as one (first wins); a special write's later value wins."""
    thread = Thread(saver, "dedup")
    config = await thread.put({"counter": 0})
    await saver.aput_writes(config, [("a", 1), ("b", 2)], "task-1")
    await saver.aput_writes(config, [("a", 10), ("b", 20)], "task-1")
    await saver.aput_writes(config, [("__error__", "first")], "task-2")
    await saver.aput_writes(config, [("__error__", "second")], "task-2")
    loaded = await saver.aget_tuple(config)
    assert loaded is not None
    assert loaded.pending_writes == [
        ("task-1", "a", 1), ("task-1", "b", 2), ("task-2", "__error__", "second")]
    assert (await types_of(store, "dedup")).count("graph_writes_saved") == 4


async def test_a_second_writer_takes_the_thread_over(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """Writers alternate by recorded takeovers; no checkpoint is lost and the chain verifies."""
    other = WalCheckpointSaver(store, worker_id="saver-b")
    first = Thread(saver, "shared")
    await first.put({"counter": 0})
    second = Thread(other, "shared")
    second.parent, second.versions, second.values = first.parent, first.versions, first.values
    second.step = first.step
    await second.put({"counter": 1})
    first.parent, first.step = second.parent, second.step
    await first.put({"counter": 2})
    history = await store.history(thread_task_id("shared"))
    transitions = [(r.type, r.epoch) for r in history if not r.type.startswith("graph_")]
    assert transitions == [
        ("task_submitted", 0), ("task_claimed", 1),
        ("task_orphaned", 2), ("task_resumed", 3),
        ("task_orphaned", 4), ("task_resumed", 5),
    ]
    listed = [t async for t in saver.alist({"configurable": {"thread_id": "shared"}})]
    assert [t.checkpoint["channel_values"]["counter"] for t in listed] == [2, 1, 0]
    assert (await store.verify_task(thread_task_id("shared"))).ok


async def test_prune_keeps_values_the_latest_checkpoint_reads(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """keep_latest hides older checkpoints, keeps values stored by them, and verify passes."""
    thread = Thread(saver, "prune")
    await thread.put({"document": BIG_TEXT, "counter": 0})
    for counter in range(1, 6):
        latest = await thread.put({"counter": counter})
    await saver.aput_writes(latest, [("pending", "kept")], "task-1")
    await saver.aprune(["prune"], strategy="keep_latest")
    listed = [t async for t in saver.alist({"configurable": {"thread_id": "prune"}})]
    assert len(listed) == 1
    assert listed[0].checkpoint["channel_values"] == {"document": BIG_TEXT, "counter": 5}
    assert [w[2] for w in listed[0].pending_writes or []] == ["kept"]
    assert (await types_of(store, "prune"))[-1] == "graph_checkpoints_removed"
    assert (await store.verify_task(thread_task_id("prune"))).ok
    await thread.put({"counter": 6})
    again = await saver.aget_tuple({"configurable": {"thread_id": "prune", "checkpoint_ns": ""}})
    assert again is not None
    assert again.checkpoint["channel_values"] == {"document": BIG_TEXT, "counter": 6}


async def test_delete_thread_is_recorded_and_the_thread_reusable(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """delete_thread hides everything behind a recorded event; the thread id can be reused."""
    thread = Thread(saver, "deleted")
    for counter in range(3):
        await thread.put({"counter": counter})
    await saver.adelete_thread("deleted")
    config = {"configurable": {"thread_id": "deleted", "checkpoint_ns": ""}}
    assert await saver.aget_tuple(config) is None
    removal = (await store.history(thread_task_id("deleted")))[-1]
    assert removal.type == "graph_checkpoints_removed"
    assert removal.decode().checkpoints_removed == 3  # type: ignore[attr-defined]
    assert (await store.verify_task(thread_task_id("deleted"))).ok
    fresh = Thread(saver, "deleted")
    await fresh.put({"counter": 100})
    loaded = await saver.aget_tuple(config)
    assert loaded is not None and loaded.checkpoint["channel_values"] == {"counter": 100}
    assert (await store.verify_task(thread_task_id("deleted"))).ok


async def test_delete_for_runs_spares_values_other_runs_read(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """Deleting a run hides its checkpoints, not values a later run's checkpoint still reads."""
    thread = Thread(saver, "runs")
    await thread.put({"document": BIG_TEXT, "counter": 0}, run_id="run-1")
    await thread.put({"counter": 1}, run_id="run-2")
    await saver.adelete_for_runs(["run-1"])
    listed = [t async for t in saver.alist({"configurable": {"thread_id": "runs"}})]
    assert [t.metadata["run_id"] for t in listed] == ["run-2"]
    assert listed[0].checkpoint["channel_values"] == {"document": BIG_TEXT, "counter": 1}
    assert (await store.verify_task(thread_task_id("runs"))).ok


async def test_copy_of_a_pruned_thread_carries_every_value(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """A copy holds the values its checkpoints read and names the source task as its parent."""
    thread = Thread(saver, "source")
    await thread.put({"document": BIG_TEXT, "counter": 0})
    await thread.put({"counter": 1})
    await saver.aprune(["source"])
    await saver.acopy_thread("source", "copy")
    copied = await saver.aget_tuple({"configurable": {"thread_id": "copy", "checkpoint_ns": ""}})
    assert copied is not None
    assert copied.checkpoint["channel_values"] == {"document": BIG_TEXT, "counter": 1}
    head = await store.read_head(thread_task_id("copy"))
    assert head.parent_task_id == thread_task_id("source") and head.agent == AGENT
    assert (await store.verify_task(thread_task_id("copy"))).ok


async def test_index_rebuilt_from_the_log_alone_is_identical(
    saver: WalCheckpointSaver, store: Store
) -> None:
    """The index tables are derived data: replaying the events, removals included, rebuilds
    them row for row, and reads are unchanged."""
    thread = Thread(saver, "rebuilt")
    await thread.put({"document": BIG_TEXT, "counter": 0}, run_id="run-1")
    for counter in range(1, 4):
        config = await thread.put({"counter": counter}, run_id="run-2")
        await saver.aput_writes(config, [("pending", counter)], f"task-{counter}")
    await saver.adelete_for_runs(["run-1"])
    await saver.aprune(["rebuilt"])
    await thread.put({"counter": 9}, run_id="run-3")

    async def index() -> tuple[list[Any], list[Any]]:
        task_id = thread_task_id("rebuilt")
        checkpoints = await store.database.fetch(
            "SELECT checkpoint_ns, checkpoint_id, seq, run_id, ref_seqs"
            " FROM wal_graph_checkpoints WHERE task_id = $1 ORDER BY seq", task_id)
        writes = await store.database.fetch(
            "SELECT checkpoint_ns, checkpoint_id, seq FROM wal_graph_writes"
            " WHERE task_id = $1 ORDER BY seq", task_id)
        return [tuple(row) for row in checkpoints], [tuple(row) for row in writes]

    before = await index()
    latest = {"configurable": {"thread_id": "rebuilt", "checkpoint_ns": ""}}
    read_before = await saver.aget_tuple(latest)
    await store.database.fetch("DELETE FROM wal_graph_checkpoints WHERE task_id = $1",
                               thread_task_id("rebuilt"))
    assert await saver.rebuild_index("rebuilt") == len(await store.history(
        thread_task_id("rebuilt")))
    assert await index() == before
    read_after = await saver.aget_tuple(latest)
    assert read_before is not None and read_after is not None
    assert read_after.checkpoint == read_before.checkpoint
    assert read_after.checkpoint["channel_values"] == {"document": BIG_TEXT, "counter": 9}


async def test_any_thread_id_maps_to_a_valid_task_id(saver: WalCheckpointSaver) -> None:
    """Plain ids stay readable, others are hashed; int thread ids work end to end."""
    assert thread_task_id("user-1:chat.7") == "lg-user-1:chat.7"
    hashed = thread_task_id("a thread / with spaces and ünïcode")
    assert hashed.startswith("lgh-") and len(hashed) == 4 + 64
    assert thread_task_id("x" * 101).startswith("lgh-")
    thread = Thread(saver, 42)
    await thread.put({"counter": 1})
    loaded = await saver.aget_tuple({"configurable": {"thread_id": 42, "checkpoint_ns": ""}})
    assert loaded is not None and loaded.config["configurable"]["thread_id"] == 42


def test_versions_are_integers_and_string_threads_stay_strings(
    saver: WalCheckpointSaver,
) -> None:
    """The saver mints LangGraph's default integer versions; string versions stay strings."""
    assert saver.get_next_version(None, None) == 1
    assert saver.get_next_version(41, None) == 42
    assert saver.get_next_version("00000000000000000000000000000009.123", None) > (
        "00000000000000000000000000000009.123")
    first = next_version(None)
    second = next_version(first)
    assert first < second and second.split(".")[0] == "000000000002"
    assert next_version(first) != next_version(first)
    assert next_version(7).startswith("000000000008.")
    wide = "0" * 31 + "9.5"
    assert next_version(wide) > wide


async def test_sync_methods_bridge_from_another_thread(saver: WalCheckpointSaver) -> None:
    """Sync calls work from a worker thread and are refused on the saver's own loop."""
    thread = Thread(saver, "sync")
    config = await thread.put({"counter": 1})
    loaded = await asyncio.to_thread(saver.get_tuple, config)
    assert loaded is not None and loaded.checkpoint["channel_values"] == {"counter": 1}
    listed = await asyncio.to_thread(lambda: list(saver.list(config)))
    assert len(listed) == 1
    with pytest.raises(asyncio.InvalidStateError):
        saver.get_tuple(config)


def test_core_library_does_not_import_langgraph() -> None:
    """Importing wal_engine and its store never loads LangGraph (the extra is optional)."""
    probe = ("import sys, wal_engine, wal_engine.store, wal_engine.events, wal_engine.integrations;"
             "print(any(m.split('.')[0] in ('langgraph', 'langchain_core') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True, timeout=60)
    assert result.stdout.strip() == "False"
