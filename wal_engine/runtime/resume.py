"""Resume, snapshots and forks: the I/O side of replay.

**Resume** (:func:`resume`) returns the state a worker continues from, in one round trip
for the common case: one statement returns the task's head, its latest snapshot (at or
below the head, of the current format) and the first page of the events after it. Only a
tail longer than one page costs more round trips (one per further page). A task with a
snapshot is never read from seq 1. The folded state is checked against the head: same seq,
same hash, same status; and the snapshot against the log: its hash is the stored hash of
its seq.

**Snapshots** (``wal_snapshots`` and ``wal_snapshot_segments``) hold the
:class:`~replay.state.AgentState` at a seq, msgpack-encoded and segmented
(:mod:`replay.snapshot`): the collections that grow with the history live in immutable
segments shared by the task's snapshots, and the snapshot row holds the rest of the state,
the collections' tails and the digests of its segments. They are derived data: any of them
can be deleted and rebuilt from the log. The log rows of a step hold only that step's
events, so the log grows by a constant per step; a snapshot writes only the segments its
writer has not stored yet (the items added since its previous snapshot) plus its row, so it
too costs a constant per step, whatever the length of the history. :func:`save_snapshot`
writes the new segments and the row, keeps only the latest ``keep_latest`` snapshots of
the task and deletes the segments no kept snapshot refers to, in one statement.
:class:`SnapshotPolicy` spaces snapshots out (every checkpoint, every N events, never
closer than M events).

**Forks** (:func:`fork`) start a new task from a prefix of another's history: the parent's
events 1..at_seq, re-chained under the child's task id, the first one (``task_submitted``)
naming the parent and the fork seq, then ``task_forked``; a prefix that leaves the task
RUNNING or CHECKPOINTED gets ``task_released(reason="forked")`` and one left WAITING gets
``task_woken(reason="forked")``, so every child is QUEUED or RESUMING: ready to be
claimed, its agent code re-run against the journal. Copied events keep their type, version,
payload bytes and idempotency key (a call in doubt at the fork point is retried under the
parent's key, so the callee still deduplicates it); their epoch is reset to 0, since the
parent's lease epochs mean nothing for the child, whose first claim takes epoch 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Final

import msgspec
import orjson

from replay.fold import StateBuilder
from replay.snapshot import (
    STATE_FORMAT,
    EncodedSnapshot,
    Segment,
    SnapshotSegments,
    decode_snapshot,
)
from replay.state import AgentState
from replay.upcasting import UpcasterRegistry, upcasters
from wal_engine import blobs, limits
from wal_engine import events as vocabulary
from wal_engine.chain import GENESIS_HASH, event_hash
from wal_engine.errors import (
    ForkPointInvalid,
    ReplayError,
    SnapshotCorrupt,
    TaskAlreadyExists,
    UnknownTask,
)
from wal_engine.ids import new_task_id, validate_task_id
from wal_engine.state_machine import LEASED, TERMINAL, Status
from wal_engine.store import Database, EventRecord, Store
from wal_engine.store.blob_reads import expand_payloads

resume_page_events: Final = 2000
"""Events fetched per round trip when a tail is folded (a bound on one statement)."""

snapshots_kept_default: Final = 2
"""Snapshots kept per task: the latest, and one spare."""

# The head, the latest usable snapshot with its segments, and the first page of the tail, in
# one statement (one consistent MVCC snapshot). The row of seq 0 carries the head and the
# snapshot row; rows of seq -1 are the snapshot's segments (field in ``type``, ordinal in
# ``head_seq``, digest in ``hash``, bytes in ``payload``); the rows of seq 1 and up are the
# tail's events. Rows, not arrays: asyncpg introspects array types on every new connection,
# which cost 6 ms per resume (measured). $2 is the snapshot format, $3 the page size. Every
# table is filtered on the task by $1 itself (not through the head's row): the planner
# prunes the partitioned tables to the task's partition only for a parameter (decision 70).
RESUME_HEAD: Final = """
WITH head AS (
    SELECT t.task_id, t.status, last.seq AS head_seq, last.hash AS head_hash
      FROM wal_tasks t
     CROSS JOIN LATERAL (SELECT e.seq, e.hash FROM wal_events e
                         WHERE e.tenant = current_setting('wal.tenant', true)
                           AND e.task_id = $1
                         ORDER BY e.seq DESC LIMIT 1) AS last
     WHERE t.tenant = current_setting('wal.tenant', true) AND t.task_id = $1
), snapshot AS (
    SELECT s.seq, s.state, s.segments FROM wal_snapshots s, head
     WHERE s.tenant = current_setting('wal.tenant', true)
       AND s.task_id = $1 AND s.seq <= head.head_seq AND s.state_format = $2
     ORDER BY s.seq DESC
     LIMIT 1
)
SELECT 0::int8 AS seq, head.status AS type, 0::int2 AS version, snapshot.state AS payload,
       head.head_hash AS hash, head.head_seq, snapshot.seq AS snapshot_seq,
       (SELECT e.hash FROM wal_events e
         WHERE e.tenant = current_setting('wal.tenant', true) AND e.task_id = $1
           AND e.seq = snapshot.seq) AS snapshot_hash
  FROM head LEFT JOIN snapshot ON true
