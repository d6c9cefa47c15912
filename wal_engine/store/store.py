"""The PostgreSQL store: create tasks, fenced appends, group commit, reads, verification."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import asyncpg
import msgspec
import orjson

from wal_engine import blobs, limits
from wal_engine import events as vocabulary
from wal_engine.budgets import validate_budget
from wal_engine.chain import (
    GENESIS_HASH,
    VerifyReport,
    Violation,
    effective_key,
    event_hash_v3,
    stored_key,
)
from wal_engine.errors import (
    AmbiguousCommit,
    BlobCorrupt,
    ConcurrencyConflict,
    DatabaseUnavailable,
    DuplicateDedupId,
    DuplicateRow,
    IllegalTransition,
    InvalidInput,
    LeaseLost,
    TaskAlreadyExists,
    TaskArchived,
    UnknownQueue,
    UnknownTask,
    WalError,
)
from wal_engine.ids import validate_task_id
from wal_engine.observability import metrics
from wal_engine.observability.logs import get_logger
from wal_engine.retries import RESOLVE_RETRY, retrying
from wal_engine.security.redaction import Redactor, no_redaction, redact_bounded
from wal_engine.state_machine import Status, check_path
from wal_engine.store import queries
from wal_engine.store.blob_reads import read_values, references_of
from wal_engine.store.connection import CONNECTION_ERRORS, Database
from wal_engine.store.queues import Placement, dedup_holder
from wal_engine.store.records import AppendResult, EventRecord, PendingAppend, TaskHead
from wal_engine.verification import HistoryVerifier

log = get_logger(__name__)

seq_max: Final = 2**63 - 1
"""The largest seq PostgreSQL's bigint holds."""

ambiguous_resolve_s: Final = RESOLVE_RETRY.deadline_s
"""How long an append whose answer was lost is read back before it is AmbiguousCommit."""

DEDUP_INDEX: Final = "wal_tasks_dedup"
"""The unique index of live dedup ids (``schema.sql``, queues section)."""

def _unavailable(error: BaseException) -> bool:
    return isinstance(error, DatabaseUnavailable)


TERMINAL_EVENT_TYPES: Final = frozenset({"task_completed", "task_failed", "task_cancelled"})
"""How long an append whose commit outcome is unknown may take to be resolved."""


class _Batch:
    """One task's events encoded and chained, ready to be bound to a statement."""

    __slots__ = ("chunks", "hashes", "idempotency_keys", "new_hash", "new_status", "path",
                 "payloads", "recorded_at", "types", "versions", "waiting_signal",
                 "wake_after_ms")

    def __init__(self, recorded_at: dt.datetime) -> None:
        self.recorded_at = recorded_at
        self.types: list[str] = []
        self.versions: list[int] = []
        self.payloads: list[bytes] = []
        self.idempotency_keys: list[str | None] = []
        """As stored (``chain.stored_key``)."""
        self.hashes: list[bytes] = []
        self.path: list[str] = []
        self.new_hash = GENESIS_HASH
        self.new_status: str | None = None
        self.wake_after_ms: int | None = None
        self.waiting_signal: str | None = None
        self.chunks = Chunks()


class Chunks:
    """The chunks of the large values of one statement, as its four parallel arrays; a
    value two events of the statement hold is sent once."""

    __slots__ = ("data", "digests", "ordinals", "seen", "sizes")

    def __init__(self) -> None:
        self.digests: list[bytes] = []
        self.ordinals: list[int] = []
        self.sizes: list[int] = []
        self.data: list[bytes] = []
        self.seen: set[tuple[bytes, int]] = set()

    def add(self, chunks: Sequence[blobs.Chunk]) -> None:
        for chunk in chunks:
            key = (chunk.digest, chunk.ordinal)
            if key in self.seen:
                continue
            self.seen.add(key)
            self.digests.append(chunk.digest)
            self.ordinals.append(chunk.ordinal)
            self.sizes.append(chunk.value_bytes)
            self.data.append(chunk.data)

    def args(self) -> tuple[list[bytes], list[int], list[int], list[bytes]]:
        return self.digests, self.ordinals, self.sizes, self.data

    def __bool__(self) -> bool:
        return bool(self.digests)


def row_payload(payload: bytes) -> tuple[bytes, list[blobs.Chunk]]:
    """The row bytes of an event's full encoding and the chunks of its large values
    (:func:`wal_engine.blobs.split`; a payload of 64 KiB or less is returned as it is)."""
    if len(payload) <= limits.blob_threshold_bytes:
        return payload, []
    return blobs.split(payload)


