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
* An append is the store's fenced append: one statement that moves the head only if the
  epoch, the head seq and the head hash are still the ones this saver holds (the chain hash
  is computed here, :func:`wal_engine.chain.event_hash`), inserting the event and its index
  row. A saver's own appends to one thread are serialised by an asyncio lock (LangGraph
  saves writes from background tasks). A rejected append is retried after reading the head
  again (same epoch: the saver's own retention moved it) or taking the lease back (another
  writer took it), at most :data:`takeovers_max` times. Every change of writer is an event,
  so the log shows who wrote what, under which epoch.

Two live processes writing one thread at the same time therefore alternate the lease (each
switch recorded); LangGraph itself does not run one thread twice at once, and this keeps the
log consistent when it happens anyway.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import asyncpg
import orjson

from wal_engine import events as vocabulary
from wal_engine.chain import event_hash
from wal_engine.errors import IllegalTransition, LeaseLost, TaskAlreadyExists, UnknownTask
from wal_engine.integrations.langgraph import queries
from wal_engine.integrations.langgraph.codec import thread_task_id
from wal_engine.observability.logs import get_logger
from wal_engine.state_machine import LEASED, TERMINAL, Status
from wal_engine.store import Store, sqlstate
from wal_engine.store.connection import CONNECTION_ERRORS
from wal_engine.store.store import Chunks, row_payload

log = get_logger(__name__)

AGENT: Final = "langgraph"
"""The agent name of every thread's task."""

takeovers_max: Final = 8
"""Most times one operation reads the head again or takes the lease back before giving up."""

heads_max: Final = 10_000
"""Threads whose lease and head a saver keeps in memory; a thread that falls out is read
again on its next write (still this saver's lease: no takeover)."""

Index = tuple[str, tuple[Any, ...]]
"""How to index an appended event: the statement and its arguments after the event's."""

NO_INDEX: Final[Index] = (queries.APPEND_EVENT, ())
"""Retention events have no index row."""


def checkpoint_index(namespace: str, checkpoint_id: str, run_id: str | None,
                     ref_seqs: list[int]) -> Index:
    """The index row of a ``graph_checkpoint_saved`` event."""
    return (queries.APPEND_CHECKPOINT, (namespace, checkpoint_id, run_id, ref_seqs))


def writes_index(namespace: str, checkpoint_id: str) -> Index:
    """The index row of a ``graph_writes_saved`` event."""
    return (queries.APPEND_WRITES, (namespace, checkpoint_id))


class Head:
    """The lease and head a writer holds on a task: epoch, head seq, head hash."""

    __slots__ = ("epoch", "hash", "seq")

    def __init__(self, epoch: int, seq: int, hash: bytes) -> None:
        self.epoch = epoch
        self.seq = seq
        self.hash = hash


class LockedTask:
    """A task whose row a transaction holds under this writer's epoch (see ``transact``)."""

    def __init__(self, connection: asyncpg.Connection, task_id: str, head: Head,
                 payload_bytes_max: int) -> None:
        self.connection = connection
        self.task_id = task_id
        self.head = head
        self.payload_bytes_max = payload_bytes_max

    async def append(self, event: vocabulary.Event, index: Index = NO_INDEX) -> int:
        """Append in the transaction; return the new seq (raises LeaseLost if fenced)."""
        seq = await _append(self.connection, self.task_id, self.head, event, index,
                            self.payload_bytes_max)
        if seq is None:
            raise LeaseLost(self.task_id, self.head.epoch)
        return seq


T = TypeVar("T")
Work = Callable[[LockedTask], Awaitable[T]]
"""A retention step: runs in a transaction holding the task row."""