UNION ALL
SELECT -1::int8, g.field, 0::int2, g.data, g.digest, g.ordinal::int8, NULL, NULL
  FROM wal_snapshot_segments g, snapshot
 WHERE g.tenant = current_setting('wal.tenant', true) AND g.task_id = $1
   AND g.digest = ANY (snapshot.segments)
UNION ALL
(SELECT e.seq, e.type, e.version, e.payload, e.hash, NULL, NULL, NULL
   FROM wal_events e, head
  WHERE e.tenant = current_setting('wal.tenant', true)
     AND e.task_id = $1 AND e.seq <= head.head_seq
    AND e.seq > coalesce((SELECT seq FROM snapshot), 0)
  ORDER BY e.seq
  LIMIT $3)
"""

READ_TAIL: Final = """
SELECT seq, type, version, payload, hash FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND seq > $2 AND seq <= $3
 ORDER BY seq
 LIMIT $4
"""

# Write a snapshot in one statement: insert the segments the writer does not know to be
# stored ($7-$10, unnest arrays; one already stored is skipped), then the snapshot row
# listing the digests of all its segments ($6; a second writer of the same seq wrote the
# same bytes: keep the first), delete the task's snapshots older than the newest $5 - 1
# below it, and delete the task's segments that no remaining snapshot refers to. Every part
# sees the table as it was before the statement: a segment referenced by the new row but
# neither sent nor already stored is "missing", and then nothing but the sent segments is
# written (the caller sends them all and tries again). In steady state the DELETEs remove
# at most one snapshot row and the segments only it referred to (a segment that changed).
# The statement is the body of wal_save_snapshot (schema.sql), which runs with the owner's
# rights: runtime roles hold no DELETE on shared tables (docs/architecture.md, decision 35).
SAVE_SNAPSHOT: Final = """
SELECT inserted, pruned, segments_written, segments_pruned, missing
  FROM wal_save_snapshot($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
"""

# wal_delete_snapshots (schema.sql): the task's snapshots and segments, as the owner.
DELETE_SNAPSHOTS: Final = "SELECT wal_delete_snapshots($1)"

LATEST_SNAPSHOT_SEQ: Final = """
SELECT max(seq) AS seq FROM wal_snapshots
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND state_format = $2
"""

# A forked task: its head row (status reached through the legal walk in $4, which the insert
# trigger checks from QUEUED) and its whole history, in one statement and one commit. It
# waits in its parent's queue at its parent's priority (not under its partition key, which
# would hold it behind a parent still alive, nor its dedup id, which the parent holds).
FORK_TASK: Final = """
WITH task AS (
    INSERT INTO wal_tasks (task_id, agent, status, status_path, head_seq, head_hash, budget,
                           parent_task_id, parent_seq, attempts, queue, priority)
    SELECT $1, $2, $3, $4::text[], $5, $6, $7::jsonb, $8, $9, $10, p.queue, p.priority
      FROM wal_tasks p
     WHERE p.tenant = current_setting('wal.tenant', true) AND p.task_id = $8
    ON CONFLICT (tenant, task_id) DO NOTHING
    RETURNING task_id
), inserted AS (
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                            hash)
    SELECT task.task_id, e.ord, e.type, e.version, 0, e.payload, e.idempotency_key, e.hash
      FROM task,
           unnest($11::text[], $12::int2[], $13::bytea[], $14::text[], $15::bytea[])
               WITH ORDINALITY AS e(type, version, payload, idempotency_key, hash, ord)
    RETURNING 1
), blobs AS (
    -- The parent's large values the copied rows refer to ($16), copied for the child: a
    -- task's rows refer only to its own wal_blobs rows.
    INSERT INTO wal_blobs (task_id, digest, ordinal, value_bytes, data)
    SELECT task.task_id, b.digest, b.ordinal, b.value_bytes, b.data
      FROM task, wal_blobs b
     WHERE b.tenant = current_setting('wal.tenant', true) AND b.task_id = $8
       AND b.digest = ANY ($16::bytea[])
    RETURNING 1
), wake AS (
    SELECT pg_notify('wal_engine_wake', wal_wake_token()) FROM task
)
SELECT (SELECT count(*) FROM inserted) AS events, (SELECT count(*) FROM wake) AS notified
"""


# ----------------------------------------------------------------------------- snapshots


class SnapshotPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """When a worker writes a snapshot, and how many it keeps.

    Attributes:
        on_checkpoint: Snapshot when the state is CHECKPOINTED (a step boundary).
        every_events: Snapshot once this many events followed the last snapshot, at any
            status (None: never for this reason). Bounds the tail a resume folds.
        min_events: Never snapshot fewer than this many events after the last one; spaces
            out "every checkpoint" for agents with tiny steps.
        spacing_fraction: Never snapshot fewer than this fraction of the last snapshot's
            seq after it (geometric spacing). Segmented snapshots write only what was added
            since the previous one, so even spacing already costs a constant per event; the
            default is 0 (docs/architecture.md, decisions 20 and 22).
        keep_latest: Snapshots kept per task (at least 1).
    """

    on_checkpoint: bool = True
    every_events: int | None = 1000
    min_events: int = 1
    spacing_fraction: float = 0.0
    keep_latest: int = snapshots_kept_default

    def spacing(self, last_snapshot_seq: int) -> int:
        """The fewest events that must follow the last snapshot before the next one."""
        return max(1, self.min_events, int(self.spacing_fraction * last_snapshot_seq))

    def due(self, state: AgentState, last_snapshot_seq: int) -> bool:
        """Whether ``state`` should be snapshotted, the latest snapshot being at that seq."""
        since = state.last_seq - last_snapshot_seq
        if since < self.spacing(last_snapshot_seq):
            return False
        if self.every_events is not None and since >= max(self.every_events,
                                                          self.spacing(last_snapshot_seq)):
            return True
        return self.on_checkpoint and state.status is Status.CHECKPOINTED


async def save_snapshot(
    database: Database,
    state: AgentState,
    *,
    keep_latest: int = snapshots_kept_default,
    segments: SnapshotSegments | None = None,
    encode_off_loop: bool = False,
) -> bool:
    """Store ``state`` as the task's snapshot at ``state.last_seq``; prune older ones.

    Keeps the ``keep_latest`` newest snapshots at or below this one (snapshots are derived
    data) and the segments they refer to. ``segments`` is the writer's memory of the
    task's segments (one per task run, see :class:`~replay.snapshot.SnapshotSegments`):
    with it, only the segments not yet stored are encoded and sent; without it, all are
    sent and the store skips those it holds. One statement, one round trip; a second only
    when the writer's memory was wrong (a segment it thought stored had been deleted).
    ``encode_off_loop``: encode on a thread (zstd releases the GIL), so that the event loop
    goes on serving other runs' steps meanwhile (the state is frozen; ``segments`` must
    not be used by anyone else until this returns). Returns False when a snapshot at that
    seq already existed.
    """
    if state.last_seq < 1:
        raise ValueError("a snapshot needs a state at seq 1 or later")
    known = segments if segments is not None else SnapshotSegments()
    encoded = (await asyncio.to_thread(known.encode, state) if encode_off_loop
               else known.encode(state))
    row = await _write_snapshot(database, state, encoded, keep_latest)
    if row["missing"]:
        known.forget_stored()
        encoded = known.encode(state)
        row = await _write_snapshot(database, state, encoded, keep_latest)
        if row["missing"]:
            raise SnapshotCorrupt(state.task_id, state.last_seq,
                                  "its segments vanished while it was written")
    known.stored_as(encoded)
    return bool(row["inserted"])


async def _write_snapshot(database: Database, state: AgentState, encoded: EncodedSnapshot,
                          keep_latest: int) -> Any:
    new: list[Segment] = encoded.new
    rows = await database.fetch(
        SAVE_SNAPSHOT, state.task_id, state.last_seq, encoded.head, STATE_FORMAT,
        max(1, keep_latest), encoded.digests, [segment.field for segment in new],
        [segment.ordinal for segment in new], [segment.digest for segment in new],
        [segment.data for segment in new], task_id=state.task_id,
    )
    return rows[0]


async def save_snapshot_if_due(
    database: Database,
    state: AgentState,
    policy: SnapshotPolicy,
    last_snapshot_seq: int,
    *,
    segments: SnapshotSegments | None = None,
) -> bool:
    """Apply ``policy``: save a snapshot of ``state`` when one is due. Returns whether saved."""
    if not policy.due(state, last_snapshot_seq):
        return False
    await save_snapshot(database, state, keep_latest=policy.keep_latest, segments=segments)
    return True


async def latest_snapshot_seq(database: Database, task_id: str) -> int:
    """Seq of the task's latest usable snapshot, 0 when it has none."""
    row = await database.fetchrow(LATEST_SNAPSHOT_SEQ, task_id, STATE_FORMAT, task_id=task_id)
    return 0 if row is None or row["seq"] is None else int(row["seq"])