def encode_batch(
    task_id: str,
    events: Sequence[vocabulary.Event],
    *,
    epoch: int,
    expected_seq: int,
    prev_hash: bytes,
    payload_bytes_max: int,
    encoded: Sequence[tuple[str, int, bytes]] | None = None,
    recorded_at: dt.datetime | None = None,
) -> _Batch:
    """Encode, validate and chain one task's events (pure but for the clock; raises
    InvalidInput).

    ``encoded`` carries the events' encodings when the caller already made them. The events
    are chained under chain version 3 (``wal_engine.chain``), stamped ``recorded_at``
    (default: now).
    """
    if not events:
        raise InvalidInput("an append needs at least one event")
    if len(events) > limits.batch_events_max:
        raise InvalidInput(f"more than {limits.batch_events_max} events in one append")
    batch = _Batch(recorded_at or now())
    previous = prev_hash
    for offset, event in enumerate(events, start=1):
        if encoded is None:
            kind, version, payload = vocabulary.encode_event(
                event, payload_bytes_max=payload_bytes_max
            )
        else:
            kind, version, payload = encoded[offset - 1]
        payload, chunks = row_payload(payload)
        if chunks:
            batch.chunks.add(chunks)
        seq, key = expected_seq + offset, getattr(event, "idempotency_key", None)
        digest = event_hash_v3(previous, task_id, seq, kind, version, epoch, batch.recorded_at,
                               key, payload)
        batch.types.append(kind)
        batch.versions.append(version)
        batch.payloads.append(blobs.compress_row(payload, task_id))
        batch.idempotency_keys.append(stored_key(task_id, seq, kind, key))
        batch.hashes.append(digest)
        target = type(event).TARGET_STATUS
        if target is not None:
            batch.path.append(target.value)
        if isinstance(event, vocabulary.TimerStarted):
            batch.wake_after_ms, batch.waiting_signal = event.duration_ms, None
        elif isinstance(event, vocabulary.SignalAwaited):
            batch.wake_after_ms, batch.waiting_signal = event.timeout_ms, event.name
        previous = digest
    batch.new_hash = previous
    batch.new_status = batch.path[-1] if batch.path else None
    return batch


def now() -> dt.datetime:
    """The writer's clock, stamped on the events it appends (covered by their hash)."""
    return dt.datetime.now(dt.UTC)


def check_history_bound(task_id: str, expected_seq: int, events: Sequence[vocabulary.Event],
                        events_max: int) -> None:
    """Refuse a batch that would take a task past ``events_max`` events (InvalidInput).

    A batch that ends the task is always accepted, so that a task at its bound can still
    fail with the reason instead of staying open forever.
    """
    if expected_seq + len(events) <= events_max or not events:
        return
    if type(events[-1]).TARGET_STATUS in (Status.COMPLETED, Status.FAILED):
        return
    raise InvalidInput(f"task {task_id!r} would hold more than {events_max} events")


async def _rollback_quietly(connection: asyncpg.Connection) -> None:
    """End a transaction opened by hand after its statement failed (the pool would also
    roll it back when the connection returns; this keeps the failure the caller's)."""
    with contextlib.suppress(Exception):
        await connection.execute("ROLLBACK")


