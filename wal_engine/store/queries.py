"""Every SQL statement the store runs, as named constants (``$n`` parameters only).

Each hot statement touches one task (or, for group commit, a bounded set of tasks) and
is one round trip. Multi-row reads carry a LIMIT.

Tenancy: every statement names the tenant of its session (the setting ``wal.tenant``, sent
in the startup packet of every engine connection) as ``tenant = current_setting('wal.tenant',
true)``, the leading column of every key, so it probes the same primary-key index as
before and stays correct where row-level security does not apply (a superuser). Inserts
take the tenant from the columns' default, the same setting; row security (as the
application role) checks it again. Joins between tables join on the tenant as well.
"""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final = "SELECT max(version) FROM wal_schema_version"

SCHEMA_PRESENT: Final = "SELECT to_regclass('wal_schema_version') IS NOT NULL"

SCHEMA_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('wal_engine.schema'))"

SCHEMA_HAS_CHECKSUM: Final = """
SELECT EXISTS (SELECT 1 FROM information_schema.columns
                WHERE table_name = 'wal_schema_version' AND column_name = 'checksum'
                  AND table_schema = current_schema())
"""

SCHEMA_CHECKSUM: Final = "SELECT checksum FROM wal_schema_version WHERE version = $1"

RECORD_SCHEMA_CHECKSUM: Final = "UPDATE wal_schema_version SET checksum = $2 WHERE version = $1"

# Schedules first, and EXCLUSIVE (which a firing worker's FOR UPDATE waits for): a firing
# transaction locks its schedule's row before it inserts into wal_tasks, so a migration
# taking wal_tasks first and then the schedules' table could deadlock with it.
LOCK_ENGINE_TABLES: Final = """
DO $lock$
BEGIN
    IF to_regclass('wal_schedules') IS NOT NULL THEN
        LOCK TABLE wal_schedules IN EXCLUSIVE MODE;
    END IF;
END
$lock$;
LOCK TABLE wal_tasks, wal_events, wal_snapshots, wal_idempotency, wal_signals
    IN SHARE ROW EXCLUSIVE MODE
"""

# The month partitions of the log's per-task tables, created ahead (schema.sql, section
# "partitioning"; the owner's only).
ENSURE_PARTITIONS: Final = "SELECT partition, rows_moved FROM wal_ensure_partitions()"

SYNCHRONOUS_COMMIT: Final = "SELECT current_setting('synchronous_commit')"

# A migration is the owner's: not bound by the engine session's timeouts (decision 35).
MIGRATION_TIMEOUTS: Final = """
SELECT set_config('statement_timeout', '0', true),
       set_config('idle_in_transaction_session_timeout', '0', true)
"""

TENANT_ROLES_PRESENT: Final = "SELECT to_regclass('wal_tenant_roles') IS NOT NULL"

# The tenant the login role is mapped to (row security lets a runtime role read only its
# own row of wal_tenant_roles).
TENANT_OF_ROLE: Final = """
SELECT tenant, enabled FROM wal_tenant_roles WHERE role_name = session_user
"""

# Submission: the task row and its first event (seq 1) in one statement. An existing task
# id yields no row; the caller then reads seq 1 back to decide between "same submission"
# (idempotent) and "different task under the same id". The queue ($12) must be 'default' or
# a configured one (queue_known false: nothing written); a live task of the queue with the
# same dedup id ($15) makes the INSERT fail on wal_tasks_dedup (23505), writing nothing.
# Engine-written events are of chain version 3 (decision 71: no previous hash stored, the
# key '' when none or derived).
CREATE_TASK: Final = """
WITH queue AS (
    SELECT ($12::text = 'default'
            OR EXISTS (SELECT 1 FROM wal_queues q
                        WHERE q.tenant = current_setting('wal.tenant', true)
                          AND q.queue = $12::text)) AS known
), task AS (
    INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash, budget,
                           parent_task_id, parent_seq, agent_version, queue, priority,
                           partition_key, dedup_id)
    SELECT $1, $2, 'QUEUED', 1, $6, $7::jsonb, $8, $9, $10, $12, $13, $14, $15
      FROM queue WHERE queue.known
    ON CONFLICT (tenant, task_id) DO NOTHING
    RETURNING task_id
), event AS (
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                            hash, recorded_at, chain_version)
    SELECT task.task_id, 1, $3, $4, 0, $5, '', $6, $11, 3 FROM task
    RETURNING seq
), wake AS (
    SELECT pg_notify('wal_engine_wake', wal_wake_token()) FROM task
)
SELECT (SELECT count(*) FROM event) AS created, (SELECT count(*) FROM wake) AS notified,
       (SELECT known FROM queue) AS queue_known
"""

