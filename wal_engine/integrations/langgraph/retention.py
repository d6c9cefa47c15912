"""Retention and copy on an append-only log: what ``delete_thread``, ``prune``,
``delete_for_runs`` and ``copy_thread`` do.

Each retention operation is one transaction on the thread's task, holding its row (so no
append slips in between): it appends a ``graph_checkpoints_removed`` event that says what is
removed, then deletes exactly that from the derived index tables, which every read goes
through. ``wal_events`` is never changed, so the chain still verifies; see the docstring of
:mod:`.saver` for why erasure is a separate archival step. An operation with nothing to
remove writes nothing and does not take the thread's lease.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from wal_engine import blobs
from wal_engine import events as vocabulary
from wal_engine.errors import TaskAlreadyExists
from wal_engine.integrations.langgraph import queries
from wal_engine.integrations.langgraph.codec import thread_task_id
from wal_engine.integrations.langgraph.reading import (
    StoredCheckpoint,
    decode_row,
    expand_rows,
    writes_events_max,
)
from wal_engine.integrations.langgraph.thread_log import (
    AGENT,
    LockedTask,
    ThreadLog,
    checkpoint_index,
    writes_index,
)
from wal_engine.store import queries as store_queries

namespaces_max: Final = 10_000
"""Most checkpoint namespaces of one thread that ``prune`` handles."""

copy_checkpoints_max: Final = 100_000
"""Most checkpoints ``copy_thread`` copies (larger threads: prune first, or archive)."""

Fetch = Callable[..., Awaitable[list[Any]]]
"""Runs one query: ``Database.fetch`` on the pool, or a transaction's ``connection.fetch``."""

copy_page_checkpoints: Final = 500
"""Checkpoints read per round trip while copying."""

rebuild_page_events: Final = 1000
"""Events read per round trip by ``rebuild_index``."""

run_tasks_page: Final = 100
"""Threads handled per round of ``delete_for_runs``."""

run_rounds_max: Final = 10_000
"""Most rounds of ``delete_for_runs`` (each round empties its threads of those runs)."""


