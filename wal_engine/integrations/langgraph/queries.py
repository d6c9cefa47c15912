"""SQL of the LangGraph saver, as named constants (``$n`` parameters only).

The log stays the only source of truth: every checkpoint, every pending write and every
retention operation is an event in ``wal_events``, hash-chained like any other. Four small
tables are *derived* index data, maintained in the same statement (or transaction) as the
event they point to, so that a read touches a handful of rows instead of a thread's history:

``wal_graph_threads``      task id -> LangGraph thread id (one row per thread).
``wal_graph_checkpoints``  (task, namespace, checkpoint id) -> seq of its
                           ``graph_checkpoint_saved`` event, and the run that wrote it.
``wal_graph_blobs``        (task, namespace, channel, version) -> seqs of the events that stored
                           that version's value (a checkpoint stores only changed channels).
``wal_graph_writes``       (task, namespace, checkpoint id) -> seqs of ``graph_writes_saved``
                           events, with the writer's task id and write indexes (for dedup).

Retention operations delete rows of these index tables (never of ``wal_events``), in the
same transaction as the ``graph_checkpoints_removed`` event that records them.
"""

from __future__ import annotations

from typing import Final

SETUP_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('wal_engine.langgraph'))"

SETUP: Final = """
CREATE TABLE IF NOT EXISTS wal_graph_threads (
    task_id   text PRIMARY KEY,
    thread_id text NOT NULL
);
CREATE TABLE IF NOT EXISTS wal_graph_checkpoints (
    task_id       text NOT NULL,
    checkpoint_ns text NOT NULL,
    checkpoint_id text NOT NULL,
    seq           bigint NOT NULL,
    run_id        text,
    PRIMARY KEY (task_id, checkpoint_ns, checkpoint_id)
);
CREATE INDEX IF NOT EXISTS wal_graph_checkpoints_by_run
    ON wal_graph_checkpoints (run_id) WHERE run_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS wal_graph_blobs (
    task_id       text NOT NULL,
    checkpoint_ns text NOT NULL,
    channel       text NOT NULL,
    version       text NOT NULL,
    seq           bigint NOT NULL,
    PRIMARY KEY (task_id, checkpoint_ns, channel, version, seq)
);
CREATE TABLE IF NOT EXISTS wal_graph_writes (
    task_id       text NOT NULL,
    checkpoint_ns text NOT NULL,
    checkpoint_id text NOT NULL,
    seq           bigint NOT NULL,
    writer        text NOT NULL,
    idxs          integer[] NOT NULL,
    PRIMARY KEY (task_id, checkpoint_ns, checkpoint_id, seq)
);
"""

# ----------------------------------------------------------------------------- appends

# One event of a thread's task, appended under the saver's lease epoch, with its index rows,
# in one statement and one commit. The database assigns the seq and computes the chain hash
# (wal_event_hash, the same function as wal_engine/chain.py) under the task row's lock, so
# concurrent appends of one epoch serialise on the row instead of failing on a stale head;
# the epoch is the fence. Parameters:
#   $1 task id   $2 epoch   $3 event type   $4 version   $5 payload
#   $6 namespace $7 checkpoint id (NULL for retention events)   $8 run id
#   $9, $10 channels and version keys of the values stored (checkpoints)
#   $11 writer task id (writes only)   $12 write indexes   $13 dedup: when not NULL and the
#   writer already stored these indexes for this checkpoint, nothing is appended.
# Returns one row: the new seq (NULL if nothing was appended), whether it was a duplicate.
APPEND_EVENT: Final = """
WITH duplicate AS (
    SELECT $13::int4[] IS NOT NULL AND EXISTS (
               SELECT 1 FROM wal_graph_writes w
                WHERE w.task_id = $1 AND w.checkpoint_ns = $6 AND w.checkpoint_id = $7
                  AND w.writer = $11 AND w.idxs @> $13::int4[]) AS found
), head AS (
    SELECT t.head_seq, t.head_hash FROM wal_tasks t, duplicate
     WHERE t.task_id = $1 AND t.lease_epoch = $2 AND NOT duplicate.found
       FOR UPDATE OF t
), event AS (
    SELECT head_seq + 1 AS seq, head_hash AS prev_hash,
           wal_event_hash(head_hash, $1, head_seq + 1, $3, $4, $2, $5) AS hash
      FROM head
), moved AS (
    UPDATE wal_tasks t SET head_seq = event.seq, head_hash = event.hash, updated_at = now()
      FROM event
     WHERE t.task_id = $1
    RETURNING t.head_seq
), appended AS (
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, prev_hash, hash)
    SELECT $1, event.seq, $3, $4, $2, $5, event.prev_hash, event.hash FROM event
    RETURNING seq
), checkpoint_row AS (
    INSERT INTO wal_graph_checkpoints (task_id, checkpoint_ns, checkpoint_id, seq, run_id)
    SELECT $1, $6, $7, event.seq, $8 FROM event
     WHERE $7::text IS NOT NULL AND $11::text IS NULL
    ON CONFLICT (task_id, checkpoint_ns, checkpoint_id)
    DO UPDATE SET seq = EXCLUDED.seq, run_id = EXCLUDED.run_id
), blob_rows AS (
    INSERT INTO wal_graph_blobs (task_id, checkpoint_ns, channel, version, seq)
    SELECT $1, $6, b.channel, b.version, event.seq
      FROM event, unnest($9::text[], $10::text[]) AS b(channel, version)
), write_row AS (
    INSERT INTO wal_graph_writes (task_id, checkpoint_ns, checkpoint_id, seq, writer, idxs)
    SELECT $1, $6, $7, event.seq, $11, $12::int4[] FROM event WHERE $11::text IS NOT NULL
)
SELECT (SELECT seq FROM appended) AS seq, (SELECT found FROM duplicate) AS duplicate
"""