async def delete_snapshots(database: Database, task_id: str) -> None:
    """Drop every snapshot of a task (derived data; the next resume folds the whole log)."""
    await database.fetch(DELETE_SNAPSHOTS, task_id, task_id=task_id)


# ----------------------------------------------------------------------------- resume


class ResumedState(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of a resume, with what it cost."""

    state: AgentState
    snapshot_seq: int | None
    """Seq of the snapshot resumed from, or None when the whole log was folded."""
    events_folded: int
    round_trips: int
    segments: SnapshotSegments
    """What the snapshot's segments were (for the run's next snapshot: not re-sent)."""


async def resume(store: Store, task_id: str) -> AgentState:
    """The state a worker continues ``task_id`` from: latest snapshot + fold of the tail.

    Raises:
        UnknownTask: no such task.
        ReplayError: the log breaks the rules, or disagrees with the head.
        SnapshotCorrupt: the latest snapshot does not decode or does not match the log.
    """
    return (await read_state(store, task_id)).state


async def read_state(
    store: Store,
    task_id: str,
    *,
    registry: UpcasterRegistry = upcasters,
    page_events: int = resume_page_events,
    use_snapshot: bool = True,
) -> ResumedState:
    """Like :func:`resume`, and say where the state came from and what it cost.

    ``use_snapshot=False`` folds the whole log (to check snapshots, or to measure).
    """
    page_events = max(1, min(page_events, limits.read_page_events * 10))
    database = store.database
    state_format = STATE_FORMAT if use_snapshot else 0  # No snapshot has format 0.
    rows = await database.fetch(RESUME_HEAD, task_id, state_format, page_events,
                                task_id=task_id)
    if not rows:
        raise UnknownTask(task_id)
    rows.sort(key=_seq_of)  # UNION ALL keeps this order in practice; make sure of it.
    first = 0
    while rows[first][0] < 0:
        first += 1
    head, items = rows[first], rows[first + 1:]
    known = SnapshotSegments()
    start = _snapshot_state(task_id, head, rows[:first], known)
    builder = StateBuilder(start, task_id=task_id, registry=registry)
    builder.extend(_decoded(await _with_values(database, task_id, items), registry,
                                task_id))
    folded, round_trips = len(items), 1
    head_seq: int = head["head_seq"]
    while len(items) == page_events and builder.last_seq < head_seq:
        items = await database.fetch(READ_TAIL, task_id, builder.last_seq, head_seq,
                                     page_events, task_id=task_id)
        builder.extend(_decoded(await _with_values(database, task_id, items), registry,
                                task_id))
        folded, round_trips = folded + len(items), round_trips + 1
    state = builder.finish()
    _check_head(state, head)
    return ResumedState(state=state, snapshot_seq=None if start is None else start.last_seq,
                        events_folded=folded, round_trips=round_trips, segments=known)


async def _with_values(database: Database, task_id: str, items: list[Any]) -> list[Any]:
    """Rows of the tail with their large values put back (decision 61): the rows that
    reference none are returned as they are, without a round trip."""
    expanded = await expand_payloads(database, task_id, [row[3] for row in items])
    if not expanded:
        return items
    return [(row[0], row[1], row[2], expanded.get(row[3], row[3]), row[4]) for row in items]


def _seq_of(row: Any) -> int:
    return int(row[0])


def _decoded(
    items: list[Any], registry: UpcasterRegistry, task_id: str
) -> Iterator[tuple[int, vocabulary.Event, bytes]]:
    """Decode rows lazily, so that decoding runs inside the fold's GC pause."""
    for row in items:
        seq = row[0]
        # A compressed row (decision 71) is decoded from its content.
        payload = blobs.readable_row(row[3], task_id)
        yield seq, registry.decode_record(row[1], row[2], payload, seq), row[4]