class Store:
    """Reads and writes the log. Every method is one round trip unless it says otherwise."""

    def __init__(self, database: Database, *, payload_bytes_max: int = limits.payload_bytes_max,
                 redactor: Redactor = no_redaction,
                 events_per_task_max: int = limits.history_events_max):
        self.database = database
        self.payload_bytes_max = payload_bytes_max
        self.redactor = redactor
        """Applied to a task's input before it is written (the engine passes its own)."""
        self.events_per_task_max = events_per_task_max
        """Appends past this many events of one task are refused, except the ending."""

    # ------------------------------------------------------------------ tasks

    async def create_task(
        self,
        task_id: str,
        agent: str,
        *,
        input: Any = None,
        budget: vocabulary.Budget | None = None,
        parent_task_id: str | None = None,
        parent_seq: int | None = None,
        agent_version: str | None = None,
        placement: Placement | None = None,
    ) -> tuple[TaskHead, bool]:
        """Create a QUEUED task with its ``task_submitted`` event at seq 1.

        Idempotent on ``task_id``: submitting the same agent and input again returns the
        existing task and ``False``; a different submission under the same id raises
        :class:`TaskAlreadyExists`, any submission of an archived task's id
        :class:`TaskArchived` (a subclass: the task never runs again). Bad input raises
        before anything is written. The task waits in ``placement``'s queue (``default``):
        an unconfigured queue raises :class:`UnknownQueue`, a dedup id a live task of the
        queue holds :class:`DuplicateDedupId`, and neither writes anything.
        """
        where = placement or Placement()
        try:
            created, payload = await self._insert_task(
                task_id, agent, input=input, budget=budget, parent_task_id=parent_task_id,
                parent_seq=parent_seq, agent_version=agent_version, placement=where,
                connection=None)
        except DuplicateRow as error:
            if error.constraint != DEDUP_INDEX or where.dedup_id is None:
                raise
            holder = await dedup_holder(self.database, where.queue, where.dedup_id)
            raise DuplicateDedupId(where.queue, where.dedup_id, holder) from error
        if created:
            return await self.read_head(task_id), True
        await self._check_same_task(task_id, payload)
        return await self.read_head(task_id), False

    async def _check_same_task(self, task_id: str, payload: bytes) -> None:
        """The id is taken: by this very submission (return), by an archived task
        (:class:`TaskArchived`: it never runs again) or by another task."""
        first = await self.read_events(task_id, from_seq=1, to_seq=1)
        if first and first[0].payload == payload:
            return
        if not first:
            tombstone = await self.database.fetchrow(queries.READ_TOMBSTONE, task_id,
                                                     task_id=task_id)
            if tombstone is not None:
                raise TaskArchived(task_id, tombstone["status"], int(tombstone["retention_id"]))
        raise TaskAlreadyExists(task_id)

    async def create_child_task(self, task_id: str, agent: str, *, parent_task_id: str,
                                input: Any, budget: vocabulary.Budget | None,
                                agent_version: str | None, on_parent_end: str) -> bool:
        """Create a QUEUED child of ``parent_task_id`` (its row names the parent, with no
        fork seq) and its policy ``on_parent_end``, in one transaction; whether it was
        created. Idempotent as :meth:`create_task`: the same child submitted again (a
        parent re-running its spawn after a crash) returns False.

        Raises:
            TaskAlreadyExists: a different task holds the id.
        """
        async with self.database.acquire(task_id) as connection, connection.transaction():
            created, payload = await self._insert_task(
                task_id, agent, input=input, budget=budget, parent_task_id=parent_task_id,
                parent_seq=None, agent_version=agent_version, placement=Placement(),
                connection=connection)
            if created:
                await self.database.fetch(queries.SET_ON_PARENT_END, task_id, on_parent_end,
                                          task_id=task_id, connection=connection)
                return True
        await self._check_same_task(task_id, payload)
        return False

    async def insert_task(self, task_id: str, agent: str, *, input: Any = None,
                          connection: asyncpg.Connection) -> bool:
        """Create a QUEUED task as :meth:`create_task` does, inside the caller's transaction
        on ``connection``; whether it was created (False: a task of that id exists,
        whatever it holds). Schedules fire their ticks with it."""
        created, _ = await self._insert_task(task_id, agent, input=input, budget=None,
                                             parent_task_id=None, parent_seq=None,
                                             agent_version=None, placement=Placement(),
                                             connection=connection)
        return created

    async def _insert_task(
        self, task_id: str, agent: str, *, input: Any, budget: vocabulary.Budget | None,
        parent_task_id: str | None, parent_seq: int | None, agent_version: str | None,
        placement: Placement, connection: asyncpg.Connection | None,
    ) -> tuple[bool, bytes]:
        """Write a task's row and its ``task_submitted`` event unless the id is taken:
        whether it was, and the event's payload. Raises :class:`UnknownQueue` for a queue
        that is not configured (nothing written)."""
        task_id = validate_task_id(task_id)
        if not agent or len(agent) > limits.name_length_max:
            raise InvalidInput(f"agent name must be 1..{limits.name_length_max} characters")
        submitted = vocabulary.TaskSubmitted(
            agent=agent,
            input=redact_bounded(self.redactor, input, self.payload_bytes_max),
            budget=validate_budget(budget or vocabulary.Budget()),
            parent_task_id=parent_task_id,
            parent_seq=parent_seq,
            agent_version=agent_version,
        )
        kind, version, payload = vocabulary.encode_event(
            submitted, payload_bytes_max=self.payload_bytes_max
        )
        stored, chunks = row_payload(payload)
        recorded_at = now()
        digest = event_hash_v3(GENESIS_HASH, task_id, 1, kind, version, 0, recorded_at, None,
                               stored)
        budget_json = orjson.dumps(
            msgspec.to_builtins(submitted.budget), option=orjson.OPT_SORT_KEYS
        ).decode()
        args: tuple[Any, ...] = (task_id, agent, kind, version, blobs.compress_row(stored, task_id),
                                 digest, budget_json, parent_task_id, parent_seq,
                                 agent_version, recorded_at, placement.queue, placement.priority,
                                 placement.partition_key, placement.dedup_id)
        if chunks:
            pending = Chunks()
            pending.add(chunks)
            rows = await self.database.fetch(queries.CREATE_TASK_BLOBS, *args,
                                             *pending.args(), task_id=task_id,
                                             connection=connection)
        else:
            rows = await self.database.fetch(queries.CREATE_TASK, *args, task_id=task_id,
                                             connection=connection)
        if not rows[0]["queue_known"]:
            raise UnknownQueue(placement.queue)
        return bool(rows[0]["created"]), payload

    async def read_head(self, task_id: str) -> TaskHead:
        """The task's head row; raises :class:`UnknownTask`."""
        row = await self.database.fetchrow(queries.READ_HEAD, task_id, task_id=task_id)
        if row is None:
            raise UnknownTask(task_id)
        return head_from_row(row)

    async def list_tasks(
        self,
        *,
        status: Status | str | None = None,
        agent: str | None = None,
        after_task_id: str = "",
        limit: int = 100,
    ) -> list[TaskHead]:
        """Heads ordered by task id, filtered; page with ``after_task_id``. Three round
        trips (a read-only transaction running the page on its generic plan)."""
        limit = max(1, min(limit, 10_000))
        filters = [str(value) for value in (status, agent) if value is not None]
        statement = queries.LIST_TASKS[(status is not None, agent is not None)]
        # The page runs on its generic plan, in a read-only transaction of its own (so the
        # setting ends with it, also through a pooler): at a million tasks PostgreSQL found
        # the generic plan dearer than a custom one and planned every page again, which
        # cost more than the page (benchmarks/scale.py list_page 337-442 µs against
        # 186-202 µs with the generic plan, flat with the empty database's 164-183 µs;
        # docs/scaling.md). Two round trips more than a lone statement; listings are not
        # on a task's path.
        async with self.database.acquire() as connection:
            await connection.execute(queries.BEGIN_GENERIC_PLANS)
            try:
                rows = await connection.fetch(statement, after_task_id, limit, *filters)
            except BaseException:
                await _rollback_quietly(connection)
                raise
            await connection.execute("COMMIT")
        return [head_from_row(row) for row in rows]

    # ------------------------------------------------------------------ appends

    async def append_events(
        self,
        task_id: str,
        events: Sequence[vocabulary.Event],
        *,
        epoch: int,
        expected_seq: int,
        prev_hash: bytes,
        status: Status | None = None,
        connection: asyncpg.Connection | None = None,
        encoded: Sequence[tuple[str, int, bytes]] | None = None,
        via: asyncpg.Connection | None = None,
        recorded_at: dt.datetime | None = None,
    ) -> AppendResult:
        """Append a batch of one task's events in one statement and one commit.

        Fenced: accepted only if the task's lease epoch is ``epoch`` and its head is still
        ``expected_seq`` / ``prev_hash``. Otherwise raises :class:`LeaseLost`,
        :class:`ConcurrencyConflict`, :class:`UnknownTask` or :class:`IllegalTransition`,
        and nothing is written. When ``status`` (the caller's view of the current status) is
        given, status moves are checked before anything is sent. With ``connection`` the
        append joins the caller's transaction (exactly-once effects on this database); its
        commit outcome is then the caller's to resolve. ``via`` sends it on a connection the
        caller holds (not in a transaction), with the usual resolution of an unknown outcome.
        ``recorded_at`` is the time stamped on the events (default: now).
        """
        check_history_bound(task_id, expected_seq, events, self.events_per_task_max)
        hashes: Sequence[bytes]
        if len(events) == 1 and type(events[0]).TARGET_STATUS is None:
            # One observation, the append of nearly every call and message: its statement
            # without building a batch.
            statement, args, hashes = _observation(
                task_id, events[0], None if encoded is None else encoded[0], epoch=epoch,
                expected_seq=expected_seq, prev_hash=prev_hash,
                payload_bytes_max=self.payload_bytes_max, recorded_at=recorded_at)
            new_status = None
        else:
            batch = encode_batch(
                task_id, events, epoch=epoch, expected_seq=expected_seq, prev_hash=prev_hash,
                payload_bytes_max=self.payload_bytes_max, encoded=encoded,
                recorded_at=recorded_at,
            )
            if status is not None and batch.path:
                check_path(status, (Status(name) for name in batch.path), task_id)
            statement, args = _append_statement(task_id, epoch, expected_seq, prev_hash, batch)
            hashes, new_status = batch.hashes, batch.new_status
        if connection is not None:
            rows = await self.database.fetch(statement, *args, task_id=task_id,
                                             connection=connection)
            if len(rows) != len(events):
                raise await self._rejection(task_id, epoch, expected_seq)
            metrics.events_appended(len(events))
            return _accepted(task_id, expected_seq, len(events), hashes[-1], new_status)
        started = metrics.clock()
        try:
            rows = await self.database.fetch(statement, *args, task_id=task_id, connection=via)
        except CONNECTION_ERRORS as error:
            rows = await self._resolve_ambiguous(task_id, expected_seq, hashes, error)
        except DuplicateRow:
            rows = []  # Another writer took the seq first: classified below.
        except IllegalTransition as refused:
            metrics.append_observed("single", started, 0)
            raise await self._rejection(task_id, epoch, expected_seq, refused) from refused
        if len(rows) != len(events):
            metrics.append_observed("single", started, 0)
            raise await self._rejection(task_id, epoch, expected_seq)
        metrics.append_observed("single", started, len(events))
        return _accepted(task_id, expected_seq, len(events), hashes[-1], new_status)

    async def append_many(
        self, appends: Sequence[PendingAppend], *, via: asyncpg.Connection | None = None
    ) -> dict[str, AppendResult | WalError]:
        """Group commit: many tasks' batches in one statement and one commit.

        Each task is fenced on its own; the result maps each task id to its new head or to
        the error that rejected it (the others are unaffected).
        """
        if not appends:
            return {}
        if len({append.task_id for append in appends}) != len(appends):
            raise InvalidInput("group commit takes at most one batch per task")
        batches = [
            encode_batch(
                a.task_id, a.events, epoch=a.epoch, expected_seq=a.expected_seq,
                prev_hash=a.prev_hash, payload_bytes_max=self.payload_bytes_max,
                encoded=a.encoded, recorded_at=a.recorded_at,
            )
            for a in appends
        ]
        if any(batch.chunks for batch in batches):
            # Large values travel with their own task's statement (its chunks under its
            # fence); the others still share one.
            return await self._append_split(appends, batches, via)
        started = metrics.clock()
        try:
            rows = await self.database.fetch(queries.APPEND_MANY, *_many_args(appends, batches),
                                             connection=via)
        except (DatabaseUnavailable, AmbiguousCommit):
            raise  # The outcome is unknown, not refused: the committer reads it back.
        except WalError:
            # One task's batch voided the shared statement (a racing writer took one of its
            # seqs or moved its status first, or the database refused its rows for any other
            # reason): append task by task, so that only that task is refused and the
            # others land. Any refusal, not a list of the expected ones: an error left to
            # void the group reached every run sharing the commit as a failure of its own.
            return await self._append_each(appends, batches)
        accepted = {row["task_id"] for row in rows}
        metrics.append_observed("group", started, sum(
            len(append.events) for append in appends if append.task_id in accepted))
        results: dict[str, AppendResult | WalError] = {}
        for append, batch in zip(appends, batches, strict=True):
            if append.task_id in accepted:
                results[append.task_id] = _accepted(
                    append.task_id, append.expected_seq, len(append.events), batch.new_hash,
                    batch.new_status,
                )
            else:
                results[append.task_id] = await self._rejection(
                    append.task_id, append.epoch, append.expected_seq
                )
        return results

    async def _append_split(
        self, appends: Sequence[PendingAppend], batches: Sequence[_Batch],
        via: asyncpg.Connection | None,
    ) -> dict[str, AppendResult | WalError]:
        """Group commit when some batches carry large values: the others in one statement,
        each of those in its own."""
        plain = [a for a, b in zip(appends, batches, strict=True) if not b.chunks]
        results = await self.append_many(plain, via=via) if plain else {}
        for append, batch in zip(appends, batches, strict=True):
            if batch.chunks:
                results.update(await self._append_each([append], [batch]))
        return results

    async def _append_each(
        self, appends: Sequence[PendingAppend], batches: Sequence[_Batch]
    ) -> dict[str, AppendResult | WalError]:
        results: dict[str, AppendResult | WalError] = {}
        for append, _batch in zip(appends, batches, strict=True):
            try:
                # The events' full encodings (the batch holds their rows, large values
                # split off): encoded again by the single append, chunks included.
                results[append.task_id] = await self.append_events(
                    append.task_id, append.events, epoch=append.epoch,
                    expected_seq=append.expected_seq, prev_hash=append.prev_hash,
                    encoded=append.encoded,
                )
            except WalError as error:
                results[append.task_id] = error
        return results

    async def resolve_append(self, append: PendingAppend,
                             error: BaseException) -> AppendResult:
        """The outcome of ``append`` after the connection of a shared (group) commit failed:
        its events read back by hash (RELIABILITY.md R4), never sent again blindly.

        Committed: its result. Other events at its seqs: the rejection (LeaseLost,
        ConcurrencyConflict). Nothing there: :class:`DatabaseUnavailable`, as for a single
        append whose answer was lost.
        """
        batch = encode_batch(
            append.task_id, append.events, epoch=append.epoch,
            expected_seq=append.expected_seq, prev_hash=append.prev_hash,
            payload_bytes_max=self.payload_bytes_max, encoded=append.encoded,
            recorded_at=append.recorded_at,
        )
        rows = await self._resolve_ambiguous(append.task_id, append.expected_seq,
                                             batch.hashes, error)
        if len(rows) != len(append.events):
            raise await self._rejection(append.task_id, append.epoch, append.expected_seq)
        metrics.events_appended(len(append.events))
        return _accepted(append.task_id, append.expected_seq, len(append.events),
                         batch.new_hash, batch.new_status)

    async def _rejection(self, task_id: str, epoch: int, expected_seq: int,
                         refused: IllegalTransition | None = None) -> WalError:
        """Classify a refused append (a second round trip, on the failure path only).

        Every epoch change is an event with the new epoch, so the log's last event tells
        a fenced writer (newer epoch) from one that lost a race for the seq. ``refused``:
        the status trigger's refusal, which runs before the unique seq does, so a task
        another writer moved since ``expected_seq`` (a signal's sender woke it) is a lost
        race too; only a head still at ``expected_seq`` makes the move itself illegal.
        """
        row = await self.database.fetchrow(queries.READ_LAST_EVENT, task_id, task_id=task_id)
        if row is None:
            return UnknownTask(task_id)
        if row["epoch"] != epoch:
            current = await self.database.fetchrow(queries.READ_HEAD, task_id, task_id=task_id)
            return LeaseLost(task_id, epoch, None if current is None else current["lease_epoch"])
        if refused is not None and int(row["seq"]) == expected_seq:
            return IllegalTransition(task_id, refused.from_status, refused.to_status)
        if row["type"] in TERMINAL_EVENT_TYPES:
            return IllegalTransition(task_id, "terminal", "append")
        if row["type"] in queries.LEASE_DROPPED_TYPES and int(row["seq"]) == expected_seq:
            # The task began to wait or was handed back: its lease is gone (the epoch
            # moves when the next worker claims it).
            return LeaseLost(task_id, epoch, epoch)
        return ConcurrencyConflict(task_id, expected_seq, int(row["seq"]))

    async def _resolve_ambiguous(
        self, task_id: str, expected_seq: int, hashes: Sequence[bytes], error: BaseException
    ) -> list[Any]:
        """Decide whether an append whose connection failed was committed.

        Resolution reads the events back by their (task_id, seq) keys and compares hashes
        (RELIABILITY.md R4); it never relies on ``pg_xact_status``. Returns the rows as if
        the append had answered (empty when it was not applied).
        """
        log.warning("append_outcome_unknown", task_id=task_id, seq=expected_seq + 1,
                    error=type(error).__name__)
        last_seq = expected_seq + len(hashes)
        try:
            rows = await retrying(
                RESOLVE_RETRY,
                lambda: self.database.fetch(
                    queries.READ_EVENT_HASHES, task_id, expected_seq + 1, last_seq,
                    len(hashes), task_id=task_id, fresh=True),
                retry_if=_unavailable, key=task_id)
        except DatabaseUnavailable:
            raise AmbiguousCommit(task_id, expected_seq + 1) from error
        stored = {row["seq"]: row["hash"] for row in rows}
        if all(stored.get(expected_seq + i + 1) == h for i, h in enumerate(hashes)):
            log.info("append_outcome_resolved", task_id=task_id, committed=True)
            return list(rows)
        log.info("append_outcome_resolved", task_id=task_id, committed=False)
        if not stored:
            raise DatabaseUnavailable(self.database.dsn_redacted, f"append not applied: {error}")
        return []

    # ------------------------------------------------------------------ reads

    async def read_events(
        self,
        task_id: str,
        *,
        from_seq: int = 1,
        to_seq: int = 2**62,
        limit: int = limits.read_page_events,
    ) -> list[EventRecord]:
        """Up to ``limit`` events with ``from_seq <= seq <= to_seq``, in seq order."""
        # Bounds beyond bigint (a caller's fork point of 2**70, say) mean "to the end", not
        # a client-side encoding error.
        rows = await self.database.fetch(
            queries.READ_EVENTS, task_id, min(max(1, from_seq), seq_max),
            min(to_seq, seq_max), limit, task_id=task_id
        )
        records = [record_from_row(row) for row in rows]
        if any(record.payload.startswith(blobs.ROW_PREFIX) for record in records):
            return await self._with_values(task_id, _within_value_budget(task_id, records))
        return records

    async def _with_values(self, task_id: str, records: list[EventRecord],
                           *, problems: dict[int, str] | None = None) -> list[EventRecord]:
        """``records`` with their large values put back (one page of chunks per round trip
        for all of them). BlobCorrupt for a missing or altered value, or, with ``problems``,
        the record left as stored and the problem noted under its seq (``verify``)."""
        wanted: list[blobs.Reference] = []
        for record in records:
            if record.payload.startswith(blobs.ROW_PREFIX):
                try:
                    wanted += references_of(task_id, record.payload, record.seq)
                except BlobCorrupt as error:
                    if problems is None:
                        raise
                    problems[record.seq] = error.detail
        try:
            values = await read_values(self.database, task_id, wanted)
        except BlobCorrupt:
            if problems is None:
                raise
            values = await self._values_one_by_one(task_id, records, problems)
        result: list[EventRecord] = []
        for record in records:
            if (record.payload.startswith(blobs.ROW_PREFIX) and record.seq not in
                    (problems or {})):
                full = blobs.expand(record.payload, values)
                record = msgspec.structs.replace(record, payload=full,
                                                 row_payload=record.payload)
            result.append(record)
        return result

    async def _values_one_by_one(self, task_id: str, records: list[EventRecord],
                                 problems: dict[int, str]) -> dict[bytes, bytes]:
        """The values of ``records`` read record by record, noting which record's fail."""
        values: dict[bytes, bytes] = {}
        for record in records:
            if record.seq in problems or not record.payload.startswith(blobs.ROW_PREFIX):
                continue
            try:
                values.update(await read_values(
                    self.database, task_id, references_of(task_id, record.payload, record.seq),
                    seq=record.seq))
            except BlobCorrupt as error:
                problems[record.seq] = error.detail
        return values

    async def stream_events(
        self,
        task_id: str,
        *,
        from_seq: int = 1,
        to_seq: int = 2**62,
        page_events: int = limits.read_page_events,
    ) -> AsyncIterator[EventRecord]:
        """Yield a task's events in seq order, one bounded page per round trip."""
        next_seq = max(1, from_seq)
        while next_seq <= to_seq:
            page = await self.read_events(
                task_id, from_seq=next_seq, to_seq=to_seq, limit=page_events
            )
            for record in page:
                yield record
            if not page or (len(page) < page_events and not page[-1].payload_cut):
                return
            next_seq = page[-1].seq + 1

    async def history(self, task_id: str) -> list[EventRecord]:
        """The whole history of a task (paged underneath); raises UnknownTask."""
        records = [record async for record in self.stream_events(task_id)]
        if not records:
            await self.read_head(task_id)
        return records

    async def verify_task(self, task_id: str) -> VerifyReport:
        """Recompute the task's chain from the stored rows, check what the events mean
        (:mod:`wal_engine.verification`) and compare with its head.

        The task row records the head as of its last status move; the log must reach it
        with the same hash (a tail deleted below it is caught here; a tail deleted above it
        only by an external anchor, RELIABILITY.md S7).
        """
        recorded = await self.database.fetchrow(queries.READ_RECORDED_HEAD, task_id,
                                                task_id=task_id)
        if recorded is None:
            raise UnknownTask(task_id)
        below = await self.database.fetchrow(queries.READ_SEQ_BELOW_ONE, task_id,
                                             task_id=task_id)
        if below is not None:
            return VerifyReport(task_id=task_id, events=0, head_seq=0, head_hash=GENESIS_HASH,
                                violation=Violation(seq=int(below["seq"]), kind="seq",
                                                    detail="a stored seq below 1"))
        verifier = HistoryVerifier(task_id, lease_epoch=int(recorded["lease_epoch"]))
        hash_at_recorded_head: bytes | None = None
        blob_violation: Violation | None = None
        async for record in self._verified_records(task_id):
            if isinstance(record, Violation):
                blob_violation = record
                break
            if not verifier.feed(record):
                break
            if record.seq == recorded["head_seq"]:
                hash_at_recorded_head = record.hash
        report = verifier.report()
        if report.ok and blob_violation is not None:
            return msgspec.structs.replace(report, violation=blob_violation)
        if report.ok and hash_at_recorded_head != recorded["head_hash"]:
            violation = Violation(
                seq=min(verifier.last_seq, int(recorded["head_seq"])) + 1
                if hash_at_recorded_head is None else int(recorded["head_seq"]),
                kind="head",
                detail=f"the task row records head seq {recorded['head_seq']}, which the log "
                       f"{'does not reach' if hash_at_recorded_head is None else 'contradicts'}",
            )
            report = msgspec.structs.replace(report, violation=violation)
        return report

    async def _verified_records(self, task_id: str) -> AsyncIterator[EventRecord | Violation]:
        """The task's records for ``verify``: its large values read back and checked against
        their digests (the row's digest is what the chain covers); the first value that is
        missing, altered or malformed ends the stream as a ``blob`` violation."""
        next_seq = 1
        page_events = limits.read_page_events
        while True:
            rows = await self.database.fetch(queries.READ_EVENTS, task_id, next_seq, seq_max,
                                             page_events, task_id=task_id)
            records = [record_from_row(row) for row in rows]
            problems: dict[int, str] = {}
            if any(record.payload.startswith(blobs.ROW_PREFIX) for record in records):
                records = await self._with_values(task_id, records, problems=problems)
            for record in records:
                if record.seq in problems:
                    yield Violation(seq=record.seq, kind="blob",
                                    detail=f"a large value of the event: "
                                           f"{problems[record.seq]}")
                    return
                yield record
            if len(records) < page_events:
                return
            next_seq = records[-1].seq + 1

    async def verify_orphans(self, *, limit: int = 1000) -> list[VerifyReport]:
        """Reports for up to ``limit`` task ids that have events but no task row (a scan of
        the tenant's whole log: ``verify --all`` only)."""
        rows = await self.database.fetch(queries.ORPHAN_EVENT_TASKS, limit)
        return [VerifyReport(task_id=row["task_id"], events=int(row["events"]), head_seq=0,
                             head_hash=GENESIS_HASH,
                             violation=Violation(seq=int(row["seq"]), kind="orphan",
                                                 detail=f"{row['events']} event(s) of a task "
                                                        f"that has no task row"))
                for row in rows]


