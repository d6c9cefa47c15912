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

from collections.abc import Sequence
from typing import Any, Final

import asyncpg

from wal_engine import events as vocabulary
from wal_engine.errors import TaskAlreadyExists
from wal_engine.integrations.langgraph import queries
from wal_engine.integrations.langgraph.codec import thread_task_id, version_key
from wal_engine.integrations.langgraph.reading import (
    Fetch,
    StoredCheckpoint,
    decode_row,
    resolve_values,
    writes_events_max,
)
from wal_engine.integrations.langgraph.thread_log import AGENT, ThreadLog

namespaces_max: Final = 10_000
"""Most checkpoint namespaces of one thread that ``prune`` handles."""

copy_checkpoints_max: Final = 100_000
"""Most checkpoints ``copy_thread`` copies (larger threads: prune first, or archive)."""

copy_page_checkpoints: Final = 500
"""Checkpoints read per round trip while copying."""

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

        async def work(connection: asyncpg.Connection, task_id: str, epoch: int) -> None:
            counts = await connection.fetchrow(queries.THREAD_COUNTS, task_id)
            if counts["checkpoints"] == 0 and counts["writes"] == 0:
                return
            removal = vocabulary.GraphCheckpointsRemoved(
                operation=operation, checkpoints_removed=int(counts["checkpoints"])
            )
            seq = await self.thread_log.append_locked(connection, task_id, epoch, removal)
            await connection.fetchrow(queries.DELETE_THREAD_ROWS, task_id, seq)

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
        async def work(connection: asyncpg.Connection, task_id: str, epoch: int) -> None:
            found = await connection.fetchrow(queries.COUNT_RUN_CHECKPOINTS, task_id, run_ids)
            if found["checkpoints"] == 0:
                return
            removal = vocabulary.GraphCheckpointsRemoved(
                operation="delete_for_runs", run_ids=run_ids,
                checkpoints_removed=int(found["checkpoints"]),
            )
            seq = await self.thread_log.append_locked(connection, task_id, epoch, removal)
            await connection.fetchrow(queries.DELETE_RUN_ROWS, task_id, seq, run_ids)

        await self.thread_log.transact(thread_id, work)

    # ------------------------------------------------------------------ prune

    async def keep_latest(self, thread_id: str) -> None:
        """Keep the newest checkpoint of each namespace (and its writes); hide the rest."""
        task_id = thread_task_id(thread_id)
        if not await _prunable(self.database.fetch, task_id):
            return

        async def work(connection: asyncpg.Connection, task_id: str, epoch: int) -> None:
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
            seq = await self.thread_log.append_locked(connection, task_id, epoch, removal)
            await connection.fetchrow(
                queries.PRUNE_ROWS, task_id, seq, list(kept), list(kept.values())
            )
            await self._collect_values(connection, task_id, seq, kept)

        await self.thread_log.transact(thread_id, work)

    async def _collect_values(
        self, connection: asyncpg.Connection, task_id: str, seq: int, kept: dict[str, str]
    ) -> None:
        """Drop index rows of stored values that no kept checkpoint reads."""
        stored: list[StoredCheckpoint] = []
        for namespace, checkpoint_id in kept.items():
            row = await connection.fetchrow(
                queries.READ_CHECKPOINT, task_id, namespace, checkpoint_id, writes_events_max
            )
            stored.append(decode_row(row, task_id, None))
        await resolve_values(connection.fetch, stored)
        columns: tuple[list[str], list[str], list[str], list[int]] = ([], [], [], [])
        for item in stored:
            versions = item.event.checkpoint.get("channel_versions") or {}
            for channel, source in item.sources.items():
                columns[0].append(item.event.checkpoint_ns)
                columns[1].append(channel)
                columns[2].append(version_key(versions[channel]))
                columns[3].append(source)
        await connection.execute(queries.PRUNE_VALUES, task_id, seq, *columns)

    # ------------------------------------------------------------------ copy

    async def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Append the source's visible checkpoints and writes to the target, atomically."""
        source_task = thread_task_id(source_thread_id)
        stored = await self._read_thread(source_task, source_thread_id)
        if not stored:
            return
        await resolve_values(self.database.fetch, stored)
        stored.sort(key=lambda item: item.seq)
        await self._create_copy_target(target_thread_id, source_task)

        async def work(connection: asyncpg.Connection, task_id: str, epoch: int) -> None:
            emitted: dict[tuple[str, str, str], Any] = {}
            for item in stored:
                await self._copy_checkpoint(connection, task_id, epoch, item, emitted)

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

    async def _copy_checkpoint(
        self, connection: asyncpg.Connection, task_id: str, epoch: int,
        item: StoredCheckpoint, emitted: dict[tuple[str, str, str], Any],
    ) -> None:
        """Append one copied checkpoint with the values the target does not hold yet."""
        event = item.event
        versions = event.checkpoint.get("channel_versions") or {}
        values: dict[str, Any] = {}
        for channel, entry in item.values.items():
            key = (event.checkpoint_ns, channel, version_key(versions[channel]))
            if emitted.get(key) != entry:
                values[channel] = entry
                emitted[key] = entry
        copied = vocabulary.GraphCheckpointSaved(
            checkpoint_ns=event.checkpoint_ns, checkpoint_id=event.checkpoint_id,
            parent_checkpoint_id=event.parent_checkpoint_id, checkpoint=event.checkpoint,
            metadata=event.metadata, values=values,
        )
        run_id = event.metadata.get("run_id")
        await self.thread_log.append_locked(
            connection, task_id, epoch, copied, checkpoint_ns=event.checkpoint_ns,
            checkpoint_id=event.checkpoint_id, run_id=None if run_id is None else str(run_id),
            channels=list(values), version_keys=[version_key(v["v"]) for v in values.values()],
        )
        for writes in item.writes:
            await self.thread_log.append_locked(
                connection, task_id, epoch, writes, checkpoint_ns=writes.checkpoint_ns,
                checkpoint_id=writes.checkpoint_id, writer=writes.graph_task_id,
                idxs=[int(entry["i"]) for entry in writes.writes],
            )

    async def _read_thread(self, task_id: str, thread_id: str) -> list[StoredCheckpoint]:
        """Every visible checkpoint of a thread (all namespaces), page by page."""
        stored: list[StoredCheckpoint] = []
        cursor: tuple[str, str] | None = None
        while len(stored) < copy_checkpoints_max:
            rows = await self.database.fetch(
                queries.LIST_THREAD, task_id, None, None, None, None,
                None if cursor is None else cursor[0], None if cursor is None else cursor[1],
                copy_page_checkpoints, writes_events_max, task_id=task_id,
            )
            stored.extend(decode_row(row, task_id, thread_id) for row in rows)
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