# How appends are fenced. Every change of a task's lease epoch (claim, orphaning,
# cancellation) is itself an event carrying the new epoch. So an append is accepted only
# if the event it follows (seq = $3) still has the caller's hash ($4) and epoch ($2) and is
# not terminal: a stale writer finds either another event at its seq (the primary key
# refuses a duplicate) or a predecessor of a newer epoch. Observations (no status move)
# touch only wal_events: one index probe plus the insert. A batch that moves the status
# also updates the task's row (status, wake time, lease), where the state-machine trigger
# checks the walk; wal_tasks.head_seq/head_hash are the head as of that last move.
PREVIOUS_OK: Final = """
    SELECT 1 FROM wal_events p
     WHERE p.tenant = current_setting('wal.tenant', true) AND p.task_id = $1 AND p.seq = $3
       AND p.hash = $4 AND p.epoch = $2
       AND p.type NOT IN ('task_completed', 'task_failed', 'task_cancelled')
"""

# An observation also needs the lease: a task that began to wait or was handed back
# (the events after which its lease is dropped) takes only a status move from the same
# epoch (the run's own `task_woken` after a signal that raced its wait); an observation
# there comes from a run that no longer owns the task.
LEASE_DROPPED_TYPES: Final = ("signal_awaited", "timer_started", "task_released")

PREVIOUS_OK_LEASED: Final = f"""
    SELECT 1 FROM wal_events p
     WHERE p.tenant = current_setting('wal.tenant', true) AND p.task_id = $1 AND p.seq = $3
       AND p.hash = $4 AND p.epoch = $2
       AND p.type NOT IN ('task_completed', 'task_failed', 'task_cancelled',
                          {", ".join(repr(t) for t in LEASE_DROPPED_TYPES)})
"""

# One observation, scalar parameters: $5 type, $6 version, $7 payload, $8 key (as stored,
# chain.stored_key), $9 hash, $10 the time stamped on it (chain version 3 covers it, with the
# key).
OBSERVE_ONE: Final = f"""
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                        hash, recorded_at, chain_version)
SELECT $1, $3 + 1, $5, $6, $2, $7, $8, $9, $10, 3
 WHERE EXISTS ({PREVIOUS_OK_LEASED})
RETURNING seq
"""

# A batch of observations of one task: $5..$9 are arrays (type, version, payload, key,
# hash), $10 the time stamped on them.
OBSERVE_MANY: Final = f"""
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                        hash, recorded_at, chain_version)
SELECT $1, $3 + e.ord, e.type, e.version, $2, e.payload, e.idempotency_key, e.hash, $10, 3
  FROM unnest($5::text[], $6::int2[], $7::bytea[], $8::text[], $9::bytea[])
           WITH ORDINALITY AS e(type, version, payload, idempotency_key, hash, ord)
 WHERE EXISTS ({PREVIOUS_OK_LEASED})
RETURNING seq
"""