def _snapshot_state(task_id: str, row: Any, segment_rows: list[Any],
                    known: SnapshotSegments) -> AgentState | None:
    """Assemble the snapshot of RESUME_HEAD's rows and check it against the log."""
    seq = row["snapshot_seq"]
    if seq is None:
        return None
    segments = (Segment(field=item[1], ordinal=item[5], digest=item[4], data=item[3])
                for item in segment_rows)
    state = decode_snapshot(row["payload"], segments, task_id=task_id, seq=seq, known=known)
    if state.task_id != task_id or state.last_seq != seq:
        raise SnapshotCorrupt(task_id, seq, f"it holds task {state.task_id!r} at seq "
                                            f"{state.last_seq}")
    if not state.last_hash:
        # Folded without hashes (a runtime that applies its own events before the store
        # chains them): the log's hash at that seq is the one to continue from.
        return msgspec.structs.replace(state, last_hash=row["snapshot_hash"])
    if state.last_hash != row["snapshot_hash"]:
        raise SnapshotCorrupt(task_id, seq, "its hash is not the log's hash at that seq")
    return state


def _check_head(state: AgentState, row: Any) -> None:
    if state.last_seq != row["head_seq"]:
        raise ReplayError(state.last_seq, f"the log ends at seq {state.last_seq}, the head "
                                          f"says {row['head_seq']}", state.task_id)
    if state.last_hash != row["hash"]:
        raise ReplayError(state.last_seq, "the folded hash is not the head's hash", state.task_id)
    if state.status != row["type"]:  # The head row carries the status in this column.
        raise ReplayError(state.last_seq, f"the log folds to {state.status}, the head says "
                                          f"{row['type']}", state.task_id)


