"""SQL of the LangGraph saver, as named constants (``$n`` parameters only).

The log stays the only source of truth: every checkpoint, every ``put_writes`` call and
every retention operation is an event in ``wal_events``, hash-chained like any other. Three
small tables are *derived* index data, maintained in the same statement (or transaction) as
the event they point to, so that a read touches a handful of rows, never a thread's history:

``wal_graph_threads``      task id -> LangGraph thread id (one row per thread).
``wal_graph_checkpoints``  (task, namespace, checkpoint id) -> seq of its
                           ``graph_checkpoint_saved`` event, the seqs of the earlier events
                           holding its unchanged channel values (``ref_seqs``), its run id.
``wal_graph_writes``       (task, namespace, checkpoint id, seq) of each
                           ``graph_writes_saved`` event.

Retention operations delete rows of these tables (never of ``wal_events``), in the same
transaction as the ``graph_checkpoints_removed`` event that records them. Replaying a task's
events rebuilds them: checkpoint and writes events add rows, each removal event drops the
rows before it that it names.

Statements with optional filters come in one variant per shape, so that PostgreSQL's
generic plans of the prepared statements always use the primary keys.

Tenancy, as in ``wal_engine/store/queries.py``: each table has a ``tenant`` column (default
the session's ``wal.tenant``) leading its primary key, row-level security is enabled and
forced on it, and every statement names ``tenant = current_setting('wal.tenant', true)``
and joins on the tenant.
"""

from __future__ import annotations

from typing import Final

SETUP_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('wal_engine.langgraph'))"

SETUP: Final = """
CREATE TABLE IF NOT EXISTS wal_graph_threads (
    tenant    text NOT NULL DEFAULT current_setting('wal.tenant'),
    task_id   text NOT NULL,
    thread_id text NOT NULL,
    CONSTRAINT wal_graph_threads_pkey PRIMARY KEY (tenant, task_id)
);
CREATE TABLE IF NOT EXISTS wal_graph_checkpoints (
    tenant        text NOT NULL DEFAULT current_setting('wal.tenant'),
    task_id       text NOT NULL,
    checkpoint_ns text NOT NULL,
    checkpoint_id text NOT NULL,
    seq           bigint NOT NULL,
    run_id        text,
    ref_seqs      bigint[] NOT NULL DEFAULT '{}',
    CONSTRAINT wal_graph_checkpoints_pkey PRIMARY KEY (tenant, task_id, checkpoint_ns,
                                                       checkpoint_id)
);
CREATE TABLE IF NOT EXISTS wal_graph_writes (
    tenant        text NOT NULL DEFAULT current_setting('wal.tenant'),
    task_id       text NOT NULL,
    checkpoint_ns text NOT NULL,
    checkpoint_id text NOT NULL,
    seq           bigint NOT NULL,
    CONSTRAINT wal_graph_writes_pkey PRIMARY KEY (tenant, task_id, checkpoint_ns,
                                                  checkpoint_id, seq)
);
-- Tables made before tenants: their rows become tenant 'default', keys get the tenant
-- first; then row-level security. Each step checks first (this runs at every setup).
DO $tenancy$
DECLARE
    wanted record;
BEGIN
    FOR wanted IN
        SELECT * FROM (VALUES
            ('wal_graph_threads', 'PRIMARY KEY (tenant, task_id)'),
            ('wal_graph_checkpoints',
             'PRIMARY KEY (tenant, task_id, checkpoint_ns, checkpoint_id)'),
            ('wal_graph_writes',
             'PRIMARY KEY (tenant, task_id, checkpoint_ns, checkpoint_id, seq)')
        ) AS w(table_name, definition)
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_attribute a
                        WHERE a.attrelid = wanted.table_name::regclass
                          AND a.attname = 'tenant' AND NOT a.attisdropped) THEN
            EXECUTE format('ALTER TABLE %I ADD COLUMN tenant text NOT NULL DEFAULT %L',
                           wanted.table_name, 'default');
            EXECUTE format('ALTER TABLE %I ALTER COLUMN tenant SET DEFAULT '
                           'current_setting(%L)', wanted.table_name, 'wal.tenant');
        END IF;
        IF NOT EXISTS (SELECT 1 FROM pg_constraint c
                        WHERE c.conrelid = wanted.table_name::regclass
                          AND c.conname = wanted.table_name || '_pkey'
                          AND pg_get_constraintdef(c.oid) = wanted.definition) THEN
            EXECUTE format('ALTER TABLE %I DROP CONSTRAINT IF EXISTS %I, ADD CONSTRAINT %I %s',
                           wanted.table_name, wanted.table_name || '_pkey',
                           wanted.table_name || '_pkey', wanted.definition);
        END IF;
        IF NOT EXISTS (SELECT 1 FROM pg_class c
                        WHERE c.oid = wanted.table_name::regclass
                          AND c.relrowsecurity AND c.relforcerowsecurity) THEN
            EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', wanted.table_name);
            EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', wanted.table_name);
        END IF;
        IF NOT EXISTS (SELECT 1 FROM pg_policy p
                        WHERE p.polrelid = wanted.table_name::regclass
                          AND p.polname = 'wal_tenant_isolation') THEN
            EXECUTE format('CREATE POLICY wal_tenant_isolation ON %I '
                           'USING (tenant = current_setting(%L, true)) '
                           'WITH CHECK (tenant = current_setting(%L, true))',
                           wanted.table_name, 'wal.tenant', 'wal.tenant');
        END IF;
    END LOOP;
END;
$tenancy$;
-- A thread's checkpoints in list order (checkpoint id, then namespace), for LIST_THREAD.
CREATE INDEX IF NOT EXISTS wal_graph_checkpoints_by_position
    ON wal_graph_checkpoints (tenant, task_id, checkpoint_id, checkpoint_ns);
DROP INDEX IF EXISTS wal_graph_checkpoints_by_run;
CREATE INDEX IF NOT EXISTS wal_graph_checkpoints_by_tenant_run
    ON wal_graph_checkpoints (tenant, run_id) WHERE run_id IS NOT NULL;
"""

