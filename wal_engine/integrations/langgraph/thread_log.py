"""The saver's side of the log: one wal-engine task per thread, its lease, fenced appends.

Lease semantics (the latest writer wins; appends are never lost, reordered or interleaved):

* Each thread is one task (``agent="langgraph"``, id from :func:`codec.thread_task_id`),
  created on the thread's first write with its thread id as input.
* A saver appends only under a lease epoch it took itself. Taking the lease is one
  transaction on the task row: a QUEUED task is claimed (``task_claimed``); a task still
  leased by another writer is orphaned first (``task_orphaned``, epoch bumped, so that writer
  is fenced at once) and then resumed (``task_resumed``). The lease has no expiry: a
  LangGraph thread is written by whichever process runs it, and a new process resuming a
  thread after a crash takes the lease over on its first write.
* An append carries the epoch; the database assigns the seq and the chain hash under the
  task row's lock, so one epoch's concurrent appends (LangGraph saves writes from background
  tasks) serialise instead of conflicting. An append fenced by a newer epoch is not written;
  the saver then takes the lease back and appends again, bounded by
  :data:`takeovers_max` attempts. Every change of writer is an event, so the log shows who
  wrote what, under which epoch.

Two live processes writing one thread at the same time therefore alternate the lease (each
switch recorded); LangGraph itself does not support concurrent runs on one thread, and this
keeps the log consistent when it happens anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import asyncpg
import orjson
import structlog

from wal_engine import events as vocabulary
from wal_engine.errors import IllegalTransition, LeaseLost, TaskAlreadyExists, UnknownTask
from wal_engine.integrations.langgraph import queries
from wal_engine.integrations.langgraph.codec import thread_task_id
from wal_engine.state_machine import LEASED, TERMINAL, Status
from wal_engine.store import Store, sqlstate

log = structlog.get_logger(__name__)

AGENT: Final = "langgraph"
"""The agent name of every thread's task."""

takeovers_max: Final = 8
"""Most times one operation takes the lease back after being fenced before giving up."""

T = TypeVar("T")
Work = Callable[[asyncpg.Connection, str, int], Awaitable[T]]
"""A retention step: runs in a transaction holding the task row (connection, task id, epoch)."""