# A batch that moves the status ($10 the final status, $11 the walk): the task row and the
# events in one statement. $12/$13 set the wake time and awaited signal when it ends
# WAITING (database clock); leaving the leased statuses drops the lease. $14 is the time
# stamped on the events.
TRANSITION: Final = f"""
WITH head AS (
    UPDATE wal_tasks
       SET head_seq = $3 + cardinality($5::text[]),
           head_hash = ($9::bytea[])[cardinality($9::bytea[])],
           status = $10, status_path = $11::text[], updated_at = now(),
           wake_at = CASE WHEN $10 = 'WAITING' THEN now() + $12 * interval '1 millisecond'
                          ELSE wake_at END,
           waiting_signal = CASE WHEN $10 = 'WAITING' THEN $13 ELSE waiting_signal END,
           lease_owner = CASE WHEN $10 IN ('WAITING', 'RESUMING', 'COMPLETED', 'FAILED')
                              THEN NULL ELSE lease_owner END,
           lease_expires_at = CASE WHEN $10 IN ('WAITING', 'RESUMING', 'COMPLETED', 'FAILED')
                                   THEN NULL ELSE lease_expires_at END
     WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND lease_epoch = $2
       AND EXISTS ({PREVIOUS_OK})
 RETURNING task_id
)
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                        hash, recorded_at, chain_version)
SELECT head.task_id, $3 + e.ord, e.type, e.version, $2, e.payload, e.idempotency_key,
       e.hash, $14, 3
  FROM head,
       unnest($5::text[], $6::int2[], $7::bytea[], $8::text[], $9::bytea[])
           WITH ORDINALITY AS e(type, version, payload, idempotency_key, hash, ord)
RETURNING seq
"""

# Group commit: the pending appends of many tasks in one statement and one commit, each
# task fenced on its own. $1..$9, $17 and $18 (the time stamped on its events) are per task
# (index i); $10..$16 per event (task index).
# Tasks whose predecessor check fails are left out (the caller classifies them); a
# duplicate seq aborts the statement (the caller then appends task by task). Returns the
# ids of the accepted tasks.
APPEND_MANY: Final = f"""
WITH batch AS (
    SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[], $5::bytea[],
                         $6::text[], $7::text[], $8::int8[], $9::text[], $17::int4[],
                         $18::timestamptz[])
               WITH ORDINALITY AS b(task_id, epoch, expected_seq, prev_hash, new_hash,
                                    new_status, status_path, wake_after_ms, waiting_signal,
                                    n, recorded_at, i)
), fenced AS (
    SELECT batch.* FROM batch
      JOIN wal_events p ON p.tenant = current_setting('wal.tenant', true)
       AND p.task_id = batch.task_id AND p.seq = batch.expected_seq
       AND p.hash = batch.prev_hash AND p.epoch = batch.epoch
       AND p.type NOT IN ('task_completed', 'task_failed', 'task_cancelled')
       AND (batch.new_status IS NOT NULL
            OR p.type NOT IN ({", ".join(repr(t) for t in LEASE_DROPPED_TYPES)}))
), moved AS (
    UPDATE wal_tasks AS t
       SET head_seq = f.expected_seq + f.n,
           head_hash = f.new_hash, status = f.new_status,
           status_path = string_to_array(f.status_path, ','), updated_at = now(),
           wake_at = CASE WHEN f.new_status = 'WAITING'
                          THEN now() + f.wake_after_ms * interval '1 millisecond'
                          ELSE t.wake_at END,
           waiting_signal = CASE WHEN f.new_status = 'WAITING' THEN f.waiting_signal
                                 ELSE t.waiting_signal END,
           lease_owner = CASE WHEN f.new_status IN ('WAITING', 'RESUMING', 'COMPLETED', 'FAILED')
                              THEN NULL ELSE t.lease_owner END,
           lease_expires_at = CASE WHEN f.new_status IN ('WAITING', 'RESUMING', 'COMPLETED',
                                                         'FAILED')
                                   THEN NULL ELSE t.lease_expires_at END
      FROM fenced AS f
     WHERE f.new_status IS NOT NULL AND t.tenant = current_setting('wal.tenant', true)
       AND t.task_id = ANY ($1::text[])
       AND t.task_id = f.task_id AND t.lease_epoch = f.epoch
 RETURNING f.i
), accepted AS (
    SELECT i, task_id, epoch, expected_seq, prev_hash, recorded_at FROM fenced
     WHERE new_status IS NULL
    UNION ALL
    SELECT f.i, f.task_id, f.epoch, f.expected_seq, f.prev_hash, f.recorded_at
      FROM fenced f JOIN moved m ON m.i = f.i
), inserted AS (
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key,
                            hash, recorded_at, chain_version)
    SELECT a.task_id, a.expected_seq + e.offset_in_task, e.type, e.version, a.epoch,
           e.payload, e.idempotency_key, e.hash, a.recorded_at, 3
      FROM unnest($10::int8[], $11::int4[], $12::text[], $13::int2[], $14::bytea[],
                  $15::text[], $16::bytea[])
               AS e(task_index, offset_in_task, type, version, payload, idempotency_key, hash)
      JOIN accepted a ON a.i = e.task_index
    RETURNING 1
)
SELECT a.task_id, (SELECT count(*) FROM inserted) AS events FROM accepted a
"""