# ----------------------------------------------------------------------------- appends

# One event of a thread's task, appended under the saver's lease in one statement and one
# commit, as the store appends (queries.APPEND_EVENTS): the head moves only if the epoch,
# head seq and head hash are still the ones the saver holds; the event is inserted only if
# the head moved; no row back means fenced or stale. The chain hash is computed by the saver
# (wal_engine.chain.event_hash). Parameters:
#   $1 task id   $2 epoch   $3 head seq   $4 head hash   $5 new hash
#   $6 event type   $7 version   $8 payload
_APPEND: Final = """
WITH head AS (
    UPDATE wal_tasks SET head_seq = $3 + 1, head_hash = $5, updated_at = now()
     WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
       AND lease_epoch = $2 AND head_seq = $3 AND head_hash = $4
    RETURNING task_id
), appended AS (
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, hash)
    SELECT $1, $3 + 1, $6, $7, $2, $8, $5 FROM head
    RETURNING seq
)"""

# A retention event: no index row.
APPEND_EVENT: Final = _APPEND + """
SELECT seq FROM appended
"""

# A checkpoint and its index row: $9 namespace, $10 checkpoint id, $11 run id, $12 the seqs of
# the events holding its unchanged channel values. A checkpoint put again replaces its row.
APPEND_CHECKPOINT: Final = _APPEND + """, indexed AS (
    INSERT INTO wal_graph_checkpoints (task_id, checkpoint_ns, checkpoint_id, seq, run_id,
                                       ref_seqs)
    SELECT $1, $9, $10, seq, $11, $12::int8[] FROM appended
    ON CONFLICT (tenant, task_id, checkpoint_ns, checkpoint_id)
    DO UPDATE SET seq = EXCLUDED.seq, run_id = EXCLUDED.run_id, ref_seqs = EXCLUDED.ref_seqs
)
SELECT seq FROM appended
"""

# Writes and their index row: $9 namespace, $10 checkpoint id.
APPEND_WRITES: Final = _APPEND + """, indexed AS (
    INSERT INTO wal_graph_writes (task_id, checkpoint_ns, checkpoint_id, seq)
    SELECT $1, $9, $10, seq FROM appended
)
SELECT seq FROM appended
"""