def _within_value_budget(task_id: str, records: list[EventRecord]) -> list[EventRecord]:
    """The longest prefix of a page whose large values hold at most
    ``limits.blob_page_value_bytes_max`` bytes (at least one record); its last record is
    marked ``payload_cut`` when the page was cut, so that a streamed read goes on after it."""
    total = 0
    for index, record in enumerate(records):
        if record.payload.startswith(blobs.ROW_PREFIX):
            total += sum(ref.value_bytes
                         for ref in references_of(task_id, record.payload, record.seq))
            if total > limits.blob_page_value_bytes_max and index > 0:
                kept = records[:index]
                kept[-1] = msgspec.structs.replace(kept[-1], payload_cut=True)
                return kept
    return records


def _accepted(task_id: str, expected_seq: int, count: int, head_hash: bytes,
              new_status: str | None) -> AppendResult:
    return AppendResult(
        task_id=task_id, first_seq=expected_seq + 1, head_seq=expected_seq + count,
        head_hash=head_hash, status=None if new_status is None else Status(new_status),
    )


def _observation(task_id: str, event: vocabulary.Event,
                 encoded: tuple[str, int, bytes] | None, *, epoch: int, expected_seq: int,
                 prev_hash: bytes, payload_bytes_max: int, recorded_at: dt.datetime | None = None
                 ) -> tuple[str, tuple[Any, ...], tuple[bytes]]:
    """The statement, arguments and hash of one observation (no status move)."""
    kind, version, payload = encoded if encoded is not None else vocabulary.encode_event(
        event, payload_bytes_max=payload_bytes_max)
    payload, chunks = row_payload(payload)
    key, recorded_at = getattr(event, "idempotency_key", None), recorded_at or now()
    digest = event_hash_v3(prev_hash, task_id, expected_seq + 1, kind, version, epoch,
                           recorded_at, key, payload)
    args = (task_id, epoch, expected_seq, prev_hash, kind, version,
            blobs.compress_row(payload, task_id), stored_key(task_id, expected_seq + 1, kind, key),
            digest, recorded_at)
    if chunks:
        pending = Chunks()
        pending.add(chunks)
        return queries.OBSERVE_ONE_BLOBS, (*args, *pending.args()), (digest,)
    return queries.OBSERVE_ONE, args, (digest,)


