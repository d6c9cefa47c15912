"""Every SQL statement the store runs, as named constants (``$n`` parameters only).

Each hot statement touches one task (or, for group commit, a bounded set of tasks) and
is one round trip. Multi-row reads carry a LIMIT.
"""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final = "SELECT max(version) FROM wal_schema_version"

SCHEMA_PRESENT: Final = "SELECT to_regclass('wal_schema_version') IS NOT NULL"

SCHEMA_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('wal_engine.schema'))"

SYNCHRONOUS_COMMIT: Final = "SELECT current_setting('synchronous_commit')"

# Submission: the task row and its first event (seq 1) in one statement. An existing task
# id yields no row; the caller then reads seq 1 back to decide between "same submission"
# (idempotent) and "different task under the same id".
CREATE_TASK: Final = """
WITH task AS (
    INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash, budget,
                           parent_task_id, parent_seq)
    VALUES ($1, $2, 'QUEUED', 1, $6, $7::jsonb, $8, $9)
    ON CONFLICT (task_id) DO NOTHING
    RETURNING task_id
), event AS (
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, prev_hash, hash)
    SELECT task.task_id, 1, $3, $4, 0, $5, $10, $6 FROM task
    RETURNING seq
), wake AS (
    SELECT pg_notify('wal_engine_wake', task_id) FROM task
)
SELECT (SELECT count(*) FROM event) AS created, (SELECT count(*) FROM wake) AS notified
"""

# One fenced append of a batch of one task's events: one statement, one commit. The head
# moves only if the caller's epoch, expected head seq and head hash all still hold; the
# events are inserted only if the head moved. Zero rows back means fenced or conflicting.
# A batch that ends WAITING sets the wake time ($14 ms from now, database clock; NULL waits
# for the signal $15 forever); a batch that leaves the leased statuses drops the lease.
APPEND_EVENTS: Final = """
WITH head AS (
    UPDATE wal_tasks
       SET head_seq = $3 + cardinality($8::text[]), head_hash = $5,
           status = coalesce($6, status), status_path = $7::text[], updated_at = now(),
           wake_at = CASE WHEN $6 = 'WAITING' THEN now() + $14 * interval '1 millisecond'
                          ELSE wake_at END,
           waiting_signal = CASE WHEN $6 = 'WAITING' THEN $15 ELSE waiting_signal END,
           lease_owner = CASE WHEN $6 IN ('WAITING', 'RESUMING', 'COMPLETED', 'FAILED')
                              THEN NULL ELSE lease_owner END,
           lease_expires_at = CASE WHEN $6 IN ('WAITING', 'RESUMING', 'COMPLETED', 'FAILED')
                                   THEN NULL ELSE lease_expires_at END
     WHERE task_id = $1 AND lease_epoch = $2 AND head_seq = $3 AND head_hash = $4
 RETURNING task_id
)
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                        prev_hash, hash)
SELECT head.task_id, $3 + e.ord, e.type, e.version, $2, e.payload, e.idempotency_key,
       e.prev_hash, e.hash
  FROM head,
       unnest($8::text[], $9::int2[], $10::bytea[], $11::text[], $12::bytea[], $13::bytea[])
           WITH ORDINALITY AS e(type, version, payload, idempotency_key, prev_hash, hash, ord)
RETURNING seq
"""