# ----------------------------------------------------------------------------- leases

READ_LEASE: Final = """
SELECT agent, status, lease_epoch, lease_owner, attempts FROM wal_tasks WHERE task_id = $1
"""

LOCK_TASK: Final = """
SELECT agent, status, lease_epoch, lease_owner, attempts FROM wal_tasks
 WHERE task_id = $1
   FOR UPDATE
"""

LOCK_TASK_FENCED: Final = """
SELECT head_seq FROM wal_tasks WHERE task_id = $1 AND lease_epoch = $2 FOR UPDATE
"""

# A takeover of a task still leased by another writer (presumed gone): fence it by bumping
# the epoch and record the orphaning, as wal_break_leases does for expired leases.
ORPHAN_TASK: Final = """
UPDATE wal_tasks SET lease_epoch = $2, lease_owner = NULL, lease_expires_at = NULL
 WHERE task_id = $1
"""

EMIT: Final = "SELECT wal_emit($1, $2, $3::jsonb, $4, $5)"

# The claim itself: the saver's lease has no expiry (a LangGraph thread is written by
# whichever process runs it; a newer writer takes it over, see saver.py), so the engine's
# lease breaker never orphans it and workers never claim it (status RUNNING).
CLAIM_TASK: Final = """
UPDATE wal_tasks t
   SET lease_epoch = $2, lease_owner = $3, lease_expires_at = NULL, wake_at = NULL,
       waiting_signal = NULL, attempts = t.attempts + 1,
       started_at = coalesce(t.started_at, now())
 WHERE t.task_id = $1
"""

MAP_THREAD: Final = """
INSERT INTO wal_graph_threads (task_id, thread_id) VALUES ($1, $2) ON CONFLICT DO NOTHING
"""

# ----------------------------------------------------------------------------- reads

# The newest checkpoint of a namespace (uuid6 ids sort by time, as LangGraph relies on), or
# one checkpoint by id when $3 is not NULL, with the writes stored against it.
READ_CHECKPOINT: Final = """
SELECT c.checkpoint_ns, c.checkpoint_id, c.seq, e.version, e.payload,
       ARRAY(SELECT we.version FROM wal_graph_writes w
               JOIN wal_events we ON we.task_id = w.task_id AND we.seq = w.seq
              WHERE w.task_id = c.task_id AND w.checkpoint_ns = c.checkpoint_ns
                AND w.checkpoint_id = c.checkpoint_id
              ORDER BY w.seq LIMIT $4) AS write_versions,
       ARRAY(SELECT we.payload FROM wal_graph_writes w
               JOIN wal_events we ON we.task_id = w.task_id AND we.seq = w.seq
              WHERE w.task_id = c.task_id AND w.checkpoint_ns = c.checkpoint_ns
                AND w.checkpoint_id = c.checkpoint_id
              ORDER BY w.seq LIMIT $4) AS write_payloads
  FROM wal_graph_checkpoints c
  JOIN wal_events e ON e.task_id = c.task_id AND e.seq = c.seq
 WHERE c.task_id = $1 AND c.checkpoint_ns = $2 AND ($3::text IS NULL OR c.checkpoint_id = $3)
 ORDER BY c.checkpoint_id DESC
 LIMIT 1
"""