class ThreadLog:
    """Leases and appends of thread tasks for one saver (one writer identity).

    Args:
        store: The wal-engine store (its pool, payload limit and ``create_task``).
        worker_id: The writer's identity, recorded in claim and resume events; or a function
            that makes it, called once, on the first claim (so that building a saver draws
            nothing).
    """

    def __init__(self, store: Store, worker_id: str | Callable[[], str]) -> None:
        self.store = store
        self.database = store.database
        self._worker_id = worker_id
        self.heads: OrderedDict[str, Head] = OrderedDict()
        # Weak: a thread's lock lives while an operation on the thread holds it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary())

    @property
    def worker_id(self) -> str:
        """This writer's identity (made on first use when given as a function)."""
        if callable(self._worker_id):
            self._worker_id = self._worker_id()
        return self._worker_id

    def _lock(self, task_id: str) -> asyncio.Lock:
        lock = self._locks.get(task_id)
        if lock is None:
            lock = self._locks[task_id] = asyncio.Lock()
        return lock

    def _hold(self, task_id: str, head: Head) -> None:
        self.heads[task_id] = head
        self.heads.move_to_end(task_id)
        while len(self.heads) > heads_max:
            self.heads.popitem(last=False)

    async def append(self, thread_id: str, event: vocabulary.Event, index: Index) -> int:
        """Append one event (and its index row) under this saver's lease; return its seq.

        Takes the lease, creating the thread's task if needed, when it is not held or was
        taken over meanwhile.
        """
        task_id = thread_task_id(thread_id)
        async with self._lock(task_id):
            for _ in range(takeovers_max):
                head = self.heads.get(task_id)
                if head is None:
                    head = await self._take_locked(task_id, thread_id)
                try:
                    async with self.database.acquire() as connection:
                        seq = await _append(connection, task_id, head, event, index,
                                            self.store.payload_bytes_max)
                except CONNECTION_ERRORS:
                    # Outcome unknown: the next write reads the head again (same lease).
                    self.heads.pop(task_id, None)
                    raise
                if seq is not None:
                    return seq
                await self._refresh_locked(task_id, thread_id, head)
            raise LeaseLost(task_id, self.heads[task_id].epoch if task_id in self.heads else 0)

    async def transact(self, thread_id: str, work: Work[T]) -> T:
        """Run ``work`` in one transaction that holds the thread's task row under the lease.

        The row lock keeps every other append out, so ``work`` sees all committed events
        of the task and nothing commits between its reads and its writes.
        """
        task_id = thread_task_id(thread_id)
        async with self._lock(task_id):
            for _ in range(takeovers_max):
                head = self.heads.get(task_id) or await self._take_locked(task_id, thread_id)
                held: Head | None = None
                async with self.database.acquire() as connection:
                    async with connection.transaction():
                        row = await _fetchrow(connection, queries.LOCK_TASK_FENCED, task_id,
                                              task_id, head.epoch)
                        if row is not None:
                            held = Head(head.epoch, int(row["head_seq"]), row["head_hash"])
                            result = await work(LockedTask(
                                connection, task_id, held, self.store.payload_bytes_max))
                if held is not None:
                    self._hold(task_id, held)  # Committed: the head the work advanced.
                    return result
                await self._refresh_locked(task_id, thread_id, head)
            raise LeaseLost(task_id, head.epoch)

    async def exists(self, thread_id: str) -> bool:
        """Whether the thread has a task (without creating one)."""
        task_id = thread_task_id(thread_id)
        return await self.database.fetchrow(queries.READ_LEASE, task_id) is not None

    # ------------------------------------------------------------------ leases

    async def _refresh_locked(self, task_id: str, thread_id: str, stale: Head) -> None:
        """After a rejected append: keep the lease if it is still ours, else take it back."""
        row = await self.database.fetchrow(queries.READ_LEASE, task_id)
        if row is not None and int(row["lease_epoch"]) == stale.epoch:
            self._hold(task_id, Head(stale.epoch, int(row["head_seq"]), row["head_hash"]))
        else:
            self.heads.pop(task_id, None)
            await self._take_locked(task_id, thread_id)

    async def _take_locked(self, task_id: str, thread_id: str) -> Head:
        """This saver's lease on the task: still held (read again), else taken (lock held).

        Creates the task first if the thread has none.
        """
        row = await self.database.fetchrow(queries.READ_LEASE, task_id)
        if (row is not None and row["lease_owner"] == self.worker_id
                and row["status"] == Status.RUNNING):
            head = Head(int(row["lease_epoch"]), int(row["head_seq"]), row["head_hash"])
            self._hold(task_id, head)
            return head
        if row is None:
            # A new thread: create its task first rather than fail a claim transaction on it
            # (three round trips fewer on the first write of every thread).
            await self._create(task_id, thread_id)
        try:
            head = await self._claim(task_id, thread_id)
        except UnknownTask:
            await self._create(task_id, thread_id)
            head = await self._claim(task_id, thread_id)
        self._hold(task_id, head)
        log.info("thread_lease_taken", task_id=task_id, epoch=head.epoch,
                 worker_id=self.worker_id)
        return head

    async def _create(self, task_id: str, thread_id: str) -> None:
        """Create the thread's task (QUEUED), unless it was created meanwhile."""
        try:
            await self.store.create_task(task_id, AGENT, input={"thread_id": thread_id})
        except TaskAlreadyExists:
            pass  # Created meanwhile (by a copy, with provenance): _claim checks it.

    async def _claim(self, task_id: str, thread_id: str) -> Head:
        """One transaction: lock the row, orphan a previous holder, claim, map the thread."""
        async with self.database.acquire() as connection:
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
                               task_id, epoch, self.worker_id, thread_id)
                claim = "task_claimed" if status is Status.QUEUED else "task_resumed"
                await _emit(connection, task_id, claim, {
                    "worker_id": self.worker_id, "attempt": int(row["attempts"]) + 1,
                }, epoch, Status.RUNNING)
                head = await _fetchrow(connection, queries.READ_LEASE, task_id, task_id)
        return Head(epoch, int(head["head_seq"]), head["head_hash"])


async def _append(
    connection: asyncpg.Connection, task_id: str, head: Head, event: vocabulary.Event,
    index: Index, payload_bytes_max: int,
) -> int | None:
    """One fenced append on ``head`` (advanced on success); None when rejected."""
    kind, version, payload = vocabulary.encode_event(event, payload_bytes_max=payload_bytes_max)
    # Channel values and writes over 64 KiB go to wal_blobs in the same statement (decision
    # 60): a thread's accumulated history is not bound by the row's size.
    payload, chunks = row_payload(payload)
    seq = head.seq + 1
    digest = event_hash(head.hash, task_id, seq, kind, version, head.epoch, payload)
    statement, index_args = index
    blob_args: tuple[Any, ...] = ()
    if chunks:
        pending = Chunks()
        pending.add(chunks)
        statement, blob_args = queries.WITH_BLOBS[statement], pending.args()
    row = await _fetchrow(connection, statement, task_id, task_id, head.epoch, head.seq,
                          head.hash, digest, kind, version, payload, *index_args, *blob_args)
    if row is None:
        return None
    head.seq, head.hash = seq, digest
    return seq


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
        raise sqlstate.typed(error, task_id) from error


async def _execute(connection: asyncpg.Connection, query: str, task_id: str,
                   *args: Any) -> None:
    """``connection.execute`` with engine errors translated."""
    try:
        await connection.execute(query, *args)
    except asyncpg.PostgresError as error:
        raise sqlstate.typed(error, task_id) from error