# ----------------------------------------------------------------------------- fork


class _ChildHistory:
    """The child's events as rows to insert, chained under its id as they are added."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.types: list[str] = []
        self.versions: list[int] = []
        self.payloads: list[bytes] = []
        self.keys: list[str | None] = []
        self.hashes: list[bytes] = []
        self.path: list[str] = []
        self.blob_digests: list[bytes] = []
        """Digests of the parent's large values the copied rows refer to (copied too)."""
        self.builder = StateBuilder(task_id=task_id)

    def add(self, kind: str, version: int, payload: bytes, key: str | None,
            event: vocabulary.Event) -> None:
        seq = len(self.types) + 1
        previous = self.hashes[-1] if self.hashes else GENESIS_HASH
        digest = event_hash(previous, self.task_id, seq, kind, version, 0, payload)
        self.builder.apply(event, seq=seq, event_hash=digest)
        self.types.append(kind)
        self.versions.append(version)
        # Stored compressed when that pays (decision 71); the hash covers the content.
        self.payloads.append(blobs.compress_row(payload, self.task_id))
        self.keys.append(key)
        self.hashes.append(digest)
        target = type(event).TARGET_STATUS
        if target is not None and seq > 1:
            self.path.append(target.value)

    def add_event(self, event: vocabulary.Event) -> None:
        kind, version, payload = vocabulary.encode_event(event)
        # Split as the store splits: a large input is the parent's value, copied with it.
        payload, chunks = blobs.split(payload)
        self.blob_digests += [chunk.digest for chunk in chunks]
        self.add(kind, version, payload, getattr(event, "idempotency_key", None), event)