# The head of a task: its row, with head_seq/head_hash taken from the log's last event
# (the row's own copy is only as new as the last status move).
# The tombstone of an archived task (schema.sql, section "retention"): why its id is taken.
READ_TOMBSTONE: Final = """
SELECT status, retention_id FROM wal_archived_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""

# The log's side names the task by $1, not by the row's column: the planner prunes the
# partitioned log to the task's partition only for a parameter (decision 70).
READ_HEAD: Final = """
SELECT t.task_id, t.agent, t.status, last.seq AS head_seq, last.hash AS head_hash,
       t.lease_owner, t.lease_epoch, t.lease_expires_at, t.wake_at, t.waiting_signal,
       t.budget::text AS budget, t.parent_task_id, t.parent_seq, t.attempts, t.created_at,
       t.started_at, t.updated_at, t.agent_version
  FROM wal_tasks t
  CROSS JOIN LATERAL (SELECT e.seq, e.hash FROM wal_events e
                      WHERE e.tenant = current_setting('wal.tenant', true) AND e.task_id = $1
                      ORDER BY e.seq DESC LIMIT 1) AS last
 WHERE t.tenant = current_setting('wal.tenant', true) AND t.task_id = $1
"""

# The tenant's LLM spend and the administrator's cap on it (no row: nothing spent yet).
TENANT_LLM_SPEND: Final = """
SELECT llm_spend_usd, llm_spend_max_usd FROM wal_tenants
 WHERE tenant = current_setting('wal.tenant', true)
"""

ADD_LLM_SPEND: Final = "SELECT * FROM wal_add_llm_spend($1::numeric)"

# The last event of a task (to classify a refused append).
READ_LAST_EVENT: Final = """
SELECT seq, epoch, type FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
 ORDER BY seq DESC LIMIT 1
"""

# The head as the task row records it (last status move), for verification.
READ_RECORDED_HEAD: Final = """
SELECT head_seq, head_hash, lease_epoch FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""

# Rows of a task outside 1..: the streamed read starts at seq 1 and would never see them.
READ_SEQ_BELOW_ONE: Final = """
SELECT seq FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND seq < 1
 ORDER BY seq
 LIMIT 1
"""

# Events whose task has no row (a forged append for a task that does not exist): a full
# scan of the tenant's log, run by `verify --all` only, which reads every event anyway.
ORPHAN_EVENT_TASKS: Final = """
SELECT e.task_id, min(e.seq) AS seq, count(*) AS events
  FROM wal_events e
 WHERE e.tenant = current_setting('wal.tenant', true)
   AND NOT EXISTS (SELECT 1 FROM wal_tasks t
                    WHERE t.tenant = e.tenant AND t.task_id = e.task_id)
 GROUP BY e.task_id
 ORDER BY e.task_id
 LIMIT $1
"""

READ_EVENTS: Final = """
SELECT task_id, seq, type, version, epoch, payload, idempotency_key, hash, recorded_at,
       chain_version
  FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND seq >= $2 AND seq <= $3
 ORDER BY seq
 LIMIT $4
"""

READ_EVENT_HASHES: Final = """
SELECT seq, hash FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND seq >= $2 AND seq <= $3
 ORDER BY seq
 LIMIT $4
"""

