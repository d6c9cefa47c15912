"""Retention: finished tasks older than a policy leave the database, archived first
(``wal-engine retention plan|run``; decision 69 of docs/architecture.md).

:func:`plan_retention` reads what a run would remove and changes nothing.
:func:`run_retention` works in batches of at most ``batch_tasks`` tasks; for each one it

1. writes an archive (:mod:`wal_engine.audit.archive`) to a temporary name in the archive
   directory: every event of each task as stored, its large values' chunks, and an anchor
   over the tasks' heads, signed with the given key; fsyncs it, links it into place (never
   over an existing file) and fsyncs the directory;
2. reads the file back and verifies it as ``verify --archive`` does (every chain, the
   anchor, its signature), and checks that it holds exactly the selected heads;
3. only then calls ``wal_retention_remove`` (schema.sql, section "retention"), which, in
   one transaction and with the owner's rights, re-checks every task (still finished,
   still at its archived head, no running child or parent), records the batch in
   ``wal_retention_log`` (who, when, the archive's name and sha256, the anchor's root and
   key), leaves a tombstone per task (its id and every idempotency key) and deletes the
   task's rows.

A crash between 1 and 3 leaves the database as it was and an archive file no
``wal_retention_log`` row names (a leftover; the next run archives the same tasks again
into a new file). A batch the database refuses (:class:`RetentionRefused`) removes
nothing either.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from wal_engine import failpoints, limits
from wal_engine.audit import archive
from wal_engine.audit.anchor import Anchor, AnchoredHead, leaf_hash, merkle_root, sign_anchor
from wal_engine.errors import InvalidInput, RetentionRefused
from wal_engine.observability.logs import get_logger
from wal_engine.store import Database
from wal_engine.store import queries as store_queries
from wal_engine.store.store import record_from_row

log = get_logger(__name__)

ENDINGS: Final = {"COMPLETED": "task_completed", "FAILED": "task_failed",
                  "CANCELLED": "task_cancelled"}
"""What ``--status`` names, and the ending event of each (a cancelled task is FAILED)."""

batch_tasks_default: Final = 500
batch_tasks_max: Final = 10_000
"""The most tasks one archive and one removing transaction hold (the SQL function's bound)."""
plan_page_tasks: Final = 1000
retention_tasks_max: Final = 10_000_000
"""The most tasks one plan or run looks at (a bound on the loops)."""
keys_per_task_max: Final = 100_000
blob_page_chunks: Final = 64

CLOCK: Final = "SELECT now() AS now, now() - $1::interval AS cutoff, current_database() AS name"

# Finished tasks whose ending was recorded before $1, with an ending in $2, after $3 in id
# order; never the parent of a running child, nor the child of a running parent.
CANDIDATES: Final = """
SELECT t.task_id, t.agent, t.status, e.type AS ending, e.seq AS head_seq, e.hash AS head_hash,
       e.recorded_at AS finished_at, t.blob_bytes
  FROM wal_tasks t
  CROSS JOIN LATERAL (SELECT x.seq, x.hash, x.type, x.recorded_at FROM wal_events x
                      WHERE x.tenant = t.tenant AND x.task_id = t.task_id
                      ORDER BY x.seq DESC LIMIT 1) AS e
 WHERE t.tenant = current_setting('wal.tenant', true)
   AND t.status IN ('COMPLETED', 'FAILED') AND t.task_id > $3
   AND e.recorded_at < $1 AND e.type = ANY ($2::text[])
   AND NOT (t.parent_seq IS NULL AND t.parent_task_id IS NOT NULL AND EXISTS (
            SELECT 1 FROM wal_tasks p
             WHERE p.tenant = t.tenant AND p.task_id = t.parent_task_id
               AND p.status NOT IN ('COMPLETED', 'FAILED')))
   AND NOT EXISTS (SELECT 1 FROM wal_tasks c
                    WHERE c.tenant = t.tenant AND c.parent_task_id = t.task_id
                      AND c.parent_seq IS NULL AND c.status NOT IN ('COMPLETED', 'FAILED'))
 ORDER BY t.task_id
 LIMIT $4
"""

SIZES: Final = """
SELECT count(*) AS events, coalesce(sum(octet_length(payload)), 0) AS bytes FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = ANY ($1::text[])
"""

TASK_KEYS: Final = """
SELECT k FROM (SELECT wal_event_key(x.chain_version, x.type, x.task_id, x.seq,
                                     x.idempotency_key) AS k
                 FROM wal_events x
                WHERE x.tenant = current_setting('wal.tenant', true) AND x.task_id = $1
                  AND x.idempotency_key IS NOT NULL
               UNION
               SELECT i.key FROM wal_idempotency i
                WHERE i.tenant = current_setting('wal.tenant', true) AND i.task_id = $1) AS keys
 WHERE k IS NOT NULL
 ORDER BY k
 LIMIT $2
"""

TASK_BLOBS: Final = """
SELECT digest, ordinal, value_bytes, data FROM wal_blobs
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
   AND (digest, ordinal) > ($2::bytea, $3::int4)
 ORDER BY digest, ordinal
 LIMIT $4
"""

REMOVE: Final = """
SELECT retention_id, events
  FROM wal_retention_remove($1::text[], $2::int8[], $3::bytea[], $4, $5, $6, $7, $8)
"""

# The month partitions a batch dropped whole (decision 70).
DROPPED: Final = """
SELECT partitions_dropped FROM wal_retention_log
 WHERE tenant = current_setting('wal.tenant', true) AND retention_id = $1
"""

# The log's month partitions (schema.sql, section "partitioning"), oldest first.
MONTHS: Final = """
SELECT substr(c.relname, length('wal_events_p') + 1) AS month
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = to_regclass('wal_events') AND c.relname ~ '^wal_events_p[0-9]{6}$'
 ORDER BY 1
 LIMIT $1
"""

# The month partition each of the tasks $1 (of this tenant) is in, if any.
TASK_MONTHS: Final = """
SELECT DISTINCT e.task_id, substr(e.tableoid::regclass::text, length('wal_events_p') + 1) AS month
  FROM wal_events e
 WHERE e.tenant = current_setting('wal.tenant', true) AND e.task_id = ANY ($1::text[])
   AND e.tableoid::regclass::text ~ '^wal_events_p[0-9]{6}$'
"""

# Why a month's partitions could not be dropped if the tasks $2 (of this tenant) were
# archived: the first other task in them not archived, of any tenant; NULL: droppable.
BLOCKER: Final = "SELECT wal_partition_blocker($1, $2::text[]) AS blocker"

# Past months whose partitions hold no row: dropped (decision 70).
DROP_EMPTY: Final = "SELECT name FROM wal_drop_empty_partitions() AS name"

months_max: Final = 1200


class RetentionPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a run with the same policy would remove now."""

    finished_before: dt.datetime
    tasks: int
    by_status: dict[str, int]
    events: int
    bytes: int
    """Stored bytes of the events' rows plus their large values (compressed)."""
    oldest: dt.datetime | None
    newest: dt.datetime | None
    truncated: bool
    """The plan stopped at ``tasks_max`` tasks; more may qualify."""
    partitions: dict[str, str | None] = {}
    """Each past month's partitions (``wal_events_pYYYYMM``) and why the run could not
    drop them whole (the first task in them, of any tenant, neither archived nor a task of
    this plan, as ``tenant/task``), None for those it would drop (decision 70). Batches
    drop a month when they archive its last tasks; a month whose tasks span several
    batches has its rows deleted by the others."""


class RetentionBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One archived and removed batch."""

    retention_id: int
    archive: str
    sha256: str
    tasks: int
    events: int
    signed: bool
    partitions_dropped: list[str] = []
    """The month partitions this batch dropped whole (its last tasks were in it)."""


def finished_before(now: dt.datetime, older_than: dt.timedelta | None,
                    before: dt.datetime | None) -> dt.datetime:
    """The cutoff: ``before``, else ``now - older_than`` (exactly one is given)."""
    if (older_than is None) == (before is None):
        raise InvalidInput("give exactly one of older_than and before")
    if before is not None:
        return before if before.tzinfo is not None else before.replace(tzinfo=dt.UTC)
    assert older_than is not None
    if older_than < dt.timedelta(0):
        raise InvalidInput("older_than must not be negative")
    return now - older_than


def ending_types(statuses: Sequence[str]) -> list[str]:
    """The ending event types of ``statuses`` (COMPLETED, FAILED, CANCELLED)."""
    unknown = [status for status in statuses if status.upper() not in ENDINGS]
    if unknown or not statuses:
        raise InvalidInput(f"statuses must be among {', '.join(ENDINGS)}; got {unknown or 'none'}")
    return sorted({ENDINGS[status.upper()] for status in statuses})


async def _cutoff(database: Database, older_than: dt.timedelta | None,
                  before: dt.datetime | None) -> tuple[dt.datetime, str]:
    row = await database.fetchrow(CLOCK, older_than or dt.timedelta(0))
    return finished_before(row["now"], older_than, before), str(row["name"])


async def plan_retention(database: Database, *, older_than: dt.timedelta | None = None,
                         before: dt.datetime | None = None,
                         statuses: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED"),
                         tasks_max: int = retention_tasks_max) -> RetentionPlan:
    """What :func:`run_retention` would remove now (reads only)."""
    cutoff, _ = await _cutoff(database, older_than, before)
    endings = ending_types(statuses)
    by_status: dict[str, int] = {}
    tasks = events = size = 0
    oldest: dt.datetime | None = None
    newest: dt.datetime | None = None
    by_month: dict[str, list[str]] = {}
    after = ""
    while tasks < tasks_max:
        rows = await database.fetch(CANDIDATES, cutoff, endings, after,
                                    min(plan_page_tasks, tasks_max - tasks))
        if not rows:
            break
        for found in await database.fetch(TASK_MONTHS, [row["task_id"] for row in rows]):
            by_month.setdefault(found["month"], []).append(found["task_id"])
        sizes = await database.fetchrow(SIZES, [row["task_id"] for row in rows])
        tasks += len(rows)
        events += int(sizes["events"])
        size += int(sizes["bytes"]) + sum(int(row["blob_bytes"]) for row in rows)
        for row in rows:
            status = _status_name(row["ending"])
            by_status[status] = by_status.get(status, 0) + 1
            stamp = row["finished_at"]
            oldest = stamp if oldest is None or stamp < oldest else oldest
            newest = stamp if newest is None or stamp > newest else newest
        after = rows[-1]["task_id"]
    partitions = {}
    for row in await database.fetch(MONTHS, months_max):
        month = row["month"]
        found = await database.fetchrow(BLOCKER, month, by_month.get(month, []))
        partitions[f"wal_events_p{month}"] = found["blocker"]
    return RetentionPlan(finished_before=cutoff, tasks=tasks, by_status=by_status,
                         events=events, bytes=size, oldest=oldest, newest=newest,
                         truncated=tasks >= tasks_max, partitions=partitions)



def _status_name(ending: str) -> str:
    return next(name for name, kind in ENDINGS.items() if kind == ending)


async def run_retention(database: Database, archive_dir: str | Path, *,
                        older_than: dt.timedelta | None = None,
                        before: dt.datetime | None = None,
                        statuses: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED"),
                        signing_key: Any = None, batch_tasks: int = batch_tasks_default,
                        tasks_max: int = retention_tasks_max) -> list[RetentionBatch]:
    """Archive, verify, then remove every task :func:`plan_retention` lists (see the module
    docstring); the batches done. Raises :class:`RetentionRefused` when the database
    refuses a batch (the batches before it stay done)."""
    if not 1 <= batch_tasks <= batch_tasks_max:
        raise InvalidInput(f"batch_tasks must be 1..{batch_tasks_max}")
    directory = Path(archive_dir)
    if not await asyncio.to_thread(directory.is_dir):
        raise InvalidInput(f"archive directory {directory} does not exist")
    cutoff, name = await _cutoff(database, older_than, before)
    endings = ending_types(statuses)
    # Retention runs periodically as the owner: the months ahead are created here too.
    await database.fetch(store_queries.ENSURE_PARTITIONS)
    done: list[RetentionBatch] = []
    removed = 0
    after = ""
    while removed < tasks_max:
        rows = await database.fetch(CANDIDATES, cutoff, endings, after,
                                    min(batch_tasks, tasks_max - removed))
        if not rows:
            break
        done.append(await _one_batch(database, directory, name, cutoff, rows, signing_key))
        removed += len(rows)
        after = rows[-1]["task_id"]
    # Past months left with no row at all (no task, or all gone task by task): dropped too,
    # so that the number of partitions, which every statement pays for, stays bounded.
    empty = [row["name"] for row in await database.fetch(DROP_EMPTY)]
    if empty:
        log.info("empty_partitions_dropped", partitions=empty)
    return done


async def _one_batch(database: Database, directory: Path, database_name: str,
                     cutoff: dt.datetime, rows: list[Any], signing_key: Any) -> RetentionBatch:
    clock = await database.fetchrow(CLOCK, dt.timedelta(0))
    now: dt.datetime = clock["now"]
    heads = [AnchoredHead(row["task_id"], int(row["head_seq"]), bytes(row["head_hash"]).hex())
             for row in rows]
    anchor = Anchor(created_at=now.astimezone(dt.UTC).isoformat(), database=database_name,
                    mode="heads", tasks=len(heads),
                    root=merkle_root([leaf_hash(h.task_id, h.seq, bytes.fromhex(h.hash))
                                      for h in heads]).hex(),
                    heads=heads, tenant=database.tenant)
    if signing_key is not None:
        anchor = sign_anchor(anchor, signing_key)
    stamp = now.astimezone(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    tag = hashlib.sha256(rows[0]["task_id"].encode()).hexdigest()[:8]
    path = directory / f"wal-archive-{database.tenant}-{stamp}-{tag}.jsonl"
    try:
        digest = await _write_archive(database, path, database_name, now, rows, anchor)
    except OSError as error:
        if error.filename is None:
            raise  # Not the file: the connection (the caller reports a database error).
        raise RetentionRefused(None, f"cannot write the archive {path}: "
                                     f"{error.strerror or error}; nothing was removed"
                               ) from error
    report = await asyncio.to_thread(archive.verify_archive, path)
    if not report.ok or report.tasks != len(rows):
        first = report.findings[0] if report.findings else None
        raise RetentionRefused(first.task_id if first else None,
                               f"the archive {path} does not verify after writing "
                               f"({first.kind + ': ' + first.detail if first else 'tasks differ'}"
                               f"); nothing was removed")
    failpoints.hit("retention_after_archive")
    row = await database.fetchrow(
        REMOVE, [h.task_id for h in heads], [h.seq for h in heads],
        [bytes.fromhex(h.hash) for h in heads], cutoff, path.name, digest,
        bytes.fromhex(anchor.root),
        None if anchor.signature is None else anchor.signature.public_key)
    dropped = await database.fetchrow(DROPPED, int(row["retention_id"]))
    return RetentionBatch(retention_id=int(row["retention_id"]), archive=str(path),
                          sha256=digest.hex(), tasks=len(rows), events=int(row["events"]),
                          signed=anchor.signature is not None,
                          partitions_dropped=list(dropped["partitions_dropped"]))


async def _write_archive(database: Database, path: Path, database_name: str,
                         now: dt.datetime, rows: list[Any], anchor: Anchor) -> bytes:
    """Write the archive under a temporary name, fsync, rename, fsync the directory; the
    file's sha256."""
    temporary = path.with_name(f".{path.name}.tmp")
    digest = hashlib.sha256()
    with temporary.open("wb") as file:

        def put(line: bytes) -> None:
            digest.update(line)
            file.write(line)

        put(archive.header_line(tenant=database.tenant, database=database_name,
                                created_at=now, tasks=len(rows)))
        for row in rows:
            await _write_task(database, row, put)
        put(archive.anchor_line(anchor))
        file.flush()
        os.fsync(file.fileno())
    # A link, not a rename: an archive already there (another run's) is never replaced.
    try:
        os.link(temporary, path)
    finally:
        temporary.unlink()
    descriptor = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return digest.digest()


async def _write_task(database: Database, row: Any, put: Callable[[bytes], None]) -> None:
    task_id = row["task_id"]
    keys = await database.fetch(TASK_KEYS, task_id, keys_per_task_max, task_id=task_id)
    put(archive.task_line(row, [key["k"] for key in keys]))
    after_digest, after_ordinal = b"", -1
    while True:
        chunks = await database.fetch(TASK_BLOBS, task_id, after_digest, after_ordinal,
                                      blob_page_chunks, task_id=task_id)
        for chunk in chunks:
            put(archive.blob_line(task_id, chunk))
        if len(chunks) < blob_page_chunks:
            break
        after_digest, after_ordinal = bytes(chunks[-1]["digest"]), int(chunks[-1]["ordinal"])
    next_seq = 1
    while next_seq <= int(row["head_seq"]):
        events = await database.fetch(store_queries.READ_EVENTS, task_id, next_seq,
                                      int(row["head_seq"]), limits.read_page_events,
                                      task_id=task_id)
        for event in events:
            put(archive.event_line(record_from_row(event)))
        if len(events) < limits.read_page_events:
            break
        next_seq = int(events[-1]["seq"]) + 1