# The same statements storing the chunks of the event's large values too (decision 61),
# under the same fence (only when the head moved); their arrays follow the statement's own
# parameters. Used only when the event has large values.
def _with_blobs(statement: str, first: int) -> str:
    head, found, rest = statement.partition("\n), appended AS (")
    assert found
    return f"""{head}
), blobs AS (
    INSERT INTO wal_blobs (task_id, digest, ordinal, value_bytes, data)
    SELECT head.task_id, b.digest, b.ordinal, b.value_bytes, b.data
      FROM head, unnest(${first}::bytea[], ${first + 1}::int4[], ${first + 2}::int8[],
                        ${first + 3}::bytea[]) AS b(digest, ordinal, value_bytes, data)
    ON CONFLICT DO NOTHING
    RETURNING 1
), appended AS ({rest}"""


WITH_BLOBS: Final = {
    APPEND_EVENT: _with_blobs(APPEND_EVENT, 9),
    APPEND_CHECKPOINT: _with_blobs(APPEND_CHECKPOINT, 13),
    APPEND_WRITES: _with_blobs(APPEND_WRITES, 11),
}

# ----------------------------------------------------------------------------- leases

READ_LEASE: Final = """
SELECT status, lease_epoch, lease_owner, head_seq, head_hash FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""

LOCK_TASK: Final = """
SELECT agent, status, lease_epoch, lease_owner, attempts FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
   FOR UPDATE
"""

LOCK_TASK_FENCED: Final = """
SELECT head_seq, head_hash FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND lease_epoch = $2
   FOR UPDATE
"""

# A takeover of a task still leased by another writer (presumed gone): fence it by bumping
# the epoch and record the orphaning, as wal_break_leases does for expired leases.
ORPHAN_TASK: Final = """
UPDATE wal_tasks SET lease_epoch = $2, lease_owner = NULL, lease_expires_at = NULL
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""

EMIT: Final = "SELECT wal_emit($1, $2, $3::jsonb, $4, $5)"

# The claim itself: the saver's lease has no expiry (a LangGraph thread is written by
# whichever process runs it; a newer writer takes it over, see saver.py), so the engine's
# lease breaker never orphans it and workers never claim it (status RUNNING). The same
# statement maps the task to its thread id ($4), once.
CLAIM_TASK: Final = """
WITH mapped AS (
    INSERT INTO wal_graph_threads (task_id, thread_id) VALUES ($1, $4)
    ON CONFLICT (tenant, task_id) DO NOTHING
)
UPDATE wal_tasks t
   SET lease_epoch = $2, lease_owner = $3, lease_expires_at = NULL, wake_at = NULL,
       waiting_signal = NULL, attempts = t.attempts + 1,
       started_at = coalesce(t.started_at, now())
 WHERE t.tenant = current_setting('wal.tenant', true) AND t.task_id = $1
"""

MAP_THREAD: Final = """
INSERT INTO wal_graph_threads (task_id, thread_id) VALUES ($1, $2)
ON CONFLICT (tenant, task_id) DO NOTHING
"""

# ----------------------------------------------------------------------------- reads

# What every read returns per checkpoint: its row, its event, the events holding the values
# of its unchanged channels (refs) and its writes events, as arrays of (seq, version, payload).
_CHECKPOINT_COLUMNS: Final = """
SELECT c.task_id, c.checkpoint_ns, c.checkpoint_id, c.seq, e.version, e.payload,
       ARRAY(SELECT ROW(r.seq, r.version, r.payload) FROM wal_events r
              WHERE r.tenant = c.tenant AND r.task_id = c.task_id
                AND r.seq = ANY(c.ref_seqs)) AS refs,
       ARRAY(SELECT ROW(we.seq, we.version, we.payload) FROM wal_graph_writes w
               JOIN wal_events we ON we.tenant = w.tenant AND we.task_id = w.task_id
                AND we.seq = w.seq
              WHERE w.tenant = c.tenant AND w.task_id = c.task_id
                AND w.checkpoint_ns = c.checkpoint_ns
                AND w.checkpoint_id = c.checkpoint_id
              ORDER BY w.seq
              LIMIT {writes_limit}) AS writes
  FROM wal_graph_checkpoints c
  JOIN wal_events e ON e.tenant = c.tenant AND e.task_id = c.task_id AND e.seq = c.seq
"""

# The newest checkpoint of a namespace (uuid6 ids sort by time, as LangGraph relies on).
READ_LATEST: Final = _CHECKPOINT_COLUMNS.format(writes_limit="$3") + """
 WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1 AND c.checkpoint_ns = $2
 ORDER BY c.checkpoint_id DESC
 LIMIT 1
"""