# A finished task's row holds its true head (its ending moved the row to the ending event,
# and nothing may follow an ending: the append refuses it, the status trigger refuses a
# head moved past it), so only a live task's head is read from the log (decision 74: at
# millions of tasks, most listed tasks are finished, and each log probe is a page of
# wal_events' index that the cache no longer holds). With a status filter, the
# (tenant, status, task_id) index gives the order. The page is chosen first, in a subquery
# with its own LIMIT, and only its rows probe the log: joined before the LIMIT, a plan
# from statistics that predate the live tasks (one RUNNING task when the table was last
# analyzed, 1,002 at the listing) sorted every matching task and probed the log for each,
# 2.2 ms instead of 0.17 ms for a page of 50 (benchmarks/scale.py's list_running, 6.61x
# at 1,000,000 tasks).
_LIST_TASKS: Final = """
SELECT t.task_id, t.agent, t.status, coalesce(last.seq, t.head_seq) AS head_seq,
       coalesce(last.hash, t.head_hash) AS head_hash,
       t.lease_owner, t.lease_epoch, t.lease_expires_at, t.wake_at, t.waiting_signal,
       t.budget::text AS budget, t.parent_task_id, t.parent_seq, t.attempts, t.created_at,
       t.started_at, t.updated_at, t.agent_version
  FROM (SELECT * FROM wal_tasks t
         WHERE t.tenant = current_setting('wal.tenant', true) AND t.task_id > $1 {filters}
         ORDER BY t.task_id
         LIMIT $2) AS t
  LEFT JOIN LATERAL (SELECT e.seq, e.hash FROM wal_events e
                      WHERE t.status NOT IN ('COMPLETED', 'FAILED')
                        AND e.tenant = t.tenant AND e.task_id = t.task_id
                      ORDER BY e.seq DESC LIMIT 1) AS last ON true
 ORDER BY t.task_id
"""

# A read-only transaction whose prepared statements run on their generic plans
# (Store.list_tasks), in one round trip.
BEGIN_GENERIC_PLANS: Final = (
    "BEGIN READ ONLY; SET LOCAL plan_cache_mode = force_generic_plan")

# One statement per combination of filters: "($n IS NULL OR col = $n)" would make the
# generic plan of a prepared statement scan the whole table.
LIST_TASKS: Final = {
    (False, False): _LIST_TASKS.format(filters=""),
    (True, False): _LIST_TASKS.format(filters="AND t.status = $3"),
    (False, True): _LIST_TASKS.format(filters="AND t.agent = $3"),
    (True, True): _LIST_TASKS.format(filters="AND t.status = $3 AND t.agent = $4"),
}

# Heartbeat: one statement renews every lease a worker holds, each fenced by its epoch.
# Returns the tasks still held; a task missing from the answer was lost. The status test
# is written so that no partial index of the leased tasks matches it: the plan is one
# primary-key probe per lease whatever the statistics say (decision 74: with statistics
# taken while few tasks ran, the generic plan walked every leased task for each lease,
# 1.7 ms instead of 0.12 ms for one lease at 200,000 tasks).
RENEW_LEASES: Final = """
UPDATE wal_tasks AS t
   SET lease_expires_at = now() + $3 * interval '1 millisecond'
  FROM unnest($1::text[], $2::int8[]) AS h(task_id, epoch)
 WHERE t.tenant = current_setting('wal.tenant', true) AND t.task_id = h.task_id
   AND t.lease_epoch = h.epoch
   AND t.status || '' IN ('RUNNING', 'CHECKPOINTED')
RETURNING t.task_id
"""

CLAIM_TASKS: Final = "SELECT * FROM wal_claim_tasks($1, $2, $3, $4::text[], $5::text[])"

# The worker's claim: CLAIM_TASKS and, in $6 and $7, its running tasks by queue (parallel
# arrays) for the queues' per-worker limits.
CLAIM_TASKS_BY_QUEUE: Final = """
SELECT * FROM wal_claim_tasks($1, $2, $3, $4::text[], $5::text[], $6::text[], $7::int4[])
"""

# The deploy gate's tasks: every live task, and the most recently finished ones, updated at
# or after $1 (all when NULL).
REPLAY_CANDIDATES: Final = """
(SELECT task_id, agent, agent_version, status FROM wal_tasks
  WHERE tenant = current_setting('wal.tenant', true)
    AND status NOT IN ('COMPLETED', 'FAILED') AND ($1::timestamptz IS NULL OR updated_at >= $1)
  ORDER BY task_id LIMIT $2)
UNION ALL
(SELECT task_id, agent, agent_version, status FROM wal_tasks
  WHERE tenant = current_setting('wal.tenant', true)
    AND status IN ('COMPLETED', 'FAILED') AND ($1::timestamptz IS NULL OR updated_at >= $1)
  ORDER BY updated_at DESC LIMIT $3)
"""