# One page of a thread's checkpoints, newest first: namespace $2 (all when NULL), one id $3,
# ids before $4, metadata containing $5, after the page cursor ($6 id, $7 namespace).
LIST_THREAD: Final = """
SELECT c.task_id, c.checkpoint_ns, c.checkpoint_id, c.seq, e.version, e.payload,
       ARRAY(SELECT we.version FROM wal_graph_writes w
               JOIN wal_events we ON we.task_id = w.task_id AND we.seq = w.seq
              WHERE w.task_id = c.task_id AND w.checkpoint_ns = c.checkpoint_ns
                AND w.checkpoint_id = c.checkpoint_id
              ORDER BY w.seq LIMIT $9) AS write_versions,
       ARRAY(SELECT we.payload FROM wal_graph_writes w
               JOIN wal_events we ON we.task_id = w.task_id AND we.seq = w.seq
              WHERE w.task_id = c.task_id AND w.checkpoint_ns = c.checkpoint_ns
                AND w.checkpoint_id = c.checkpoint_id
              ORDER BY w.seq LIMIT $9) AS write_payloads
  FROM wal_graph_checkpoints c
  JOIN wal_events e ON e.task_id = c.task_id AND e.seq = c.seq
 WHERE c.task_id = $1
   AND ($2::text IS NULL OR c.checkpoint_ns = $2)
   AND ($3::text IS NULL OR c.checkpoint_id = $3)
   AND ($4::text IS NULL OR c.checkpoint_id < $4)
   AND ($5::jsonb IS NULL OR convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' @> $5::jsonb)
   AND ($6::text IS NULL OR (c.checkpoint_id, c.checkpoint_ns) < ($6, $7::text))
 ORDER BY c.checkpoint_id DESC, c.checkpoint_ns DESC
 LIMIT $8
"""

# The same across every thread (``list(None, filter=...)``); cursor ($6 id, $7 task, $8 ns).
LIST_ALL: Final = """
SELECT c.task_id, c.checkpoint_ns, c.checkpoint_id, c.seq, e.version, e.payload,
       ARRAY(SELECT we.version FROM wal_graph_writes w
               JOIN wal_events we ON we.task_id = w.task_id AND we.seq = w.seq
              WHERE w.task_id = c.task_id AND w.checkpoint_ns = c.checkpoint_ns
                AND w.checkpoint_id = c.checkpoint_id
              ORDER BY w.seq LIMIT $9) AS write_versions,
       ARRAY(SELECT we.payload FROM wal_graph_writes w
               JOIN wal_events we ON we.task_id = w.task_id AND we.seq = w.seq
              WHERE w.task_id = c.task_id AND w.checkpoint_ns = c.checkpoint_ns
                AND w.checkpoint_id = c.checkpoint_id
              ORDER BY w.seq LIMIT $9) AS write_payloads
  FROM wal_graph_checkpoints c
  JOIN wal_events e ON e.task_id = c.task_id AND e.seq = c.seq
 WHERE ($1::text IS NULL OR c.checkpoint_ns = $1)
   AND ($2::text IS NULL OR c.checkpoint_id = $2)
   AND ($3::text IS NULL OR c.checkpoint_id < $3)
   AND ($4::jsonb IS NULL OR convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' @> $4::jsonb)
   AND ($5::text IS NULL
        OR (c.checkpoint_id, c.task_id, c.checkpoint_ns) < ($5, $6::text, $7::text))
 ORDER BY c.checkpoint_id DESC, c.task_id DESC, c.checkpoint_ns DESC
 LIMIT $8
"""

THREAD_IDS: Final = """
SELECT task_id, thread_id FROM wal_graph_threads WHERE task_id = ANY($1::text[])
"""