class Retention:
    """Retention operations and thread copies of one saver.

    Args:
        thread_log: The saver's leases and appends.
    """

    def __init__(self, thread_log: ThreadLog) -> None:
        self.thread_log = thread_log
        self.database = thread_log.database

    # ------------------------------------------------------------------ delete

    async def delete_thread(self, thread_id: str, *, operation: str) -> None:
        """Hide every checkpoint and write of the thread (``operation`` names the caller)."""
        task_id = thread_task_id(thread_id)
        counts = await self.database.fetchrow(queries.THREAD_COUNTS, task_id)
        if counts["checkpoints"] == 0 and counts["writes"] == 0:
            return

        async def work(locked: LockedTask) -> None:
            counts = await locked.connection.fetchrow(queries.THREAD_COUNTS, task_id)
            if counts["checkpoints"] == 0 and counts["writes"] == 0:
                return
            removal = vocabulary.GraphCheckpointsRemoved(
                operation=operation, checkpoints_removed=int(counts["checkpoints"])
            )
            seq = await locked.append(removal)
            await locked.connection.fetchrow(queries.DELETE_THREAD_ROWS, task_id, seq)

        await self.thread_log.transact(thread_id, work)

    async def delete_for_runs(self, run_ids: list[str]) -> None:
        """Hide the checkpoints these runs wrote (and their writes) in every thread."""
        if not run_ids:
            return
        for _ in range(run_rounds_max):
            rows = await self.database.fetch(queries.RUN_TASKS, run_ids, run_tasks_page)
            task_ids = [row["task_id"] for row in rows]
            mapped = await self.database.fetch(queries.THREAD_IDS, task_ids) if rows else []
            for row in mapped:
                await self._delete_runs_of(row["thread_id"], run_ids)
            if len(rows) < run_tasks_page:
                return

    async def _delete_runs_of(self, thread_id: str, run_ids: list[str]) -> None:
        async def work(locked: LockedTask) -> None:
            connection, task_id = locked.connection, locked.task_id
            found = await connection.fetchrow(queries.COUNT_RUN_CHECKPOINTS, task_id, run_ids)
            if found["checkpoints"] == 0:
                return
            removal = vocabulary.GraphCheckpointsRemoved(
                operation="delete_for_runs", run_ids=run_ids,
                checkpoints_removed=int(found["checkpoints"]),
            )
            seq = await locked.append(removal)
            await connection.fetchrow(queries.DELETE_RUN_ROWS, task_id, seq, run_ids)

        await self.thread_log.transact(thread_id, work)

    # ------------------------------------------------------------------ rebuild

    async def rebuild_index(self, thread_id: str) -> int:
        """Rebuild the thread's index rows from its events alone; return the events read.

        The index tables are derived data: checkpoint and writes events add rows, each
        removal event drops what it names. Runs in one transaction holding the task row (no
        append meanwhile); it takes no lease and appends nothing.
        """
        task_id = thread_task_id(thread_id)
        read = 0
        async with self.database.acquire() as connection:
            async with connection.transaction():
                if await connection.fetchrow(queries.LOCK_TASK, task_id) is None:
                    return 0
                await connection.execute(queries.CLEAR_INDEX, task_id)
                next_seq = 1
                while True:
                    rows = await connection.fetch(store_queries.READ_EVENTS, task_id,
                                                  next_seq, 2**62, rebuild_page_events)
                    for row in rows:
                        await _reindex(connection, task_id, row)
                    read += len(rows)
                    if len(rows) < rebuild_page_events:
                        return read
                    next_seq = int(rows[-1]["seq"]) + 1

    # ------------------------------------------------------------------ prune

    async def keep_latest(self, thread_id: str) -> None:
        """Keep the newest checkpoint of each namespace (and its writes); hide the rest."""
        task_id = thread_task_id(thread_id)
        if not await _prunable(self.database.fetch, task_id):
            return

        async def work(locked: LockedTask) -> None:
            connection = locked.connection
            latest = await _prunable(connection.fetch, task_id)
            if not latest:
                return
            delta = await connection.fetchrow(
                queries.HAS_DELTA_CHANNELS, task_id, [int(row["seq"]) for row in latest]
            )
            if delta["found"]:
                raise NotImplementedError(
                    f"keep_latest cannot prune thread {thread_id!r}: it uses a DeltaChannel"
                )
            counts = await connection.fetchrow(queries.THREAD_COUNTS, task_id)
            kept = {row["checkpoint_ns"]: row["checkpoint_id"] for row in latest}
            removal = vocabulary.GraphCheckpointsRemoved(
                operation="prune_keep_latest", kept=kept,
                checkpoints_removed=int(counts["checkpoints"]) - len(kept),
            )
            seq = await locked.append(removal)
            await connection.fetchrow(
                queries.PRUNE_ROWS, task_id, seq, list(kept), list(kept.values())
            )

        await self.thread_log.transact(thread_id, work)

    # ------------------------------------------------------------------ copy

    async def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Append the source's visible checkpoints and writes to the target, atomically."""
        source_task = thread_task_id(source_thread_id)
        stored = await self._read_thread(source_task, source_thread_id)
        if not stored:
            return
        stored.sort(key=lambda item: item.seq)
        await self._create_copy_target(target_thread_id, source_task)

        async def work(locked: LockedTask) -> None:
            holders: dict[tuple[str, str], tuple[Any, int]] = {}
            for item in stored:
                await _copy_checkpoint(locked, item, holders)

        await self.thread_log.transact(target_thread_id, work)

    async def _create_copy_target(self, target_thread_id: str, source_task: str) -> None:
        """Create the target's task naming the source as its parent (if it is new)."""
        if await self.thread_log.exists(target_thread_id):
            return
        head = await self.thread_log.store.read_head(source_task)
        try:
            await self.thread_log.store.create_task(
                thread_task_id(target_thread_id), AGENT, input={"thread_id": target_thread_id},
                parent_task_id=source_task, parent_seq=head.head_seq,
            )
        except TaskAlreadyExists:
            pass  # Created meanwhile by a write to the target: the copy appends to it.

    async def _read_thread(self, task_id: str, thread_id: str) -> list[StoredCheckpoint]:
        """Every visible checkpoint of a thread (all namespaces), page by page."""
        stored: list[StoredCheckpoint] = []
        cursor: tuple[str, str] | None = None
        while len(stored) < copy_checkpoints_max:
            if cursor is None:
                rows = await self.database.fetch(
                    queries.LIST_THREAD, task_id, None, copy_page_checkpoints,
                    writes_events_max, task_id=task_id)
            else:
                rows = await self.database.fetch(
                    queries.LIST_THREAD_BELOW, task_id, *cursor, None, copy_page_checkpoints,
                    writes_events_max, task_id=task_id)
            expanded = await expand_rows(self.database, rows)
            stored.extend(decode_row(row, thread_id, expanded) for row in rows)
            if len(rows) < copy_page_checkpoints:
                return stored
            cursor = (rows[-1]["checkpoint_id"], rows[-1]["checkpoint_ns"])
        raise ValueError(
            f"thread {thread_id!r} has more than {copy_checkpoints_max} checkpoints to copy"
        )