# Group commit: the pending appends of many tasks in one statement and one commit, each
# task fenced on its own. $1..$7 are per task (index i), $8..$14 per event (task index).
# Returns the ids of the tasks whose append was accepted.
APPEND_MANY: Final = """
WITH heads AS (
    UPDATE wal_tasks AS t
       SET head_seq = b.expected_seq + b.n, head_hash = b.new_hash,
           status = coalesce(b.new_status, t.status),
           status_path = CASE WHEN b.status_path IS NULL THEN NULL
                              ELSE string_to_array(b.status_path, ',') END,
           updated_at = now(),
           wake_at = CASE WHEN b.new_status = 'WAITING'
                          THEN now() + b.wake_after_ms * interval '1 millisecond'
                          ELSE t.wake_at END,
           waiting_signal = CASE WHEN b.new_status = 'WAITING' THEN b.waiting_signal
                                 ELSE t.waiting_signal END,
           lease_owner = CASE WHEN b.new_status IN ('WAITING', 'RESUMING', 'COMPLETED', 'FAILED')
                              THEN NULL ELSE t.lease_owner END,
           lease_expires_at = CASE WHEN b.new_status IN ('WAITING', 'RESUMING', 'COMPLETED',
                                                         'FAILED')
                                   THEN NULL ELSE t.lease_expires_at END
      FROM unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[], $5::bytea[], $6::text[],
                  $7::text[], $15::int4[], $17::int8[], $18::text[])
               WITH ORDINALITY AS b(task_id, epoch, expected_seq, prev_hash, new_hash,
                                    new_status, status_path, n, wake_after_ms, waiting_signal, i)
     WHERE t.task_id = b.task_id AND t.lease_epoch = b.epoch
       AND t.head_seq = b.expected_seq AND t.head_hash = b.prev_hash
 RETURNING b.i, t.task_id, b.epoch, b.expected_seq
), inserted AS (
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                            prev_hash, hash)
    SELECT heads.task_id, heads.expected_seq + e.offset_in_task, e.type, e.version,
           heads.epoch, e.payload, e.idempotency_key, e.prev_hash, e.hash
      FROM unnest($8::int8[], $9::int4[], $10::text[], $11::int2[], $12::bytea[],
                  $13::text[], $14::bytea[], $16::bytea[])
               AS e(task_index, offset_in_task, type, version, payload, idempotency_key,
                    prev_hash, hash)
      JOIN heads ON heads.i = e.task_index
    RETURNING 1
)
SELECT heads.task_id, (SELECT count(*) FROM inserted) AS events FROM heads
"""

READ_HEAD: Final = """
SELECT task_id, agent, status, head_seq, head_hash, lease_owner, lease_epoch,
       lease_expires_at, wake_at, waiting_signal, budget::text AS budget, parent_task_id,
       parent_seq, attempts, created_at, started_at, updated_at
  FROM wal_tasks WHERE task_id = $1
"""

READ_EVENTS: Final = """
SELECT task_id, seq, type, version, epoch, payload, idempotency_key, prev_hash, hash,
       recorded_at
  FROM wal_events
 WHERE task_id = $1 AND seq >= $2 AND seq <= $3
 ORDER BY seq
 LIMIT $4
"""

READ_EVENT_HASHES: Final = """
SELECT seq, hash FROM wal_events
 WHERE task_id = $1 AND seq >= $2 AND seq <= $3
 ORDER BY seq
 LIMIT $4
"""

LIST_TASKS: Final = """
SELECT task_id, agent, status, head_seq, head_hash, lease_owner, lease_epoch,
       lease_expires_at, wake_at, waiting_signal, budget::text AS budget, parent_task_id,
       parent_seq, attempts, created_at, started_at, updated_at
  FROM wal_tasks
 WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR agent = $2)
   AND task_id > $3
 ORDER BY task_id
 LIMIT $4
"""

# Heartbeat: one statement renews every lease a worker holds, each fenced by its epoch.
# Returns the tasks still held; a task missing from the answer was lost.
RENEW_LEASES: Final = """
UPDATE wal_tasks AS t
   SET lease_expires_at = now() + $3 * interval '1 millisecond'
  FROM unnest($1::text[], $2::int8[]) AS h(task_id, epoch)
 WHERE t.task_id = h.task_id AND t.lease_epoch = h.epoch
   AND t.status IN ('RUNNING', 'CHECKPOINTED')
RETURNING t.task_id
"""

CLAIM_TASKS: Final = "SELECT * FROM wal_claim_tasks($1, $2, $3)"

BREAK_LEASES: Final = "SELECT * FROM wal_break_leases($1)"

SEND_SIGNAL: Final = "SELECT wal_send_signal($1, $2, $3, $4) AS signal_id"

CANCEL_TASK: Final = "SELECT wal_cancel_task($1, $2, $3) AS cancelled"

READ_SIGNALS: Final = """
SELECT signal_id, name, payload, sent_at FROM wal_signals
 WHERE task_id = $1 AND name = $2 AND signal_id <> ALL($3::int8[])
 ORDER BY signal_id
 LIMIT $4
"""

DATABASE_NOW: Final = "SELECT now() AS now"

NEXT_WAKE: Final = """
SELECT min(wake_at) AS wake_at FROM wal_tasks WHERE status = 'WAITING' AND wake_at IS NOT NULL
"""