READ_BY_ID: Final = _CHECKPOINT_COLUMNS.format(writes_limit="$4") + """
 WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1 AND c.checkpoint_ns = $2
   AND c.checkpoint_id = $3
"""

# Only what a put needs of its parent: the parent's event (values, refs, versions).
READ_PARENT: Final = """
SELECT c.seq, e.version, e.payload
  FROM wal_graph_checkpoints c
  JOIN wal_events e ON e.tenant = c.tenant AND e.task_id = c.task_id AND e.seq = c.seq
 WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1 AND c.checkpoint_ns = $2
   AND c.checkpoint_id = $3
"""

# Pages of a thread, newest first, come in two shapes each: the first page, and a page below
# a bound (the ``before`` config or the last row of the previous page), so that the bound is
# an index condition of the one plan each statement has, with or without statistics (an
# ``$n IS NULL OR ...`` bound is only a filter: every page would scan the pages before it).
# $n metadata filter: checkpoints whose metadata contains it (not an index condition).

# A page of one namespace: the primary key read backwards.
LIST_NAMESPACE: Final = _CHECKPOINT_COLUMNS.format(writes_limit="$5") + """
 WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1 AND c.checkpoint_ns = $2
   AND ($3::jsonb IS NULL OR convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' @> $3::jsonb)
 ORDER BY c.checkpoint_id DESC
 LIMIT $4
"""

# The same below checkpoint id $3.
LIST_NAMESPACE_BELOW: Final = _CHECKPOINT_COLUMNS.format(writes_limit="$6") + """
 WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1 AND c.checkpoint_ns = $2
   AND c.checkpoint_id < $3
   AND ($4::jsonb IS NULL OR convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' @> $4::jsonb)
 ORDER BY c.checkpoint_id DESC
 LIMIT $5
"""

# A page of every namespace of a thread: wal_graph_checkpoints_by_position read backwards.
LIST_THREAD: Final = _CHECKPOINT_COLUMNS.format(writes_limit="$4") + """
 WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1
   AND ($2::jsonb IS NULL OR convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' @> $2::jsonb)
 ORDER BY c.checkpoint_id DESC, c.checkpoint_ns DESC
 LIMIT $3
"""

# The same below position ($2 id, $3 namespace); ``before`` is the position (its id, '').
LIST_THREAD_BELOW: Final = _CHECKPOINT_COLUMNS.format(writes_limit="$6") + """
 WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1
   AND (c.checkpoint_id, c.checkpoint_ns) < ($2, $3::text)
   AND ($4::jsonb IS NULL OR convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' @> $4::jsonb)
 ORDER BY c.checkpoint_id DESC, c.checkpoint_ns DESC
 LIMIT $5
"""

# A page across every thread (``list(None, ...)``); cursor ($3 id, $4 task, $5 namespace).
LIST_ALL: Final = _CHECKPOINT_COLUMNS.format(writes_limit="$7") + """
 WHERE c.tenant = current_setting('wal.tenant', true)
   AND ($1::text IS NULL OR c.checkpoint_id < $1)
   AND ($2::jsonb IS NULL OR convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' @> $2::jsonb)
   AND ($3::text IS NULL
        OR (c.checkpoint_id, c.task_id, c.checkpoint_ns) < ($3, $4::text, $5::text))
 ORDER BY c.checkpoint_id DESC, c.task_id DESC, c.checkpoint_ns DESC
 LIMIT $6
"""

# The writes events of parent checkpoints ($3 ids) of one namespace: the pending sends of
# checkpoints older than format 4 (see reading.migrate_sends). $4 bounds the events read.
PARENT_WRITES: Final = """
SELECT w.checkpoint_id, we.seq, we.version, we.payload
  FROM wal_graph_writes w
  JOIN wal_events we ON we.tenant = w.tenant AND we.task_id = w.task_id AND we.seq = w.seq
 WHERE w.tenant = current_setting('wal.tenant', true) AND w.task_id = $1
   AND w.checkpoint_ns = $2 AND w.checkpoint_id = ANY($3::text[])
 ORDER BY w.seq
 LIMIT $4
"""

THREAD_IDS: Final = """
SELECT task_id, thread_id FROM wal_graph_threads
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = ANY($1::text[])
"""