def _append_statement(
    task_id: str, epoch: int, expected_seq: int, prev_hash: bytes, batch: _Batch
) -> tuple[str, tuple[Any, ...]]:
    """The statement and arguments for one task's batch: observations touch only the log
    (a single observation goes through :func:`_observation`)."""
    columns = (batch.types, batch.versions, batch.payloads, batch.idempotency_keys,
               batch.hashes)
    chunks = batch.chunks.args() if batch.chunks else ()
    if batch.new_status is None:
        return (queries.OBSERVE_MANY_BLOBS if chunks else queries.OBSERVE_MANY), (
            task_id, epoch, expected_seq, prev_hash, *columns, batch.recorded_at, *chunks)
    return (queries.TRANSITION_BLOBS if chunks else queries.TRANSITION), (
        task_id, epoch, expected_seq, prev_hash, *columns, batch.new_status, batch.path,
        batch.wake_after_ms, batch.waiting_signal, batch.recorded_at, *chunks,
    )


def _many_args(appends: Sequence[PendingAppend], batches: Sequence[_Batch]) -> tuple[Any, ...]:
    task_index: list[int] = []
    offsets: list[int] = []
    types: list[str] = []
    versions: list[int] = []
    payload_list: list[bytes] = []
    keys: list[str | None] = []
    hashes: list[bytes] = []
    for index, batch in enumerate(batches, start=1):
        for offset in range(len(batch.types)):
            task_index.append(index)
            offsets.append(offset + 1)
        types += batch.types
        versions += batch.versions
        payload_list += batch.payloads
        keys += batch.idempotency_keys
        hashes += batch.hashes
    return (
        [a.task_id for a in appends], [a.epoch for a in appends],
        [a.expected_seq for a in appends], [a.prev_hash for a in appends],
        [b.new_hash for b in batches], [b.new_status for b in batches],
        [",".join(b.path) if b.path else None for b in batches],
        [b.wake_after_ms for b in batches], [b.waiting_signal for b in batches],
        task_index, offsets, types, versions, payload_list, keys, hashes,
        [len(b.types) for b in batches], [b.recorded_at for b in batches],
    )


def head_from_row(row: Any) -> TaskHead:
    """Build a :class:`TaskHead` from a ``wal_tasks`` row."""
    values = dict(row)
    values["status"] = Status(values["status"])
    values["budget"] = orjson.loads(values["budget"])
    return TaskHead(**values)


def record_from_row(row: Any) -> EventRecord:
    """Build an :class:`EventRecord` from a ``wal_events`` row (decision 71): a compressed
    row's payload is its content (what the chain hash covers), and the key of a row of
    chain version 3 is the event's own, derived where the row leaves it out."""
    values = dict(row)
    stored = values["payload"]
    if stored.startswith(blobs.ROW_MARK):
        values["payload"] = blobs.readable_row(stored, values["task_id"])
    if values["chain_version"] >= 3:
        values["idempotency_key"] = effective_key(
            values["chain_version"], values["task_id"], values["seq"], values["type"],
            values["idempotency_key"])
    return EventRecord(**values)