# Tasks counted by agent, agent version and status, among the statuses $2 (text[]): every
# status for ``wal-engine tasks --by-version``, the live ones for a worker's gauge of what
# still runs on each version (the (tenant, status) index can skip the finished tasks).
TASKS_BY_VERSION: Final = """
SELECT agent, agent_version, status, count(*) AS tasks FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND status = ANY($2::text[])
 GROUP BY agent, agent_version, status
 ORDER BY agent, agent_version NULLS FIRST, status
 LIMIT $1
"""

BREAK_LEASES: Final = "SELECT * FROM wal_break_leases($1)"

SEND_SIGNAL: Final = "SELECT wal_send_signal($1, $2, $3, $4) AS signal_id"

CANCEL_TASK: Final = "SELECT wal_cancel_task($1, $2, $3) AS cancelled"

READ_SIGNALS: Final = """
SELECT signal_id, name, payload, sent_at FROM wal_signals
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND name = $2
   AND signal_id <> ALL($3::int8[])
 ORDER BY signal_id
 LIMIT $4
"""

DATABASE_NOW: Final = "SELECT now() AS now"

DATABASE_NOW_MS: Final = "SELECT (extract(epoch FROM now()) * 1000)::int8 AS now_ms"

NEXT_WAKE: Final = """
SELECT min(wake_at) AS wake_at FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND status = 'WAITING' AND wake_at IS NOT NULL
"""

# Wake idle workers of this tenant: the payload is the tenant's opaque token, never a task
# id (NOTIFY is not filtered by row security).
WAKE_WORKERS: Final = "SELECT pg_notify('wal_engine_wake', wal_wake_token())"

# ----------------------------------------------------------------------------- large values
# (wal_engine.blobs, decision 61.) An append whose events carry large values writes their
# chunks in the same statement, under the same fence: a data-modifying CTE inserting the
# chunks (a value the task already holds is skipped), added to the statement only when there
# are chunks, so the statements of ordinary appends are unchanged. $a..$a+3: digests,
# ordinals, value lengths, data (parallel arrays).


def _blob_rows(first: int) -> str:
    return (f"unnest(${first}::bytea[], ${first + 1}::int4[], ${first + 2}::int8[], "
            f"${first + 3}::bytea[]) AS b(digest, ordinal, value_bytes, data)")


_BLOB_COLUMNS: Final = "INSERT INTO wal_blobs (task_id, digest, ordinal, value_bytes, data)"


def with_blobs_observe(statement: str, first: int) -> str:
    """OBSERVE_ONE / OBSERVE_MANY storing the chunks in ``$first..$first+3`` too."""
    return f"""
WITH blobs AS (
    {_BLOB_COLUMNS}
    SELECT $1, b.digest, b.ordinal, b.value_bytes, b.data FROM {_blob_rows(first)}
     WHERE EXISTS ({PREVIOUS_OK_LEASED})
    ON CONFLICT DO NOTHING
    RETURNING 1
){statement}"""


def with_blobs_after(statement: str, cte: str, first: int) -> str:
    """A statement whose first CTE ``cte`` yields the task (``task_id`` column) only when
    it may be written, storing the chunks in ``$first..$first+3`` too."""
    marker = "\n)\nINSERT INTO wal_events"
    head, found, rest = statement.partition(marker)
    assert found, "the statement's first CTE must precede the events' INSERT"
    return f"""{head}
), blobs AS (
    {_BLOB_COLUMNS}
    SELECT {cte}.task_id, b.digest, b.ordinal, b.value_bytes, b.data
      FROM {cte}, {_blob_rows(first)}
    ON CONFLICT DO NOTHING
    RETURNING 1
)
INSERT INTO wal_events{rest}"""


OBSERVE_ONE_BLOBS: Final = with_blobs_observe(OBSERVE_ONE, 11)
OBSERVE_MANY_BLOBS: Final = with_blobs_observe(OBSERVE_MANY, 11)
TRANSITION_BLOBS: Final = with_blobs_after(TRANSITION, "head", 15)