# ----------------------------------------------------------------------------- retention

THREAD_COUNTS: Final = """
SELECT (SELECT count(*) FROM wal_graph_checkpoints
         WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1) AS checkpoints,
       (SELECT count(*) FROM wal_graph_writes
         WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1) AS writes
"""

LATEST_PER_NAMESPACE: Final = """
SELECT DISTINCT ON (checkpoint_ns) checkpoint_ns, checkpoint_id, seq
  FROM wal_graph_checkpoints
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
 ORDER BY checkpoint_ns, checkpoint_id DESC
 LIMIT $2
"""

DELETE_THREAD_ROWS: Final = """
WITH checkpoints AS (
    DELETE FROM wal_graph_checkpoints
     WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND seq < $2
    RETURNING 1
), writes AS (
    DELETE FROM wal_graph_writes
     WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND seq < $2
)
SELECT count(*) AS removed FROM checkpoints
"""

# keep_latest: every checkpoint but the kept ($3 namespaces, $4 ids) goes, with its writes.
PRUNE_ROWS: Final = """
WITH removed AS (
    DELETE FROM wal_graph_checkpoints c
     WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1 AND c.seq < $2
       AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::text[]) AS k(ns, id)
                        WHERE k.ns = c.checkpoint_ns AND k.id = c.checkpoint_id)
    RETURNING c.checkpoint_ns, c.checkpoint_id
), writes AS (
    DELETE FROM wal_graph_writes w USING removed r
     WHERE w.tenant = current_setting('wal.tenant', true) AND w.task_id = $1
       AND w.checkpoint_ns = r.checkpoint_ns AND w.checkpoint_id = r.checkpoint_id
)
SELECT count(*) AS removed FROM removed
"""

RUN_TASKS: Final = """
SELECT DISTINCT task_id FROM wal_graph_checkpoints
 WHERE tenant = current_setting('wal.tenant', true) AND run_id = ANY($1::text[])
 ORDER BY task_id
 LIMIT $2
"""

COUNT_RUN_CHECKPOINTS: Final = """
SELECT count(*) AS checkpoints FROM wal_graph_checkpoints
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1 AND run_id = ANY($2::text[])
"""

DELETE_RUN_ROWS: Final = """
WITH removed AS (
    DELETE FROM wal_graph_checkpoints c
     WHERE c.tenant = current_setting('wal.tenant', true) AND c.task_id = $1 AND c.seq < $2
       AND c.run_id = ANY($3::text[])
    RETURNING c.checkpoint_ns, c.checkpoint_id
), writes AS (
    DELETE FROM wal_graph_writes w USING removed r
     WHERE w.tenant = current_setting('wal.tenant', true) AND w.task_id = $1
       AND w.checkpoint_ns = r.checkpoint_ns AND w.checkpoint_id = r.checkpoint_id
)
SELECT count(*) AS removed FROM removed
"""

# ----------------------------------------------------------------------------- rebuild

CLEAR_INDEX: Final = """
WITH checkpoints AS (
    DELETE FROM wal_graph_checkpoints
     WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
)
DELETE FROM wal_graph_writes WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""

INDEX_CHECKPOINT: Final = """
INSERT INTO wal_graph_checkpoints (task_id, checkpoint_ns, checkpoint_id, seq, run_id, ref_seqs)
VALUES ($1, $2, $3, $4, $5, $6::int8[])
ON CONFLICT (tenant, task_id, checkpoint_ns, checkpoint_id)
DO UPDATE SET seq = EXCLUDED.seq, run_id = EXCLUDED.run_id, ref_seqs = EXCLUDED.ref_seqs
"""

INDEX_WRITES: Final = """
INSERT INTO wal_graph_writes (task_id, checkpoint_ns, checkpoint_id, seq) VALUES ($1, $2, $3, $4)
"""

HAS_DELTA_CHANNELS: Final = """
SELECT EXISTS (
    SELECT 1 FROM wal_events e
     WHERE e.tenant = current_setting('wal.tenant', true) AND e.task_id = $1
       AND e.seq = ANY($2::int8[])
       AND convert_from(e.payload, 'UTF8')::jsonb -> 'metadata' ?| ARRAY[
               'counters_since_delta_snapshot', 'delta_writes_versioned']
) AS found
"""