# For each (task, namespace, channel, version key, checkpoint seq) asked: the newest event at
# or before that checkpoint that stored the version, grouped by event, with the event itself.
RESOLVE_VALUES: Final = """
WITH found AS (
    SELECT k.task_id, hit.seq, k.ord
      FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[])
               WITH ORDINALITY AS k(task_id, checkpoint_ns, channel, version, before_seq, ord)
      CROSS JOIN LATERAL (
          SELECT b.seq FROM wal_graph_blobs b
           WHERE b.task_id = k.task_id AND b.checkpoint_ns = k.checkpoint_ns
             AND b.channel = k.channel AND b.version = k.version AND b.seq <= k.before_seq
           ORDER BY b.seq DESC
           LIMIT 1) AS hit
), grouped AS (
    SELECT task_id, seq, array_agg(ord) AS ords FROM found GROUP BY task_id, seq
)
SELECT g.task_id, g.seq, g.ords, e.version, e.payload
  FROM grouped g
  JOIN wal_events e ON e.task_id = g.task_id AND e.seq = g.seq
"""

# ----------------------------------------------------------------------------- retention

THREAD_COUNTS: Final = """
SELECT (SELECT count(*) FROM wal_graph_checkpoints WHERE task_id = $1) AS checkpoints,
       (SELECT count(*) FROM wal_graph_writes WHERE task_id = $1) AS writes
"""

LATEST_PER_NAMESPACE: Final = """
SELECT DISTINCT ON (checkpoint_ns) checkpoint_ns, checkpoint_id, seq
  FROM wal_graph_checkpoints
 WHERE task_id = $1
 ORDER BY checkpoint_ns, checkpoint_id DESC
 LIMIT $2
"""

DELETE_THREAD_ROWS: Final = """
WITH checkpoints AS (
    DELETE FROM wal_graph_checkpoints WHERE task_id = $1 AND seq < $2 RETURNING 1
), blobs AS (
    DELETE FROM wal_graph_blobs WHERE task_id = $1 AND seq < $2
), writes AS (
    DELETE FROM wal_graph_writes WHERE task_id = $1 AND seq < $2
)
SELECT count(*) AS removed FROM checkpoints
"""

# keep_latest: every checkpoint but the kept ($3 namespaces, $4 ids) goes, with its writes.
PRUNE_ROWS: Final = """
WITH removed AS (
    DELETE FROM wal_graph_checkpoints c
     WHERE c.task_id = $1 AND c.seq < $2
       AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::text[]) AS k(ns, id)
                        WHERE k.ns = c.checkpoint_ns AND k.id = c.checkpoint_id)
    RETURNING c.checkpoint_ns, c.checkpoint_id
), writes AS (
    DELETE FROM wal_graph_writes w USING removed r
     WHERE w.task_id = $1 AND w.checkpoint_ns = r.checkpoint_ns
       AND w.checkpoint_id = r.checkpoint_id
)
SELECT count(*) AS removed FROM removed
"""

# After keep_latest: index rows of values no kept checkpoint reads ($3..$6 are the ones read).
PRUNE_VALUES: Final = """
DELETE FROM wal_graph_blobs b
 WHERE b.task_id = $1 AND b.seq < $2
   AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::text[], $5::text[], $6::int8[])
                                AS k(ns, channel, version, seq)
                    WHERE k.ns = b.checkpoint_ns AND k.channel = b.channel
                      AND k.version = b.version AND k.seq = b.seq)
"""

RUN_TASKS: Final = """
SELECT DISTINCT task_id FROM wal_graph_checkpoints
 WHERE run_id = ANY($1::text[])
 ORDER BY task_id
 LIMIT $2
"""

COUNT_RUN_CHECKPOINTS: Final = """
SELECT count(*) AS checkpoints FROM wal_graph_checkpoints
 WHERE task_id = $1 AND run_id = ANY($2::text[])
"""

DELETE_RUN_ROWS: Final = """
WITH removed AS (
    DELETE FROM wal_graph_checkpoints c
     WHERE c.task_id = $1 AND c.seq < $2 AND c.run_id = ANY($3::text[])
    RETURNING c.checkpoint_ns, c.checkpoint_id
), writes AS (
    DELETE FROM wal_graph_writes w USING removed r
     WHERE w.task_id = $1 AND w.checkpoint_ns = r.checkpoint_ns
       AND w.checkpoint_id = r.checkpoint_id
)
SELECT count(*) AS removed FROM removed
"""

HAS_DELTA_CHANNELS: Final = """
SELECT EXISTS (
    SELECT 1 FROM wal_events e
     WHERE e.task_id = $1 AND e.seq = ANY($2::int8[])
       AND convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' ?| ARRAY[
               'counters_since_delta_snapshot', 'delta_writes_versioned']
) AS found
"""