CREATE_TASK_BLOBS: Final = CREATE_TASK.replace("""
), event AS (""", f"""
), blobs AS (
    {_BLOB_COLUMNS}
    SELECT task.task_id, b.digest, b.ordinal, b.value_bytes, b.data
      FROM task, {_blob_rows(16)}
    ON CONFLICT DO NOTHING
    RETURNING 1
), event AS (""")

# The chunks of some of a task's values, in (digest, ordinal) order from just after
# ($3, $4), one page of $5 chunks: a value is read a page at a time, never in one row set.
READ_BLOB_CHUNKS: Final = """
SELECT digest, ordinal, data FROM wal_blobs
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
   AND digest = ANY ($2::bytea[]) AND (digest, ordinal) > ($3::bytea, $4::int4)
 ORDER BY digest, ordinal
 LIMIT $5
"""


# Child tasks (issue 24): the policy of a child just created in the same transaction, and
# what a parent needs of a task it spawned or asks a handle of.
SET_ON_PARENT_END: Final = """
UPDATE wal_tasks SET on_parent_end = $2
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""

READ_CHILD: Final = """
SELECT task_id, agent, status, parent_task_id, parent_seq FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""

# ---------------------------------------------------------------- queues (issue 24)

SET_QUEUE: Final = "SELECT * FROM wal_set_queue($1, $2, $3, $4::text[], $5)"

# The live task of a queue holding a dedup id (the refused submission's rival).
DEDUP_HOLDER: Final = """
SELECT task_id FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND queue = $1 AND dedup_id = $2
   AND status NOT IN ('COMPLETED', 'FAILED')
 LIMIT 1
"""

# Each queue of the tenant, configured or holding live tasks: depth (claimable now: QUEUED,
# RESUMING, WAITING due), running (leased), waiting, its limits, and how long the oldest
# claimable task has waited (a RESUMING task since its last status move). One pass over the
# live tasks (the index by tenant and status); at most $1 queues.
QUEUE_STATS: Final = """
WITH live AS (
    SELECT t.queue,
           count(*) FILTER (WHERE t.status IN ('QUEUED', 'RESUMING')
                               OR (t.status = 'WAITING' AND t.wake_at <= now())) AS depth,
           count(*) FILTER (WHERE t.status IN ('RUNNING', 'CHECKPOINTED')) AS running,
           count(*) FILTER (WHERE t.status = 'WAITING'
                              AND (t.wake_at IS NULL OR t.wake_at > now())) AS waiting,
           min(CASE WHEN t.status = 'QUEUED' THEN t.created_at
                    WHEN t.status = 'RESUMING' THEN t.updated_at
                    WHEN t.status = 'WAITING' AND t.wake_at <= now() THEN t.wake_at END)
               AS oldest
      FROM wal_tasks t
     WHERE t.tenant = current_setting('wal.tenant', true)
       AND t.status IN ('QUEUED', 'RUNNING', 'CHECKPOINTED', 'WAITING', 'RESUMING')
     GROUP BY t.queue
), configured AS (
    SELECT q.queue, q.concurrency_max, q.worker_concurrency_max, q.updated_at FROM wal_queues q
     WHERE q.tenant = current_setting('wal.tenant', true)
)
SELECT coalesce(c.queue, l.queue) AS queue, c.queue IS NOT NULL AS configured,
       coalesce(l.depth, 0) AS depth, coalesce(l.running, 0) AS running,
       coalesce(l.waiting, 0) AS waiting, c.concurrency_max, c.worker_concurrency_max,
       extract(epoch FROM now() - l.oldest)::float8 AS oldest_wait_s, c.updated_at
  FROM configured c FULL JOIN live l ON l.queue = c.queue
 ORDER BY 1
 LIMIT $1
"""

# The audit of queue changes, newest first, of one queue ($1) or all (NULL), $2 at most.
QUEUE_CHANGES: Final = """
SELECT change_id, queue, changed_at, changed_by::text AS changed_by, requested_by,
       before::text AS before, after::text AS after
  FROM wal_queue_changes
 WHERE tenant = current_setting('wal.tenant', true) AND ($1::text IS NULL OR queue = $1)
 ORDER BY change_id DESC
 LIMIT $2
"""