async def _prunable(fetch: Fetch, task_id: str) -> Sequence[Any]:
    """The newest checkpoint of each namespace, if keep_latest would remove anything."""
    latest = await fetch(queries.LATEST_PER_NAMESPACE, task_id, namespaces_max)
    counts = await fetch(queries.THREAD_COUNTS, task_id)
    if not latest or int(counts[0]["checkpoints"]) <= len(latest):
        return []
    return latest


async def _copy_checkpoint(
    locked: LockedTask, item: StoredCheckpoint,
    holders: dict[tuple[str, str], tuple[Any, int]],
) -> None:
    """Append one copied checkpoint: values the target holds already become refs.

    ``holders`` maps (namespace, channel) to the entry last stored in the target and the
    seq of the target event holding it.
    """
    event = item.event
    values: dict[str, Any] = {}
    refs: dict[str, int] = {}
    for channel, entry in item.entries.items():
        held = holders.get((event.checkpoint_ns, channel))
        if held is not None and held[0] == entry:
            refs[channel] = held[1]
        else:
            values[channel] = entry
    copied = vocabulary.GraphCheckpointSaved(
        checkpoint_ns=event.checkpoint_ns, checkpoint_id=event.checkpoint_id,
        parent_checkpoint_id=event.parent_checkpoint_id, checkpoint=event.checkpoint,
        metadata=event.metadata, values=values, refs=refs, big_ints=event.big_ints,
    )
    run_id = event.metadata.get("run_id")
    seq = await locked.append(copied, checkpoint_index(
        event.checkpoint_ns, event.checkpoint_id,
        None if run_id is None else str(run_id), sorted(set(refs.values())),
    ))
    for channel, entry in values.items():
        holders[(event.checkpoint_ns, channel)] = (entry, seq)
    for writes in item.writes:
        await locked.append(writes, writes_index(writes.checkpoint_ns, writes.checkpoint_id))


async def _reindex(connection: Any, task_id: str, row: Any) -> None:
    """Apply one event to the thread's index rows (see ``Retention.rebuild_index``)."""
    seq = int(row["seq"])
    kind = row["type"]
    if kind not in ("graph_checkpoint_saved", "graph_writes_saved", "graph_checkpoints_removed",
                    "task_submitted"):
        return
    # The index needs the skeleton only (ids, refs, metadata: never moved to wal_blobs);
    # large values (channel values, writes) are left out rather than read back.
    event = vocabulary.decode_event(kind, row["version"], blobs.skeleton(row["payload"]), seq)
    if isinstance(event, vocabulary.TaskSubmitted):
        thread_id = event.input.get("thread_id") if isinstance(event.input, dict) else None
        if isinstance(thread_id, str):
            await connection.execute(queries.MAP_THREAD, task_id, thread_id)
    elif isinstance(event, vocabulary.GraphCheckpointSaved):
        run_id = event.metadata.get("run_id")
        await connection.execute(
            queries.INDEX_CHECKPOINT, task_id, event.checkpoint_ns, event.checkpoint_id, seq,
            None if run_id is None else str(run_id), sorted(set(event.refs.values())),
        )
    elif isinstance(event, vocabulary.GraphWritesSaved):
        await connection.execute(queries.INDEX_WRITES, task_id, event.checkpoint_ns,
                                 event.checkpoint_id, seq)
    elif isinstance(event, vocabulary.GraphCheckpointsRemoved):
        if event.operation == "prune_keep_latest":
            await connection.fetchrow(queries.PRUNE_ROWS, task_id, seq, list(event.kept),
                                      list(event.kept.values()))
        elif event.operation == "delete_for_runs":
            await connection.fetchrow(queries.DELETE_RUN_ROWS, task_id, seq, event.run_ids)
        else:
            await connection.fetchrow(queries.DELETE_THREAD_ROWS, task_id, seq)