class ThreadLog:
    """Leases and appends of thread tasks for one saver (one writer identity).

    Args:
        store: The wal-engine store (its pool, payload limit and ``create_task``).
        worker_id: The writer's identity, recorded in claim and resume events.
    """

    def __init__(self, store: Store, worker_id: str) -> None:
        self.store = store
        self.database = store.database
        self.worker_id = worker_id
        self.epochs: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ appends

    async def append(
        self,
        thread_id: str,
        event: vocabulary.Event,
        *,
        checkpoint_ns: str | None = None,
        checkpoint_id: str | None = None,
        run_id: str | None = None,
        channels: Sequence[str] = (),
        version_keys: Sequence[str] = (),
        writer: str | None = None,
        idxs: Sequence[int] | None = None,
        dedup: bool = False,
    ) -> int | None:
        """Append one event (and its index rows) under this saver's lease; return its seq.

        Returns None when ``dedup`` is set and the writer already stored these indexes
        for this checkpoint (nothing is appended). Takes the lease, creating the thread's
        task if needed, when it is not held or was taken over.
        """
        task_id = thread_task_id(thread_id)
        kind, version, payload = vocabulary.encode_event(
            event, payload_bytes_max=self.store.payload_bytes_max
        )
        args = (
            kind, version, payload, checkpoint_ns, checkpoint_id, run_id, list(channels),
            list(version_keys), writer, None if idxs is None else list(idxs),
            list(idxs) if dedup and idxs is not None else None,
        )
        epoch: int | None = None
        for _ in range(takeovers_max):
            epoch = self.epochs.get(task_id)
            if epoch is not None:
                row = await self.database.fetchrow(
                    queries.APPEND_EVENT, task_id, epoch, *args, task_id=task_id
                )
                if row["seq"] is not None:
                    return int(row["seq"])
                if row["duplicate"]:
                    return None
            await self.take(task_id, thread_id, stale_epoch=epoch)
        raise LeaseLost(task_id, epoch or 0)

    async def append_locked(
        self,
        connection: asyncpg.Connection,
        task_id: str,
        epoch: int,
        event: vocabulary.Event,
        **index: Any,
    ) -> int:
        """Append inside a transaction that already holds the task row under ``epoch``."""
        kind, version, payload = vocabulary.encode_event(
            event, payload_bytes_max=self.store.payload_bytes_max
        )
        idxs = index.get("idxs")
        row = await _fetchrow(
            connection, queries.APPEND_EVENT, task_id,
            task_id, epoch, kind, version, payload, index.get("checkpoint_ns"),
            index.get("checkpoint_id"), index.get("run_id"), list(index.get("channels", ())),
            list(index.get("version_keys", ())), index.get("writer"),
            None if idxs is None else list(idxs), None,
        )
        if row is None or row["seq"] is None:
            raise LeaseLost(task_id, epoch)
        return int(row["seq"])

    async def transact(self, thread_id: str, work: Work[T]) -> T:
        """Run ``work`` in one transaction that holds the thread's task row under the lease.

        The row lock keeps every other append out, so ``work`` sees all committed events
        of the task and nothing commits between its reads and its writes.
        """
        task_id = thread_task_id(thread_id)
        epoch: int | None = None
        for _ in range(takeovers_max):
            epoch = self.epochs.get(task_id)
            if epoch is not None:
                async with self.database.pool.acquire() as connection:
                    async with connection.transaction():
                        head = await _fetchrow(
                            connection, queries.LOCK_TASK_FENCED, task_id, task_id, epoch
                        )
                        if head is not None:
                            return await work(connection, task_id, epoch)
            await self.take(task_id, thread_id, stale_epoch=epoch)
        raise LeaseLost(task_id, epoch or 0)

    async def exists(self, thread_id: str) -> bool:
        """Whether the thread has a task (without creating one)."""
        task_id = thread_task_id(thread_id)
        return await self.database.fetchrow(queries.READ_LEASE, task_id) is not None

    # ------------------------------------------------------------------ leases

    async def take(self, task_id: str, thread_id: str, *, stale_epoch: int | None) -> int:
        """Take the task's lease (creating the task first if needed); return the new epoch.

        ``stale_epoch`` is the epoch the caller found fenced: when another coroutine of this
        saver already replaced it, that newer epoch is returned without a second takeover.
        """
        lock = self._locks.setdefault(task_id, asyncio.Lock())
        async with lock:
            current = self.epochs.get(task_id)
            if current is not None and current != stale_epoch:
                return current
            try:
                epoch = await self._claim(task_id, thread_id)
            except UnknownTask:
                try:
                    await self.store.create_task(task_id, AGENT, input={"thread_id": thread_id})
                except TaskAlreadyExists:
                    pass  # Created meanwhile (by a copy, with provenance): _claim checks it.
                epoch = await self._claim(task_id, thread_id)
            self.epochs[task_id] = epoch
            log.info("thread_lease_taken", task_id=task_id, epoch=epoch,
                     worker_id=self.worker_id)
            return epoch

    async def _claim(self, task_id: str, thread_id: str) -> int:
        """One transaction: lock the row, orphan a previous holder, claim, map the thread."""
        async with self.database.pool.acquire() as connection:
            async with connection.transaction():
                row = await _fetchrow(connection, queries.LOCK_TASK, task_id, task_id)
                if row is None:
                    raise UnknownTask(task_id)
                if row["agent"] != AGENT:
                    raise TaskAlreadyExists(task_id)
                status = Status(row["status"])
                epoch = int(row["lease_epoch"])
                if status in TERMINAL:
                    raise IllegalTransition(task_id, status, Status.RUNNING)
                if status in LEASED:
                    epoch += 1
                    await _execute(connection, queries.ORPHAN_TASK, task_id, task_id, epoch)
                    await _emit(connection, task_id, "task_orphaned", {
                        "previous_owner": row["lease_owner"], "previous_epoch": epoch - 1,
                    }, epoch, Status.RESUMING)
                    status = Status.RESUMING
                elif status is Status.WAITING:
                    await _emit(connection, task_id, "task_woken", {"reason": "taken_over"},
                                epoch, Status.RESUMING)
                    status = Status.RESUMING
                epoch += 1
                await _execute(connection, queries.CLAIM_TASK, task_id,
                               task_id, epoch, self.worker_id)
                claim = "task_claimed" if status is Status.QUEUED else "task_resumed"
                await _emit(connection, task_id, claim, {
                    "worker_id": self.worker_id, "attempt": int(row["attempts"]) + 1,
                }, epoch, Status.RUNNING)
                await _execute(connection, queries.MAP_THREAD, task_id, task_id, thread_id)
        return epoch


async def _emit(
    connection: asyncpg.Connection, task_id: str, kind: str, payload: dict[str, Any],
    epoch: int, status: Status,
) -> None:
    """Append a transition event written by the database (``wal_emit``) on a locked row."""
    await _fetchrow(connection, queries.EMIT, task_id,
                    task_id, kind, orjson.dumps(payload).decode(), epoch, str(status))


async def _fetchrow(connection: asyncpg.Connection, query: str, task_id: str,
                    *args: Any) -> Any:
    """``connection.fetchrow`` with engine errors translated (one place: store.sqlstate)."""
    try:
        return await connection.fetchrow(query, *args)
    except asyncpg.PostgresError as error:
        translated = sqlstate.translate(error, task_id)
        if translated is None:
            raise
        raise translated from error


async def _execute(connection: asyncpg.Connection, query: str, task_id: str,
                   *args: Any) -> None:
    """``connection.execute`` with engine errors translated."""
    try:
        await connection.execute(query, *args)
    except asyncpg.PostgresError as error:
        translated = sqlstate.translate(error, task_id)
        if translated is None:
            raise
        raise translated from error