async def fork(
    store: Store,
    task_id: str,
    at_seq: int,
    *,
    child_task_id: str | None = None,
    registry: UpcasterRegistry = upcasters,
) -> str:
    """Start a new task from ``task_id``'s history up to ``at_seq``; return its id.

    The child is written in one statement (task row and every event, one commit) after the
    prefix is read in pages. See the module docstring for what the child's history holds.

    Raises:
        UnknownTask: no such task.
        ForkPointInvalid: ``at_seq`` is below 1, beyond the head, or a terminal event.
        TaskAlreadyExists: ``child_task_id`` is taken.
    """
    child_id = validate_task_id(child_task_id) if child_task_id else new_task_id()
    if at_seq < 1:
        raise ForkPointInvalid(task_id, at_seq, "seqs start at 1")
    prefix = [record async for record in store.stream_events(task_id, to_seq=at_seq)]
    if not prefix:
        await store.read_head(task_id)  # Raises UnknownTask.
    if len(prefix) < at_seq:
        raise ForkPointInvalid(task_id, at_seq, f"the history ends at seq {len(prefix)}")
    child = _child_history(child_id, task_id, at_seq, prefix, registry)
    await _insert_child(store.database, child, task_id, at_seq)
    return child_id


def _child_history(
    child_id: str, task_id: str, at_seq: int, prefix: list[EventRecord],
    registry: UpcasterRegistry,
) -> _ChildHistory:
    """Re-chain the prefix under ``child_id`` and append the fork's own events."""
    child = _ChildHistory(child_id)
    submitted = registry.decode_record(prefix[0].type, prefix[0].version, prefix[0].payload, 1)
    if not isinstance(submitted, vocabulary.TaskSubmitted):
        raise ReplayError(1, "the first event is not task_submitted", task_id)
    child.add_event(msgspec.structs.replace(submitted, parent_task_id=task_id, parent_seq=at_seq))
    for record in prefix[1:]:
        event = registry.decode_record(record.type, record.version, record.payload, record.seq)
        # The row's own bytes: its large values stay in wal_blobs, copied with the rows.
        child.add(record.type, record.version, record.stored_payload, record.idempotency_key,
                  event)
        child.blob_digests += [ref.digest for ref in blobs.references(record.stored_payload)]
    status = child.builder.state().status
    if status in TERMINAL:
        raise ForkPointInvalid(task_id, at_seq, f"the task is {status} there; nothing follows")
    child.add_event(vocabulary.TaskForked(parent_task_id=task_id, parent_seq=at_seq))
    if status in LEASED:
        child.add_event(vocabulary.TaskReleased(reason="forked"))
    elif status is Status.WAITING:
        child.add_event(vocabulary.TaskWoken(reason="forked"))
    return child


async def _insert_child(database: Database, child: _ChildHistory, task_id: str,
                        at_seq: int) -> None:
    state = child.builder.state()
    assert state.status is not None
    budget = orjson.dumps(msgspec.to_builtins(state.budget), option=orjson.OPT_SORT_KEYS)
    row = await database.fetchrow(
        FORK_TASK, child.task_id, state.agent, state.status.value, child.path or None,
        state.last_seq, state.last_hash, budget.decode(), task_id, at_seq, state.attempts,
        child.types, child.versions, child.payloads, child.keys, child.hashes,
        sorted(set(child.blob_digests)), task_id=child.task_id,
    )
    if row is None or row["events"] != len(child.types):
        raise TaskAlreadyExists(child.task_id)

