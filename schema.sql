-- wal-engine schema, version 5. Idempotent: applying it twice changes nothing. Version 2
-- added tenants (a database of version 1 is migrated in place, see "Tenancy" below);
-- version 3 large values (wal_blobs; a database of version 2 is migrated in place);
-- version 4 queues, schedules, limiters, child tasks and retention; version 5 partitions
-- the log's per-task tables by month of task id (section "partitioning", at the end; a
-- database of version 4 is converted in place) and stores a smaller event row (no
-- prev_hash, derived idempotency keys, compressed payloads; decision 71).
--
-- Map of the database side
-- ------------------------
-- wal_schema_version  one row per applied schema version; the engine refuses to run on a
--                     database whose newest version is not the one it was built for.
-- wal_transitions     the legal status moves of the task state machine (DESIGN.md s.3),
--                     the same table as wal_engine/state_machine.py (a test compares them).
-- wal_tasks           one row per task: its status, the head as of its last status move,
--                     its lease (owner, lease_epoch = the fencing token, expiry), wake
--                     time, budget and attempts. Claims, heartbeats and status moves are
--                     one statement on it; observations do not touch it: an append is
--                     fenced by the event it follows (same epoch and hash, not terminal),
--                     because every epoch change is itself an event.
-- wal_events          the write-ahead log. (task_id, seq) primary key, seq contiguous from 1.
--                     Append-only: triggers reject UPDATE, DELETE and TRUNCATE. The payload
--                     is the exact canonical JSON bytes the chain hash covers (bytea), or,
--                     from 256 bytes, a mark byte and a zstd frame of them (decision 71),
--                     so a verifier recomputes every hash from the row and its predecessor's
--                     hash; wal_events_json shows plain payloads as jsonb for SQL audits.
-- wal_snapshots       derived checkpoints (task_id, seq) -> encoded AgentState; can always be
--                     rebuilt from wal_events.
-- wal_snapshot_segments  immutable pieces of the growing collections of snapshots (task_id,
--                     field, ordinal, digest) -> msgpack; shared by the task's snapshots.
-- wal_blobs           large values of events, once per task: (task_id, digest, ordinal) ->
--                     zstd chunk; referenced by digest from the event's payload. Append-only.
-- wal_idempotency     the side-effect gateway: key -> state, result, owner, epoch, times.
-- wal_signals         inbox of signals (webhooks, approvals) for tasks; consumption is
--                     recorded in the log (signal_received events), so rows never change.
-- wal_tenants         one row per tenant: its task count and an optional cap on it
--                     (wal_count_task, a trigger on wal_tasks, keeps and checks it).
-- wal_tenant_roles    login role -> tenant, written by the owner only (wal_engine.security.tenants):
--                     the source of truth of row security for runtime roles.
-- wal_schedules       cron and interval schedules: each tick submits one task (section
--                     "schedules", at the end).
-- wal_queues, wal_queue_changes  queues' limits and their audit (the "queues" section).
-- wal_limiters, wal_limiter_reservations  named rate limits shared by a tenant's workers
--                     and what they granted (section "limiters", at the end).
-- wal_retention_log   one row per retention batch: who removed which finished tasks, when,
--                     into which archive (its sha256) under which anchor (section
--                     "retention", at the end). Append-only.
-- wal_archived_tasks  the tombstone of each archived task: its id, ending, head and every
--                     idempotency key; a task id found here is never created again.
-- Partitions          wal_events, wal_snapshots, wal_snapshot_segments and wal_blobs are
--                     partitioned by RANGE of task_id: <table>_pYYYYMM per month of the
--                     time-ordered ids the engine mints, and <table>_default (section
--                     "partitioning", at the end; decision 70).
--
-- Tenancy
-- -------
-- Every table holding a tenant's data has a `tenant` column, the leading column of its
-- primary and unique keys (integrity checks bypass row security: a key without the tenant
-- would reveal another tenant's task id through a unique violation). The tenant is the
-- setting `wal.tenant`, which the engine sends in the startup packet of each of its
-- connections (docs/architecture.md, decision 23): the column defaults to it (an unset
-- tenant makes an INSERT fail), and, because superusers bypass row security, every
-- statement and function also filters on the tenant itself. Row-level security is
-- enabled AND forced on each table with one policy whose tenant comes from the login role
-- (wal_tenant_roles, decision 35), so for a runtime role the setting can only narrow what
-- it sees to nothing; only roles that could take the owner's rights anyway name their
-- tenant by the setting. NOTIFY payloads carry only
-- the tenant's wake token (wal_wake_token), never a task id.
--
-- Functions
-- ---------
-- wal_event_hash(...)        the chain hash, identical to wal_engine/chain.py:event_hash.
-- wal_check_status_move()    trigger: every status move walks legal transitions only.
-- wal_refuse_change()        trigger: the events table is append-only.
-- wal_emit(...)              append one event written by the database itself (claims,
--                            orphaning, wake-ups) to a task whose row the caller has locked.
-- wal_claim_tasks(...)       claim up to n due tasks in one statement (FOR UPDATE SKIP LOCKED),
--                            within their queues' limits.
-- wal_set_queue(...)         create a queue or change its limits, audited.
-- wal_break_leases(...)      orphan tasks whose lease expired (database clock), NOTIFY.
-- wal_send_signal(...)       put a signal in the inbox; wake the task if it waits for it.
-- wal_cancel_task(...)       cancel from outside: terminal event, epoch bumped (fences).
-- wal_wake_token()           the opaque NOTIFY payload of the current tenant.
-- wal_count_task()           trigger: count a tenant's tasks, refuse one past its cap.
-- wal_add_llm_spend(cost)    add a recorded LLM call's cost to the tenant's spend.
-- wal_trusted_tenant()       the tenant an unmapped session may name by the setting: only
--                            a superuser's, an owner member's or a BYPASSRLS role's.
-- wal_ensure_partitions(...) create the month partitions ahead (the owner's only).
-- wal_partition_blocker(...) why a month's partitions may not be dropped (NULL: they may).
-- wal_drop_empty_partitions() drop the past months that hold no row (the owner's only).
-- wal_save_snapshot(...)     write a snapshot and prune the older ones (one statement).
-- wal_delete_snapshots(task) drop a task's snapshots (derived data).
-- wal_release_key(...)       delete a released idempotency claim. These three run with the
--                            owner's rights so that runtime roles hold no table-level
--                            DELETE (which would let them LOCK a shared table in any mode).
--
-- Engine errors raised in SQL use custom SQLSTATEs (class WE), mapped to Python exceptions in
-- wal_engine/store/sqlstate.py:
--   WE001 illegal status transition (COLUMN = from status, CONSTRAINT = to status)
--   WE002 append-only table changed
--   WE003 head moved backwards / after a terminal status
--   WE004 unknown task
--   WE005 a tenant's cap on its number of tasks is reached (DETAIL = the cap)
--   WE240 unknown limiter (DETAIL = its name)
--   WE009 retention refused: a task is no longer as it was archived (DETAIL = the task id)

CREATE TABLE IF NOT EXISTS wal_schema_version (
    version    integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
-- The sha256 of the schema text last applied, so that a connect skips the DDL (and its
-- table locks) when nothing changed.
ALTER TABLE wal_schema_version ADD COLUMN IF NOT EXISTS checksum text;

CREATE TABLE IF NOT EXISTS wal_transitions (
    from_status text NOT NULL,
    to_status   text NOT NULL,
    PRIMARY KEY (from_status, to_status)
);

INSERT INTO wal_transitions (from_status, to_status) VALUES
    ('QUEUED', 'RUNNING'),
    ('RUNNING', 'CHECKPOINTED'),
    ('CHECKPOINTED', 'RUNNING'),
    ('RUNNING', 'WAITING'),
    ('CHECKPOINTED', 'WAITING'),
    ('WAITING', 'RESUMING'),
    ('RUNNING', 'RESUMING'),
    ('CHECKPOINTED', 'RESUMING'),
    ('RESUMING', 'RUNNING'),
    ('RUNNING', 'COMPLETED'),
    ('CHECKPOINTED', 'COMPLETED'),
    ('QUEUED', 'FAILED'),
    ('RUNNING', 'FAILED'),
    ('CHECKPOINTED', 'FAILED'),
    ('WAITING', 'FAILED'),
    ('RESUMING', 'FAILED')
ON CONFLICT DO NOTHING;

CREATE TABLE IF NOT EXISTS wal_tasks (
    tenant           text NOT NULL DEFAULT current_setting('wal.tenant')
                     CONSTRAINT wal_tasks_tenant_format CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    task_id          text NOT NULL CHECK (task_id ~ '^[A-Za-z0-9_.:-]{1,128}$'),
    agent            text NOT NULL CHECK (length(agent) BETWEEN 1 AND 200),
    status           text NOT NULL CHECK (status IN ('QUEUED', 'RUNNING', 'CHECKPOINTED',
                                                     'WAITING', 'RESUMING', 'COMPLETED',
                                                     'FAILED')),
    -- Set by a statement that records several moves at once; the trigger checks the walk
    -- and clears it, so it is never stored.
    status_path      text[],
    -- The head as of the task's last status move (claims, checkpoints, waits, endings).
    -- Observations append to wal_events only; the log's last event is the true head.
    head_seq         bigint NOT NULL CHECK (head_seq >= 0),
    head_hash        bytea NOT NULL CHECK (octet_length(head_hash) = 32),
    lease_owner      text,
    lease_epoch      bigint NOT NULL DEFAULT 0 CHECK (lease_epoch >= 0),
    lease_expires_at timestamptz,
    wake_at          timestamptz,
    waiting_signal   text,
    budget           jsonb NOT NULL DEFAULT '{}',
    parent_task_id   text,
    parent_seq       bigint,
    attempts         integer NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wal_tasks_pkey PRIMARY KEY (tenant, task_id)
);
-- The version of the agent code that started the task (task_submitted), or pinned by the
-- first claim when the submitter had no code for the agent: a worker claims only tasks of
-- the versions it can run, so old and new code coexist during a rolling deploy.
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS agent_version text
    CHECK (agent_version IS NULL OR length(agent_version) BETWEEN 1 AND 64);


CREATE TABLE IF NOT EXISTS wal_events (
    -- No CHECK constraints on this table (docs/architecture.md, decision 28): PostgreSQL
    -- rebuilds a table's check expressions at every statement that inserts into it, which
    -- cost 30-40 µs per append whatever the checks were (measured), on every append. What
    -- they checked holds by construction: an event is accepted only after its predecessor
    -- (seq - 1, same epoch and hash, same tenant; seq 1 comes with its task row, whose
    -- tenant format is checked), the engine writes sha256 hashes and its own vocabulary,
    -- and `verify` recomputes every hash and seq from the rows.
    -- Column order (version 5, decision 71): the fixed-width columns first, widest first,
    -- then the variable-length ones with the payload (the only one past 126 bytes, whose
    -- length word is 4-byte aligned) last, so that no column waits for its alignment: 8
    -- bytes less per row than version 4's order. Statements name their columns.
    seq             bigint NOT NULL,
    epoch           bigint NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    version         smallint NOT NULL,
    chain_version   smallint NOT NULL DEFAULT 1,
    tenant          text NOT NULL DEFAULT current_setting('wal.tenant'),
    task_id         text NOT NULL,
    type            text NOT NULL,
    idempotency_key text,
    hash            bytea NOT NULL,
    payload         bytea NOT NULL,
    CONSTRAINT wal_events_pkey PRIMARY KEY (tenant, task_id, seq)
)
PARTITION BY RANGE (task_id);  -- decision 70: section "partitioning", at the end

-- Databases created before decision 28 have them: drop them (by whatever name they got).
DO $no_event_checks$
DECLARE
    found record;
BEGIN
    FOR found IN SELECT conname FROM pg_constraint
                  WHERE conrelid = 'wal_events'::regclass AND contype = 'c'
                    AND conname <> 'wal_events_bounds'  -- decision 39 brought one back
    LOOP
        EXECUTE format('ALTER TABLE wal_events DROP CONSTRAINT %I', found.conname);
    END LOOP;
END
$no_event_checks$;

-- Version 5 (docs/architecture.md, decision 71): an event's previous hash is the hash of
-- the row before it, which `verify` reads anyway; stored again in each row it proved
-- nothing more and cost 33 bytes a row. Dropped from a database of version 4 (a catalog
-- change: its rows are not rewritten).
ALTER TABLE wal_events DROP COLUMN IF EXISTS prev_hash;


CREATE TABLE IF NOT EXISTS wal_snapshots (
    tenant       text NOT NULL DEFAULT current_setting('wal.tenant')
                 CONSTRAINT wal_snapshots_tenant_format CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    task_id      text NOT NULL,
    seq          bigint NOT NULL CHECK (seq >= 1),
    state        bytea NOT NULL,
    state_format smallint NOT NULL DEFAULT 1,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wal_snapshots_pkey PRIMARY KEY (tenant, task_id, seq)
)
PARTITION BY RANGE (task_id);  -- decision 70: section "partitioning", at the end

-- ---- segmented snapshots (replay/snapshot.py, STATE_FORMAT 3 and up) ----------------------
-- The growing collections of a snapshot's state (messages, calls, ...) are stored once per
-- task in immutable segments of a fixed number of items; a snapshot row holds the rest of
-- the state and lists the digests of its segments (wal_snapshots.segments), so that the
-- statement writing a snapshot prunes the segments no kept snapshot refers to. The digest
-- is the sha256 of the field, the ordinal and the bytes. The bytes are zstd-compressed by the
-- writer (format 4), so the column is stored as sent (STORAGE EXTERNAL: no pglz attempt on
-- write, no pglz decompression on read). Derived data, like wal_snapshots:
-- rows are inserted and deleted, never updated (trigger wal_snapshot_segments_immutable).
ALTER TABLE wal_snapshots ADD COLUMN IF NOT EXISTS segments bytea[];

CREATE TABLE IF NOT EXISTS wal_snapshot_segments (
    tenant  text NOT NULL DEFAULT current_setting('wal.tenant')
            CONSTRAINT wal_snapshot_segments_tenant_format CHECK (length(tenant) BETWEEN 1 AND 64),
    task_id text NOT NULL,
    field   text NOT NULL CHECK (length(field) BETWEEN 1 AND 64),
    ordinal integer NOT NULL CHECK (ordinal >= 0),
    digest  bytea NOT NULL CHECK (octet_length(digest) = 32),
    data    bytea NOT NULL,
    CONSTRAINT wal_snapshot_segments_pkey PRIMARY KEY (tenant, task_id, field, ordinal, digest)
)
PARTITION BY RANGE (task_id);  -- decision 70: section "partitioning", at the end

ALTER TABLE wal_snapshot_segments ALTER COLUMN data SET STORAGE EXTERNAL;
-- ---- end of segmented snapshots -----------------------------------------------------------

-- ---- large values (version 3, docs/architecture.md decision 61) -------------------------
-- A user value of an event longer than 64 KiB encoded (a tool result, an LLM response, a
-- message, a task's input, a LangGraph checkpoint's channel values) is stored here once per
-- task under the sha256 of its canonical JSON, in chunks of 1 MiB uncompressed, each one
-- zstd frame compressed by the writer (so STORAGE EXTERNAL: no pglz attempt). The event's
-- row holds {"$blobs": {field: {"bytes": n, "sha256": hex}}} in place of the value, so the
-- chain hash covers the digest and `verify` checks the chunks against it (wal_engine/blobs.py).
-- Chunks are written by the statement that appends their event (one round trip, one
-- commit), fenced like it. Part of the log: rows are never changed nor deleted (triggers
-- below), a task's chunks count against its 4 GiB (wal_count_blob_bytes), and a value
-- holds at most 64 MiB (the engines' payload_bytes_ceiling).
CREATE TABLE IF NOT EXISTS wal_blobs (
    tenant      text NOT NULL DEFAULT current_setting('wal.tenant')
                CONSTRAINT wal_blobs_tenant_format CHECK (length(tenant) BETWEEN 1 AND 64),
    task_id     text NOT NULL,
    digest      bytea NOT NULL,
    ordinal     integer NOT NULL,
    value_bytes bigint NOT NULL,
    data        bytea NOT NULL,
    CONSTRAINT wal_blobs_pkey PRIMARY KEY (tenant, task_id, digest, ordinal),
    -- One check (one expression to rebuild per statement, decision 39): a sha256, a chunk
    -- of a value of 1..64 MiB that starts inside it, a zstd frame of a 1 MiB chunk at most
    -- (its worst-case expansion is far below the 64 KiB of slack).
    CONSTRAINT wal_blobs_bounds CHECK (
        octet_length(digest) = 32
        AND value_bytes BETWEEN 1 AND 67108864
        AND ordinal >= 0 AND ordinal::int8 * 1048576 < value_bytes
        AND octet_length(data) BETWEEN 1 AND 1114112)
)
PARTITION BY RANGE (task_id);  -- decision 70: section "partitioning", at the end
ALTER TABLE wal_blobs ALTER COLUMN data SET STORAGE EXTERNAL;
-- ---- end of large values (the triggers are with the functions below) ---------------------

CREATE TABLE IF NOT EXISTS wal_idempotency (
    tenant       text NOT NULL DEFAULT current_setting('wal.tenant')
                 CONSTRAINT wal_idempotency_tenant_format CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    key          text NOT NULL CHECK (length(key) BETWEEN 1 AND 512),
    task_id      text,
    state        text NOT NULL CHECK (state IN ('running', 'completed', 'failed')),
    owner        text,
    epoch        bigint NOT NULL DEFAULT 0,
    result       bytea,
    error        text,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    completed_at timestamptz,
    CONSTRAINT wal_idempotency_pkey PRIMARY KEY (tenant, key)
);

CREATE TABLE IF NOT EXISTS wal_signals (
    tenant    text NOT NULL DEFAULT current_setting('wal.tenant')
              CONSTRAINT wal_signals_tenant_format CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    signal_id bigserial NOT NULL,
    task_id   text NOT NULL,
    name      text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    payload   bytea NOT NULL,
    dedup_key text,
    sent_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wal_signals_pkey PRIMARY KEY (tenant, signal_id),
    CONSTRAINT wal_signals_dedup UNIQUE (tenant, task_id, dedup_key)
);

CREATE TABLE IF NOT EXISTS wal_tenants (
    tenant    text NOT NULL
              CONSTRAINT wal_tenants_tenant_format CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    -- Tasks ever created (task rows are never deleted), kept by wal_count_task.
    tasks     bigint NOT NULL DEFAULT 0,
    -- The cap an administrator sets (NULL: none); an engine may set a lower one of its
    -- own (the setting wal.tasks_max, sent at connect).
    tasks_max bigint CHECK (tasks_max >= 0),
    CONSTRAINT wal_tenants_pkey PRIMARY KEY (tenant)
);
-- LLM spend of the tenant's tasks (USD, as the LLM calls reported it), added by
-- wal_add_llm_spend after each recorded call, and the administrator's cap on it (NULL:
-- none; an engine may set a lower one of its own, checked before each LLM call).
ALTER TABLE wal_tenants ADD COLUMN IF NOT EXISTS llm_spend_usd numeric NOT NULL DEFAULT 0;
ALTER TABLE wal_tenants ADD COLUMN IF NOT EXISTS llm_spend_max_usd numeric
    CHECK (llm_spend_max_usd >= 0);

-- ------------------------------------------------------------------ tenancy (version 2)
-- A database of version 1 has tables without the tenant: its rows become tenant
-- 'default' (the tenant of an engine connected without one), then the keys are rebuilt
-- with the tenant first. Each step checks what is there, so this runs any number of times.
DO $tenancy$
DECLARE
    wanted record;
BEGIN
    FOR wanted IN
        SELECT * FROM (VALUES
            ('wal_tasks', 'tenant ~ ''^[A-Za-z0-9_.:-]{1,64}$'''),
            ('wal_events', NULL),
            ('wal_snapshots', 'tenant ~ ''^[A-Za-z0-9_.:-]{1,64}$'''),
            ('wal_idempotency', 'tenant ~ ''^[A-Za-z0-9_.:-]{1,64}$'''),
            ('wal_signals', 'tenant ~ ''^[A-Za-z0-9_.:-]{1,64}$''')
        ) AS w(table_name, format_check)
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_attribute a
                        WHERE a.attrelid = wanted.table_name::regclass
                          AND a.attname = 'tenant' AND NOT a.attisdropped) THEN
            EXECUTE format('ALTER TABLE %I ADD COLUMN tenant text NOT NULL DEFAULT %L',
                           wanted.table_name, 'default');
            EXECUTE format('ALTER TABLE %I ALTER COLUMN tenant SET DEFAULT '
                           'current_setting(%L)', wanted.table_name, 'wal.tenant');
            IF wanted.format_check IS NOT NULL THEN  -- wal_events: none (decision 28)
                EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (%s)',
                               wanted.table_name, wanted.table_name || '_tenant_format',
                               wanted.format_check);
            END IF;
        END IF;
    END LOOP;
    FOR wanted IN
        SELECT * FROM (VALUES
            ('wal_tasks', 'wal_tasks_pkey', NULL, 'PRIMARY KEY (tenant, task_id)'),
            ('wal_events', 'wal_events_pkey', NULL, 'PRIMARY KEY (tenant, task_id, seq)'),
            ('wal_snapshots', 'wal_snapshots_pkey', NULL,
             'PRIMARY KEY (tenant, task_id, seq)'),
            ('wal_idempotency', 'wal_idempotency_pkey', NULL, 'PRIMARY KEY (tenant, key)'),
            ('wal_signals', 'wal_signals_pkey', NULL, 'PRIMARY KEY (tenant, signal_id)'),
            ('wal_signals', 'wal_signals_dedup', 'wal_signals_task_id_dedup_key_key',
             'UNIQUE (tenant, task_id, dedup_key)')
        ) AS w(table_name, constraint_name, old_name, definition)
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_constraint c
                        WHERE c.conrelid = wanted.table_name::regclass
                          AND c.conname = wanted.constraint_name
                          AND pg_get_constraintdef(c.oid) = wanted.definition) THEN
            IF wanted.old_name IS NOT NULL THEN
                EXECUTE format('ALTER TABLE %I DROP CONSTRAINT IF EXISTS %I',
                               wanted.table_name, wanted.old_name);
            END IF;
            EXECUTE format('ALTER TABLE %I DROP CONSTRAINT IF EXISTS %I, ADD CONSTRAINT %I %s',
                           wanted.table_name, wanted.constraint_name,
                           wanted.constraint_name, wanted.definition);
        END IF;
    END LOOP;
END;
$tenancy$;

-- ------------------------------------------------------ partitioning (version 5, decision 70)
-- A database of version 4 or older has the log's per-task tables unpartitioned. Each becomes
-- the DEFAULT partition of a new partitioned table of the same name (renamed, not copied:
-- no row is read or written here); the month partitions are then created by
-- wal_ensure_partitions (section "partitioning", at the end), which moves the rows whose ids
-- fall in a month's range out of the default partition. Its triggers and policy are dropped
-- here: the partitioned table's are created below and cloned onto it, and
-- wal_secure_partition gives it the partitions' own. Runs any number of times: a
-- partitioned table is left alone.
DO $partitioned$
DECLARE
    v_table text;
    v_default text;
    v_key text;
    found record;
BEGIN
    FOREACH v_table IN ARRAY ARRAY['wal_events', 'wal_snapshots', 'wal_snapshot_segments',
                                   'wal_blobs'] LOOP
        CONTINUE WHEN (SELECT c.relkind FROM pg_class c WHERE c.oid = v_table::regclass) = 'p';
        v_default := v_table || '_default';
        SELECT pg_get_constraintdef(c.oid) INTO v_key FROM pg_constraint c
         WHERE c.conrelid = v_table::regclass AND c.contype = 'p';
        FOR found IN SELECT t.tgname FROM pg_trigger t
                      WHERE t.tgrelid = v_table::regclass AND NOT t.tgisinternal LOOP
            EXECUTE format('DROP TRIGGER %I ON %I', found.tgname, v_table);
        END LOOP;
        FOR found IN SELECT p.polname FROM pg_policy p WHERE p.polrelid = v_table::regclass LOOP
            EXECUTE format('DROP POLICY %I ON %I', found.polname, v_table);
        END LOOP;
        EXECUTE format('ALTER TABLE %I RENAME TO %I', v_table, v_default);
        EXECUTE format('ALTER INDEX %I RENAME TO %I', v_table || '_pkey', v_default || '_pkey');
        EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                       'INCLUDING STORAGE) PARTITION BY RANGE (task_id)', v_table, v_default);
        EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I %s', v_table, v_table || '_pkey', v_key);
        -- A CHECK added NOT VALID (wal_events_bounds: rows stored before it are not re-read)
        -- is copied as a valid one, which ATTACH would refuse: put back NOT VALID after it.
        FOR found IN SELECT c.conname, pg_get_constraintdef(c.oid) AS definition
                       FROM pg_constraint c
                      WHERE c.conrelid = v_default::regclass AND c.contype = 'c'
                        AND NOT c.convalidated LOOP
            EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', v_table, found.conname);
        END LOOP;
        EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I DEFAULT', v_table, v_default);
        FOR found IN SELECT c.conname, pg_get_constraintdef(c.oid) AS definition
                       FROM pg_constraint c
                      WHERE c.conrelid = v_default::regclass AND c.contype = 'c'
                        AND NOT c.convalidated AND c.coninhcount = 0 LOOP
            EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', v_default, found.conname);
            EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I %s', v_table, found.conname,
                           found.definition);
        END LOOP;
    END LOOP;
END;
$partitioned$;

-- Version 1's indexes had no tenant.
DROP INDEX IF EXISTS wal_tasks_claimable;
DROP INDEX IF EXISTS wal_tasks_waking;
DROP INDEX IF EXISTS wal_tasks_leased;
DROP INDEX IF EXISTS wal_tasks_by_status;
DROP INDEX IF EXISTS wal_signals_by_task;

CREATE INDEX IF NOT EXISTS wal_tasks_claimable_by_tenant ON wal_tasks (tenant, created_at)
    WHERE status IN ('QUEUED', 'RESUMING');
CREATE INDEX IF NOT EXISTS wal_tasks_waking_by_tenant ON wal_tasks (tenant, wake_at)
    WHERE status = 'WAITING';
-- The sweeper's index (expired leases first). It keeps heartbeats from being HOT updates
-- (a renewal changes its key); without it every sweep read every leased task of the
-- tenant, a cost that grew with the workers squared (docs/architecture.md decision 74).
CREATE INDEX IF NOT EXISTS wal_tasks_leased_by_tenant ON wal_tasks (tenant, lease_expires_at)
    WHERE status IN ('RUNNING', 'CHECKPOINTED');
-- Tasks of a status in task id order: the listing with a status filter (`tasks --status`,
-- paged by task id) reads its page from here instead of walking the primary key past
-- every task of other statuses (decision 74; created_at, its third column up to schema
-- version 4, ordered nothing).
DROP INDEX IF EXISTS wal_tasks_by_tenant_status;
CREATE INDEX IF NOT EXISTS wal_tasks_by_tenant_status_id ON wal_tasks (tenant, status, task_id);
CREATE INDEX IF NOT EXISTS wal_signals_by_tenant_task
    ON wal_signals (tenant, task_id, name, signal_id);

-- The task counts of the tenants (recounted here: the engine tables are locked while the
-- schema is applied, so no task is being created).
INSERT INTO wal_tenants AS k (tenant, tasks)
SELECT t.tenant, count(*) FROM wal_tasks t GROUP BY t.tenant
ON CONFLICT (tenant) DO UPDATE SET tasks = EXCLUDED.tasks WHERE k.tasks <> EXCLUDED.tasks;

-- ------------------------------------------------- tenant roles (isolation, issue 16)
-- Each tenant's engines log in as a role of their own (wal_engine.security.tenants provisions it);
-- this table, written only by the owner, maps that login role to its tenant. Row security
-- keys on it through session_user, which no statement of the session can change (SET ROLE
-- changes current_user only, and SECURITY DEFINER functions run as their owner with the
-- caller still the session user), never on a setting the session could SET
-- (docs/architecture.md, decision 35).
CREATE TABLE IF NOT EXISTS wal_tenant_roles (
    role_name  name NOT NULL,
    tenant     text NOT NULL
               CONSTRAINT wal_tenant_roles_tenant_format
               CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    enabled    boolean NOT NULL DEFAULT true,
    created_at timestamptz NOT NULL DEFAULT now(),
    rotated_at timestamptz,
    CONSTRAINT wal_tenant_roles_pkey PRIMARY KEY (role_name),
    CONSTRAINT wal_tenant_roles_one_per_tenant UNIQUE (tenant)
);
-- A runtime role reads its own row only (the list of tenants is the owner's business).
-- Not forced: the owner, and so the SECURITY DEFINER functions, read every row.
ALTER TABLE wal_tenant_roles ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS wal_tenant_roles_own ON wal_tenant_roles;
CREATE POLICY wal_tenant_roles_own ON wal_tenant_roles USING (role_name = session_user);

-- The tenant a session whose login role is mapped to none may name by the setting
-- wal.tenant: only when that role could take the owner's rights anyway (a superuser, a
-- member of the owner of wal_tenant_roles) or bypasses row security anyway (BYPASSRLS):
-- the development and embedded setups, migrations, the test suite. NULL for any other
-- role. A function, not a subquery of the policies: a subquery's plan is started and shut
-- down with every statement even when COALESCE never reaches it (measured: 17 µs per
-- statement), a function call costs nothing until it is called.
CREATE OR REPLACE FUNCTION wal_trusted_tenant() RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF pg_has_role(session_user, (SELECT c.relowner FROM pg_class c
                                   WHERE c.oid = 'wal_tenant_roles'::regclass), 'MEMBER')
       OR EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = session_user AND r.rolbypassrls)
    THEN
        RETURN current_setting('wal.tenant', true);
    END IF;
    RETURN NULL;
END;
$$;

-- Row-level security: enabled and forced (the owner, and so the owner-run SECURITY
-- DEFINER functions and views, are filtered too). The tenant of a session is the one its
-- login role (session_user) is mapped to, while that mapping is enabled; else what
-- wal_trusted_tenant() allows. Any other role sees and writes nothing. The expression is
-- stored parsed (tables and functions by OID), so no search_path can redirect it; its
-- subquery runs once per statement.
DO $policies$
DECLARE
    item text;
    session_tenant text := $tenant$(SELECT coalesce(
        (SELECT m.tenant FROM wal_tenant_roles m
          WHERE m.role_name = session_user AND m.enabled),
        wal_trusted_tenant()))$tenant$;
BEGIN
    FOREACH item IN ARRAY ARRAY['wal_tasks', 'wal_events', 'wal_snapshots',
                                'wal_snapshot_segments', 'wal_idempotency', 'wal_signals',
                                'wal_tenants', 'wal_blobs'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', item);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', item);
        EXECUTE format('DROP POLICY IF EXISTS wal_tenant_isolation ON %I', item);
        EXECUTE format('CREATE POLICY wal_tenant_isolation ON %I '
                       'USING (tenant = %s) WITH CHECK (tenant = %s)',
                       item, session_tenant, session_tenant);
    END LOOP;
END;
$policies$;

-- A payload as jsonb, or NULL when its bytes are not UTF-8 JSON (a row written around the
-- engine; `verify` reports it): one bad row must not break every audit query of a tenant.
CREATE OR REPLACE FUNCTION wal_payload_json(p_payload bytea) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    RETURN convert_from(p_payload, 'UTF8')::jsonb;
EXCEPTION WHEN character_not_in_repertoire OR untranslatable_character
               OR invalid_text_representation OR invalid_parameter_value
               OR program_limit_exceeded THEN
    RETURN NULL;
END;
$$;

-- ------------------------------------------------------------------------------ functions

CREATE OR REPLACE FUNCTION wal_event_hash(
    prev_hash bytea, task_id text, seq bigint, type text, version integer, epoch bigint,
    payload bytea
) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT sha256(prev_hash
                  || convert_to(task_id || E'\n' || seq || E'\n' || type || E'\n'
                                || version || E'\n' || epoch || E'\n', 'UTF8')
                  || payload)
$$;

CREATE OR REPLACE FUNCTION wal_check_status_move() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    current_status text;
    next_status text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        current_status := 'QUEUED';
    ELSE
        current_status := OLD.status;
        IF NEW.head_seq < OLD.head_seq OR NEW.lease_epoch < OLD.lease_epoch THEN
            RAISE EXCEPTION 'task % head or epoch moved backwards', OLD.task_id
                USING ERRCODE = 'WE003';
        END IF;
        IF OLD.status IN ('COMPLETED', 'FAILED') AND NEW.head_seq <> OLD.head_seq THEN
            RAISE EXCEPTION 'task % is terminal (%); nothing may follow', OLD.task_id, OLD.status
                USING ERRCODE = 'WE003';
        END IF;
    END IF;
    FOREACH next_status IN ARRAY coalesce(NEW.status_path, ARRAY[NEW.status]) LOOP
        IF TG_OP = 'INSERT' AND NEW.status_path IS NULL AND next_status = 'QUEUED' THEN
            EXIT;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM wal_transitions
                       WHERE from_status = current_status AND to_status = next_status) THEN
            RAISE EXCEPTION 'illegal transition % -> %', current_status, next_status
                USING ERRCODE = 'WE001', COLUMN = current_status, CONSTRAINT = next_status;
        END IF;
        current_status := next_status;
    END LOOP;
    IF current_status <> NEW.status THEN
        RAISE EXCEPTION 'illegal transition % -> %', current_status, NEW.status
            USING ERRCODE = 'WE001', COLUMN = current_status, CONSTRAINT = NEW.status;
    END IF;
    NEW.status_path := NULL;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER wal_tasks_insert_status
    BEFORE INSERT ON wal_tasks
    FOR EACH ROW EXECUTE FUNCTION wal_check_status_move();

-- The WHEN clause keeps ordinary appends (no status change) free of the trigger's cost.
CREATE OR REPLACE TRIGGER wal_tasks_update_status
    BEFORE UPDATE ON wal_tasks
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR NEW.status_path IS NOT NULL
          OR NEW.head_seq < OLD.head_seq
          OR NEW.lease_epoch < OLD.lease_epoch
          OR (OLD.status IN ('COMPLETED', 'FAILED') AND NEW.head_seq <> OLD.head_seq))
    EXECUTE FUNCTION wal_check_status_move();

CREATE OR REPLACE FUNCTION wal_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    -- The table as the engine names it: a partition's rows are its partitioned table's
    -- (decision 70; the triggers of a partitioned table are cloned onto its partitions).
    v_table text := TG_TABLE_NAME;
    v_copy text;
    v_copied boolean;
BEGIN
    IF TG_OP = 'DELETE' AND TG_LEVEL = 'ROW' THEN
        v_table := coalesce((SELECT c.relname::text FROM pg_class c
                              WHERE c.oid = pg_partition_root(TG_RELID)), TG_TABLE_NAME);
    END IF;
    -- The one exception: rows of a task being archived by wal_retention_remove in this very
    -- transaction (section "retention" at the end: its log row, its tombstone, its flag).
    -- (Nested: OLD.task_id is read only for those tables; the trigger also guards tables
    -- without that column, such as wal_queue_changes, and plpgsql resolves every field
    -- of a condition it evaluates.)
    IF TG_OP = 'DELETE' AND v_table IN ('wal_events', 'wal_blobs', 'wal_signals') THEN
        IF coalesce(current_setting('wal_engine.retention_id', true), '') <> ''
           AND EXISTS (
               SELECT 1 FROM wal_archived_tasks a
                 JOIN wal_retention_log l
                   ON l.tenant = a.tenant AND l.retention_id = a.retention_id
                WHERE a.tenant = OLD.tenant AND a.task_id = OLD.task_id
                  AND l.retention_id::text = current_setting('wal_engine.retention_id', true)
                  AND l.txid = pg_current_xact_id()) THEN
            RETURN OLD;
        END IF;
        -- And a row moved out of the default partition by wal_ensure_partitions into the
        -- month partition it creates (section "partitioning"): passed only when the flag
        -- wal_engine.partition_move names a month table of this one, not yet attached,
        -- holding an identical row. Only the owner can delete from a partition at all.
        v_copy := coalesce(current_setting('wal_engine.partition_move', true), '');
        IF TG_TABLE_NAME = v_table || '_default' AND v_copy ~ ('^' || v_table || '_p[0-9]{6}$')
           AND to_regclass(v_copy) IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = to_regclass(v_copy))
        THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM ONLY %I x WHERE to_jsonb(x) = $1)',
                           v_copy) INTO v_copied USING to_jsonb(OLD);
            IF v_copied THEN
                RETURN OLD;
            END IF;
        END IF;
    END IF;
    RAISE EXCEPTION '% on % is not allowed: the log is append-only', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'WE002';
END;
$$;

CREATE OR REPLACE TRIGGER wal_events_append_only
    BEFORE UPDATE OR DELETE ON wal_events
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_change();

-- Row triggers do not fire on TRUNCATE; a statement trigger is needed as well.
CREATE OR REPLACE TRIGGER wal_events_no_truncate
    BEFORE TRUNCATE ON wal_events
    FOR EACH STATEMENT EXECUTE FUNCTION wal_refuse_change();

CREATE OR REPLACE TRIGGER wal_signals_append_only
    BEFORE UPDATE OR DELETE ON wal_signals
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_change();

CREATE OR REPLACE TRIGGER wal_signals_no_truncate
    BEFORE TRUNCATE ON wal_signals
    FOR EACH STATEMENT EXECUTE FUNCTION wal_refuse_change();

-- Segmented snapshots: a segment never changes (a changed one is a new row, new digest);
-- pruning deletes rows, so only UPDATE is refused.
CREATE OR REPLACE TRIGGER wal_snapshot_segments_immutable
    BEFORE UPDATE ON wal_snapshot_segments
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_change();

-- The payload of every NOTIFY: an opaque token of the current tenant, never a task id
-- (NOTIFY is not filtered by row security, and task ids are chosen by users). A worker
-- wakes on its own tenant's token (wal_engine.runtime.worker computes the same value) and then
-- claims through its tenant's rows.
CREATE OR REPLACE FUNCTION wal_wake_token() RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT left(encode(sha256(convert_to('wal-engine/wake/'
                                         || coalesce(current_setting('wal.tenant', true), ''),
                                         'UTF8')), 'hex'), 32)
$$;

-- Count a tenant's tasks as they are created; refuse one past its cap: the smaller of the
-- administrator's (wal_tenants.tasks_max) and the engine's (the setting wal.tasks_max). The
-- row lock on the tenant's counter orders concurrent submissions of one tenant.
CREATE OR REPLACE FUNCTION wal_count_task() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    counted record;
    engine_cap bigint := nullif(current_setting('wal.tasks_max', true), '')::bigint;
BEGIN
    INSERT INTO wal_tenants AS k (tenant, tasks) VALUES (NEW.tenant, 1)
    ON CONFLICT (tenant) DO UPDATE SET tasks = k.tasks + 1
    RETURNING k.tasks, k.tasks_max INTO counted;
    IF counted.tasks > least(coalesce(counted.tasks_max, engine_cap),
                             coalesce(engine_cap, counted.tasks_max)) THEN
        RAISE EXCEPTION 'tenant % has reached its cap of % tasks', NEW.tenant,
                        least(coalesce(counted.tasks_max, engine_cap),
                              coalesce(engine_cap, counted.tasks_max))
            USING ERRCODE = 'WE005',
                  DETAIL = least(coalesce(counted.tasks_max, engine_cap),
                                 coalesce(engine_cap, counted.tasks_max))::text;
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER wal_tasks_count
    AFTER INSERT ON wal_tasks
    FOR EACH ROW EXECUTE FUNCTION wal_count_task();

-- Add the cost of one recorded LLM call to the current tenant's spend; returns the new
-- total and the administrator's cap. Runs with the owner's rights (the app role may not
-- update wal_tenants); off the append path: once per LLM call, after its result is durable.
CREATE OR REPLACE FUNCTION wal_add_llm_spend(p_cost_usd numeric)
RETURNS TABLE (llm_spend_usd numeric, llm_spend_max_usd numeric)
LANGUAGE plpgsql AS $$
BEGIN
    -- NaN sorts above every number and the infinities lie outside: one range test.
    IF p_cost_usd IS NULL OR NOT (p_cost_usd BETWEEN 0 AND 1000000) THEN
        RAISE EXCEPTION 'an LLM cost must be a finite amount of 0..1000000'
            USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    INSERT INTO wal_tenants AS k (tenant, llm_spend_usd)
    VALUES (current_setting('wal.tenant'), p_cost_usd)
    ON CONFLICT (tenant) DO UPDATE SET llm_spend_usd = k.llm_spend_usd + p_cost_usd
    RETURNING k.llm_spend_usd, k.llm_spend_max_usd;
END;
$$;

-- Append one event written by the database itself to a task the caller has locked FOR
-- UPDATE, without touching the task row: its seq, hash and recorded time. The payload is
-- JSON text built by the caller; its bytes are what is hashed. wal_emit moves the row too;
-- the claim (wal_claim_tasks) writes its events with this and moves the row once
-- (decision 74: one row version per claim instead of three or four).
CREATE OR REPLACE FUNCTION wal_emit_event(
    p_task_id text, p_type text, p_payload jsonb, p_epoch bigint,
    OUT o_seq bigint, OUT o_hash bytea, OUT o_recorded_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    head record;
    body bytea := convert_to(p_payload::text, 'UTF8');
BEGIN
    -- The time of writing, not of the transaction's start: a claim that waited for its
    -- queue's lock (wal_claim_tasks) records when it claimed, so the log's claim and
    -- release events order a queue's slots as they were taken and given back.
    o_recorded_at := clock_timestamp();
    -- The log's last event is the head (the task row's copy is as of its last status
    -- move). A writer racing for the same seq makes the INSERT below fail on the primary
    -- key, which the callers treat as "try again later".
    SELECT e.seq AS head_seq, e.hash AS head_hash INTO head FROM wal_events e
     WHERE e.tenant = my_tenant AND e.task_id = p_task_id ORDER BY e.seq DESC LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown task %', p_task_id USING ERRCODE = 'WE004';
    END IF;
    o_seq := head.head_seq + 1;
    o_hash := wal_event_hash_v2(head.head_hash, p_task_id, o_seq, p_type, 1, p_epoch,
                                o_recorded_at, NULL, body);
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, hash, recorded_at,
                            chain_version)
    VALUES (p_task_id, o_seq, p_type, 1, p_epoch, body, o_hash, o_recorded_at, 2);
END;
$$;

-- Append one event written by the database itself to a task the caller has locked FOR
-- UPDATE (wal_emit_event). Moves the head (and the status, when new_status is not NULL)
-- and returns the new seq.
CREATE OR REPLACE FUNCTION wal_emit(
    p_task_id text, p_type text, p_payload jsonb, p_epoch bigint, p_new_status text
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    written record;
BEGIN
    written := wal_emit_event(p_task_id, p_type, p_payload, p_epoch);
    UPDATE wal_tasks
       SET head_seq = written.o_seq, head_hash = written.o_hash,
           status = coalesce(p_new_status, status),
           status_path = CASE WHEN p_new_status IS NULL THEN NULL ELSE ARRAY[p_new_status] END,
           updated_at = now()
     WHERE tenant = my_tenant AND task_id = p_task_id;
    RETURN written.o_seq;
END;
$$;

-- Claim up to p_limit due tasks for p_worker in one statement: QUEUED, RESUMING, and
-- WAITING tasks whose wake time has come (database clock), of the agents in p_agents (all
-- agents when NULL): a worker never takes a task it has no code for. With p_versions
-- (parallel to p_agents: each pair is an agent and a version this worker's code runs, the
-- first pair of an agent its own version), only tasks of those versions, or of none yet;
-- the claim pins each task to the worker's own version. Bumps each task's lease epoch (the
-- fencing token) and records the claim in the log.
--
-- Queues (issue 24, the "queues" section below): higher priority first, then the oldest.
-- A queue's global limit (wal_queues.concurrency_max) counts its leased tasks (RUNNING,
-- CHECKPOINTED) across every worker; its per-worker limit counts this worker's, which the
-- worker passes in (p_queues, p_queue_running: parallel arrays, its running tasks by queue).
-- A task with a partition key is claimable only when no other live task of its queue and
-- key has started (is leased, waiting or resuming) and, for a QUEUED task, none older is
-- QUEUED. Under READ COMMITTED two claimers counting the same running set could both claim,
-- so the claims that a global limit or a partition constrains are serialised per queue
-- (tenant and queue), by a transaction-scoped advisory lock: never one lock for all, and
-- claims of unconstrained queues take none. Each count and partition check is then made by
-- a statement of its own, after the lock: a VOLATILE function's every statement takes a
-- fresh snapshot, so it sees the previous holder's committed claims. The candidates are
-- pre-filtered by the same rules on the statement's snapshot (so a full queue does not
-- hide the others' tasks) and locked FOR UPDATE SKIP LOCKED as before. Deadlock-free: a
-- claimer waits for a queue lock only while it holds none; it only tries the next ones
-- (pg_try_advisory_xact_lock), skipping a queue whose lock is taken.
-- (Dropped first: CREATE OR REPLACE cannot change a function's result columns.)
DROP FUNCTION IF EXISTS wal_claim_tasks(text, integer, bigint);
DROP FUNCTION IF EXISTS wal_claim_tasks(text, integer, bigint, text[]);
DROP FUNCTION IF EXISTS wal_claim_tasks(text, integer, bigint, text[], text[]);
DROP FUNCTION IF EXISTS wal_claim_tasks(text, integer, bigint, text[], text[], text[], integer[]);
CREATE FUNCTION wal_claim_tasks(p_worker text, p_limit integer, p_lease_ttl_ms bigint,
                                p_agents text[] DEFAULT NULL, p_versions text[] DEFAULT NULL,
                                p_queues text[] DEFAULT NULL,
                                p_queue_running integer[] DEFAULT NULL)
RETURNS TABLE (task_id text, agent text, lease_epoch bigint, head_seq bigint,
               head_hash bytea, attempts integer, started_at timestamptz,
               database_now timestamptz, agent_version text, queue text)
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    due record;
    new_epoch bigint;
    claim_type text;
    claim record;
    candidates refcursor;
    agents text[];
    pinned text;
    claimed integer := 0;
    rounds integer := 0;
    again boolean;
    -- The queues met by this call, as parallel arrays: name, room left under the global
    -- limit and under this worker's (NULL: no such limit), whether this call holds its lock.
    q_names text[] := '{}';
    q_room integer[] := '{}';
    q_worker_room integer[] := '{}';
    q_locked boolean[] := '{}';
    held integer := 0;
    i integer;
    found_limits record;
    closed text[];
    passed text[] := '{}';
BEGIN
    -- Queues without room as this snapshot shows them (only a hint: rechecked under lock).
    SELECT coalesce(array_agg(q.queue), '{}') INTO closed FROM wal_queues q
     WHERE q.tenant = my_tenant
       AND ((q.concurrency_max IS NOT NULL
             AND (SELECT count(*) FROM wal_tasks r
                   WHERE r.tenant = my_tenant AND r.queue = q.queue
                     AND r.status IN ('RUNNING', 'CHECKPOINTED')) >= q.concurrency_max)
            OR (q.worker_concurrency_max IS NOT NULL
                AND coalesce((SELECT sum(w.running) FROM unnest(p_queues, p_queue_running)
                                                      AS w(queue, running)
                               WHERE w.queue = q.queue), 0) >= q.worker_concurrency_max));
    agents := p_agents;
    IF agents IS NULL THEN
        WITH RECURSIVE due_agents(agent) AS (
            SELECT min(t.agent) FROM wal_tasks t
             WHERE t.tenant = my_tenant
               AND (t.status IN ('QUEUED', 'RESUMING')
                    OR (t.status = 'WAITING' AND t.wake_at IS NOT NULL))
            UNION ALL
            SELECT (SELECT min(t.agent) FROM wal_tasks t
                     WHERE t.tenant = my_tenant AND t.agent > d.agent
                       AND (t.status IN ('QUEUED', 'RESUMING')
                            OR (t.status = 'WAITING' AND t.wake_at IS NOT NULL)))
              FROM due_agents d WHERE d.agent IS NOT NULL
        )
        SELECT coalesce(array_agg(d.agent), '{}') INTO agents FROM due_agents d
         WHERE d.agent IS NOT NULL;
    END IF;
    LOOP
        rounds := rounds + 1;
        again := false;
        -- The candidates, in claim order: each agent's first due tasks from
        -- wal_tasks_due_by_agent, in that order, and the first of those taken (decision 74).
        -- A worker names its agents; without them, the agents that have due tasks, one
        -- index probe each (a skip scan of the same index).
        OPEN candidates FOR
        SELECT c.task_id, c.agent, c.status, c.lease_epoch, c.attempts, c.waiting_signal,
               c.agent_version, c.queue, c.partition_key, c.created_at
          FROM (SELECT DISTINCT r.agent FROM unnest(agents) AS r(agent)) AS a
         CROSS JOIN LATERAL (
        SELECT t.task_id, t.agent, t.status, t.lease_epoch, t.attempts, t.waiting_signal,
               t.agent_version, t.queue, t.partition_key, t.created_at, t.priority,
               coalesce(t.wake_at, t.created_at) AS due_at
          FROM wal_tasks t
         WHERE t.tenant = my_tenant AND t.agent = a.agent
           AND (t.status IN ('QUEUED', 'RESUMING')
                OR (t.status = 'WAITING' AND t.wake_at <= now()))
           AND (p_versions IS NULL OR t.agent_version IS NULL
                OR EXISTS (SELECT 1 FROM unnest(p_agents, p_versions) AS r(agent, version)
                            WHERE r.agent = t.agent AND r.version = t.agent_version))
           AND t.queue <> ALL (closed)
           AND t.task_id <> ALL (passed)
           AND (t.partition_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM wal_tasks o
                     WHERE o.tenant = my_tenant AND o.queue = t.queue
                       AND o.partition_key = t.partition_key AND o.task_id <> t.task_id
                       AND (o.status IN ('RUNNING', 'CHECKPOINTED', 'WAITING', 'RESUMING')
                            OR (t.status = 'QUEUED' AND o.status = 'QUEUED'
                                AND (o.created_at, o.task_id) < (t.created_at, t.task_id)))))
         ORDER BY t.priority DESC, coalesce(t.wake_at, t.created_at), t.task_id
         LIMIT p_limit - claimed
           FOR UPDATE OF t SKIP LOCKED) AS c
         ORDER BY c.priority DESC, c.due_at, c.task_id
         LIMIT p_limit - claimed;
        LOOP
            FETCH candidates INTO due;
            EXIT WHEN NOT FOUND;
            i := array_position(q_names, due.queue);
            IF i IS NULL THEN
                SELECT q.concurrency_max, q.worker_concurrency_max INTO found_limits
                  FROM wal_queues q WHERE q.tenant = my_tenant AND q.queue = due.queue;
                q_names := q_names || due.queue;
                q_room := q_room || found_limits.concurrency_max;
                q_worker_room := q_worker_room
                    || (found_limits.worker_concurrency_max
                        - coalesce((SELECT sum(w.running)::integer
                                      FROM unnest(p_queues, p_queue_running) AS w(queue, running)
                                     WHERE w.queue = due.queue), 0));
                q_locked := q_locked || false;
                i := cardinality(q_names);
            END IF;
            IF NOT q_locked[i] AND (q_room[i] IS NOT NULL OR due.partition_key IS NOT NULL) THEN
                IF held = 0 THEN
                    PERFORM pg_advisory_xact_lock(hashtext('wal_engine.queue'),
                                                  hashtext(my_tenant || '/' || due.queue));
                ELSIF NOT pg_try_advisory_xact_lock(hashtext('wal_engine.queue'),
                                                    hashtext(my_tenant || '/' || due.queue)) THEN
                    closed := closed || due.queue;  -- Another claimer is at it: skip it.
                    again := true;
                    EXIT;
                END IF;
                held := held + 1;
                q_locked[i] := true;
                IF q_room[i] IS NOT NULL THEN
                    -- A statement of its own: a snapshot taken after the lock.
                    q_room[i] := q_room[i] - (SELECT count(*) FROM wal_tasks r
                                               WHERE r.tenant = my_tenant AND r.queue = due.queue
                                                 AND r.status IN ('RUNNING', 'CHECKPOINTED'));
                END IF;
            END IF;
            IF q_room[i] <= 0 OR q_worker_room[i] <= 0 THEN
                closed := closed || due.queue;
                again := true;
                EXIT;
            END IF;
            -- Two plain probes, each answered by one partial index (the second only for a
            -- QUEUED task).
            IF due.partition_key IS NOT NULL AND (
                    EXISTS (SELECT 1 FROM wal_tasks o
                             WHERE o.tenant = my_tenant AND o.queue = due.queue
                               AND o.partition_key = due.partition_key
                               AND o.status IN ('RUNNING', 'CHECKPOINTED', 'WAITING', 'RESUMING')
                               AND o.task_id <> due.task_id)
                    OR (due.status = 'QUEUED'
                        AND EXISTS (SELECT 1 FROM wal_tasks o
                                     WHERE o.tenant = my_tenant AND o.queue = due.queue
                                       AND o.partition_key = due.partition_key
                                       AND o.status = 'QUEUED'
                                       AND (o.created_at, o.task_id)
                                           < (due.created_at, due.task_id))))
            THEN
                passed := passed || due.task_id;  -- Its partition moved on since the snapshot.
                again := true;
                CONTINUE;
            END IF;
            q_room[i] := q_room[i] - 1;
            q_worker_room[i] := q_worker_room[i] - 1;
            claimed := claimed + 1;
            new_epoch := due.lease_epoch + 1;
            -- The claiming code's own version: a task continued by newer code that declares the
            -- old version compatible is that code's from now on (its history may hold calls
            -- the old code does not make), so old workers still running never take it back.
            pinned := coalesce((SELECT r.version FROM unnest(p_agents, p_versions)
                                       WITH ORDINALITY AS r(agent, version, n)
                                 WHERE r.agent = due.agent ORDER BY r.n LIMIT 1),
                               due.agent_version);
            -- The events first (a woken task's task_woken, then its claim), then the row
            -- in one UPDATE: its status walk (the trigger checks it), head and lease (one
            -- row version per claim, decision 74; no other transaction sees the row in
            -- between, it is locked FOR UPDATE). The lease runs from the claim as its event
            -- records it, to the microsecond (the process can be descheduled before the
            -- event's clock reading; a sweep must never find a lease broken before TTL
            -- after its claim event).
            IF due.status = 'WAITING' THEN
                PERFORM wal_emit_event(due.task_id, 'task_woken',
                                       jsonb_build_object('reason',
                                                          CASE WHEN due.waiting_signal IS NULL
                                                               THEN 'timer' ELSE 'timeout' END),
                                       due.lease_epoch);
            END IF;
            claim_type := CASE WHEN due.status = 'QUEUED' THEN 'task_claimed' ELSE 'task_resumed' END;
            claim := wal_emit_event(due.task_id, claim_type,
                                    jsonb_strip_nulls(jsonb_build_object(
                                        'worker_id', p_worker, 'attempt', due.attempts + 1,
                                        'agent_version', pinned)),
                                    new_epoch);
            UPDATE wal_tasks t
               SET head_seq = claim.o_seq, head_hash = claim.o_hash, status = 'RUNNING',
                   status_path = CASE WHEN due.status = 'WAITING'
                                      THEN ARRAY['RESUMING', 'RUNNING'] ELSE ARRAY['RUNNING'] END,
                   updated_at = now(),
                   lease_epoch = new_epoch, lease_owner = p_worker,
                   lease_expires_at = claim.o_recorded_at
                                      + make_interval(secs => p_lease_ttl_ms / 1000.0),
                   wake_at = NULL, waiting_signal = NULL, attempts = due.attempts + 1,
                   started_at = coalesce(t.started_at, now()), agent_version = pinned
             WHERE t.tenant = my_tenant AND t.task_id = due.task_id;
            RETURN QUERY SELECT t.task_id, t.agent, t.lease_epoch, t.head_seq, t.head_hash,
                                t.attempts, t.started_at, now(), t.agent_version, t.queue
                           FROM wal_tasks t WHERE t.tenant = my_tenant AND t.task_id = due.task_id;
        END LOOP;
        CLOSE candidates;
        -- Another round only when this one stopped short for a queue or a partition (each
        -- round closes a queue or passes a task, and there are at most 8 rounds).
        EXIT WHEN NOT again OR claimed >= p_limit OR rounds >= 8;
    END LOOP;
END;
$$;

-- Orphan up to p_limit tasks whose lease expired (database clock): record task_orphaned,
-- bump the epoch so the presumed-dead owner is fenced at once, and NOTIFY idle workers.
CREATE OR REPLACE FUNCTION wal_break_leases(p_limit integer)
RETURNS TABLE (task_id text, previous_owner text, previous_epoch bigint)
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    stale record;
BEGIN
    FOR stale IN
        SELECT t.task_id, t.lease_owner, t.lease_epoch
          FROM wal_tasks t
         WHERE t.tenant = my_tenant
           AND t.status IN ('RUNNING', 'CHECKPOINTED') AND t.lease_expires_at < now()
         ORDER BY t.lease_expires_at
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    LOOP
        BEGIN
            UPDATE wal_tasks t
               SET lease_epoch = stale.lease_epoch + 1, lease_owner = NULL,
                   lease_expires_at = NULL
             WHERE t.tenant = my_tenant AND t.task_id = stale.task_id;
            PERFORM wal_emit(stale.task_id, 'task_orphaned',
                             jsonb_build_object('previous_owner', stale.lease_owner,
                                                'previous_epoch', stale.lease_epoch),
                             stale.lease_epoch + 1, 'RESUMING');
        EXCEPTION WHEN unique_violation THEN
            -- The presumed-dead owner appended at that very moment: it is alive after
            -- all. Leave the task alone; if its lease stays expired, the next sweep takes it.
            CONTINUE;
        END;
        PERFORM pg_notify('wal_engine_wake', wal_wake_token());
        RETURN QUERY SELECT stale.task_id, stale.lease_owner, stale.lease_epoch;
    END LOOP;
END;
$$;

-- Put a signal in a task's inbox (deduplicated on p_dedup_key when given). If the task is
-- WAITING for this signal name it becomes RESUMING at once and idle workers are woken.
-- Returns the signal id (the existing one for a duplicate).
CREATE OR REPLACE FUNCTION wal_send_signal(
    p_task_id text, p_name text, p_payload bytea, p_dedup_key text
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    task record;
    new_id bigint;
BEGIN
    PERFORM wal_check_signal(p_name, p_payload, p_dedup_key);  -- caps: issue 16 section
    SELECT t.status, t.waiting_signal, t.lease_epoch INTO task
      FROM wal_tasks t WHERE t.tenant = my_tenant AND t.task_id = p_task_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown task %', p_task_id USING ERRCODE = 'WE004';
    END IF;
    INSERT INTO wal_signals (task_id, name, payload, dedup_key)
    VALUES (p_task_id, p_name, p_payload, p_dedup_key)
    ON CONFLICT (tenant, task_id, dedup_key) DO NOTHING
    RETURNING signal_id INTO new_id;
    IF new_id IS NULL THEN
        SELECT s.signal_id INTO new_id FROM wal_signals s
         WHERE s.tenant = my_tenant AND s.task_id = p_task_id AND s.dedup_key = p_dedup_key;
        RETURN new_id;
    END IF;
    PERFORM wal_count_signal(p_task_id, octet_length(p_payload));
    IF task.status = 'WAITING' AND task.waiting_signal = p_name THEN
        UPDATE wal_tasks t SET wake_at = NULL, waiting_signal = NULL
         WHERE t.tenant = my_tenant AND t.task_id = p_task_id;
        PERFORM wal_emit(p_task_id, 'task_woken', jsonb_build_object('reason', 'signal'),
                         task.lease_epoch, 'RESUMING');
        PERFORM pg_notify('wal_engine_wake', wal_wake_token());
    END IF;
    RETURN new_id;
END;
$$;

-- Cancel a task from outside: record task_cancelled (terminal, FAILED), bump the epoch so
-- a worker still running it is fenced at its next append, and NOTIFY. Returns false when
-- the task was already terminal (nothing written).
CREATE OR REPLACE FUNCTION wal_cancel_task(p_task_id text, p_reason text, p_requested_by text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    task record;
BEGIN
    PERFORM wal_check_cancel_text(p_reason, p_requested_by);  -- caps: issue 16 section
    SELECT t.status, t.lease_epoch INTO task FROM wal_tasks t
     WHERE t.tenant = my_tenant AND t.task_id = p_task_id
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown task %', p_task_id USING ERRCODE = 'WE004';
    END IF;
    IF task.status IN ('COMPLETED', 'FAILED') THEN
        RETURN false;
    END IF;
    UPDATE wal_tasks t
       SET lease_epoch = task.lease_epoch + 1, lease_owner = NULL, lease_expires_at = NULL,
           wake_at = NULL, waiting_signal = NULL
     WHERE t.tenant = my_tenant AND t.task_id = p_task_id;
    PERFORM wal_emit(p_task_id, 'task_cancelled',
                     jsonb_build_object('reason', p_reason, 'requested_by', p_requested_by),
                     task.lease_epoch + 1, 'FAILED');
    PERFORM pg_notify('wal_engine_done', wal_wake_token());
    RETURN true;
END;
$$;

-- ------------------------------------------- deletions with the owner's rights (issue 16)
-- LOCK TABLE in any mode stronger than ROW EXCLUSIVE needs table-level UPDATE, DELETE or
-- TRUNCATE: a runtime role holding DELETE on a table shared by all tenants could lock it
-- ACCESS EXCLUSIVE and stall every other tenant. So runtime roles hold no table-level
-- DELETE; the three statements that delete run here, as the owner (security.sql makes them
-- SECURITY DEFINER), still filtered to the caller's tenant by the policies.

-- Write a snapshot in one statement (the statement and its reasoning: SAVE_SNAPSHOT's
-- comment in wal_engine/runtime/resume.py): new segments, the row, pruning of older snapshots and
-- of segments no remaining snapshot refers to.
CREATE OR REPLACE FUNCTION wal_save_snapshot(
    p_task_id text, p_seq bigint, p_state bytea, p_state_format smallint, p_keep integer,
    p_digests bytea[], p_fields text[], p_ordinals int4[], p_new_digests bytea[],
    p_data bytea[]
) RETURNS TABLE (inserted bigint, pruned bigint, segments_written bigint,
                 segments_pruned bigint, missing bigint)
LANGUAGE sql AS $$
WITH missing AS (
    SELECT count(*) AS n FROM unnest(p_digests) AS r(digest)
     WHERE r.digest <> ALL (p_new_digests)
       AND NOT EXISTS (SELECT 1 FROM wal_snapshot_segments g
                        WHERE g.tenant = current_setting('wal.tenant', true)
                          AND g.task_id = p_task_id AND g.digest = r.digest)
), segments AS (
    INSERT INTO wal_snapshot_segments (task_id, field, ordinal, digest, data)
    SELECT p_task_id, n.field, n.ordinal, n.digest, n.data
      FROM unnest(p_fields, p_ordinals, p_new_digests, p_data) AS n(field, ordinal, digest, data)
    ON CONFLICT DO NOTHING
    RETURNING 1
), inserted AS (
    INSERT INTO wal_snapshots (task_id, seq, state, state_format, segments)
    SELECT p_task_id, p_seq, p_state, p_state_format, p_digests FROM missing WHERE missing.n = 0
    ON CONFLICT (tenant, task_id, seq) DO NOTHING
    RETURNING seq
), kept AS (
    SELECT s.seq FROM wal_snapshots s
     WHERE s.tenant = current_setting('wal.tenant', true) AND s.task_id = p_task_id
       AND s.seq < p_seq
     ORDER BY s.seq DESC
     LIMIT p_keep - 1
), pruned AS (
    DELETE FROM wal_snapshots s
     WHERE s.tenant = current_setting('wal.tenant', true) AND s.task_id = p_task_id
       AND s.seq < p_seq AND s.seq NOT IN (SELECT k.seq FROM kept k)
       AND (SELECT n FROM missing) = 0
    RETURNING s.seq
), unreferenced AS (
    DELETE FROM wal_snapshot_segments g
     WHERE g.tenant = current_setting('wal.tenant', true) AND g.task_id = p_task_id
       AND (SELECT n FROM missing) = 0
       AND g.digest <> ALL (p_digests)
       AND NOT EXISTS (SELECT 1 FROM wal_snapshots s
                        WHERE s.tenant = current_setting('wal.tenant', true)
                          AND s.task_id = p_task_id AND g.digest = ANY (s.segments)
                          AND s.seq NOT IN (SELECT p.seq FROM pruned p))
    RETURNING 1
)
SELECT (SELECT count(*) FROM inserted), (SELECT count(*) FROM pruned),
       (SELECT count(*) FROM segments), (SELECT count(*) FROM unreferenced),
       (SELECT n FROM missing)
$$;

-- Drop every snapshot of a task (derived data; the next resume folds the whole log).
CREATE OR REPLACE FUNCTION wal_delete_snapshots(p_task_id text) RETURNS void
LANGUAGE sql AS $$
WITH snapshots AS (DELETE FROM wal_snapshots
                    WHERE tenant = current_setting('wal.tenant', true) AND task_id = p_task_id
                    RETURNING 1)
DELETE FROM wal_snapshot_segments
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = p_task_id
$$;

-- Release a running idempotency claim of this owner and epoch (the effect did not act).
CREATE OR REPLACE FUNCTION wal_release_key(p_key text, p_owner text, p_epoch bigint)
RETURNS void
LANGUAGE sql AS $$
DELETE FROM wal_idempotency
 WHERE tenant = current_setting('wal.tenant', true) AND key = p_key AND owner = p_owner
   AND epoch = p_epoch AND state = 'running'
$$;

-- ============================================================ history and caps (issue 16)
-- Chain version 2 (docs/architecture.md, decision 39): the hash also covers recorded_at
-- (microseconds since the Unix epoch) and the idempotency key, each free-text field
-- length-prefixed. Each row carries its version, so a task alive across the upgrade mixes
-- them. The column defaults to 1: the writers of version 2 (the store's statements and
-- wal_emit) name it; the others (forks, the LangGraph saver, loaded fixtures) still write
-- version 1, which verifies as before. (A database created at version 5 or later has it
-- from its CREATE TABLE.)
ALTER TABLE wal_events ADD COLUMN IF NOT EXISTS chain_version smallint NOT NULL DEFAULT 1;

CREATE OR REPLACE FUNCTION wal_event_hash_v2(
    prev_hash bytea, task_id text, seq bigint, type text, version integer, epoch bigint,
    recorded_at timestamptz, idempotency_key text, payload bytea
) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT sha256(prev_hash
                  || convert_to('2' || E'\n' || octet_length(task_id) || ':' || task_id
                                || E'\n' || seq || E'\n' || octet_length(type) || ':' || type
                                || E'\n' || version || E'\n' || epoch || E'\n'
                                || (extract(epoch FROM recorded_at) * 1000000)::bigint
                                || E'\n' || coalesce(octet_length(idempotency_key) || ':'
                                                     || idempotency_key, '-')
                                || E'\n', 'UTF8')
                  || payload)
$$;

-- One CHECK on the log, whoever inserts, with the database's own ceilings (the same
-- numbers as wal_engine/limits.py: events_per_task_ceiling, epoch_max,
-- payload_bytes_ceiling; an engine may set lower caps of its own, checked by its writer):
-- seq in 1..10,000,000, an epoch in 0..2^31-1, a payload of at most 16 MiB, a known chain
-- version. Literals, not functions: a CHECK runs with the inserter's rights. Decision 28
-- dropped the log's checks for their cost; one combined check costs what one check costs
-- (decision 39 has the figures), and without it a direct INSERT as the runtime role could
-- store any seq, epoch or size. NOT VALID: rows already stored are not re-read.
-- Version 5 added chain version 3 (decision 71): a check of version 4 is replaced.
DO $event_bounds$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_constraint
                WHERE conrelid = 'wal_events'::regclass AND conname = 'wal_events_bounds'
                  AND pg_get_constraintdef(oid) NOT LIKE '%ARRAY[1, 2, 3]%') THEN
        ALTER TABLE wal_events DROP CONSTRAINT wal_events_bounds;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                    WHERE conrelid = 'wal_events'::regclass AND conname = 'wal_events_bounds')
    THEN
        ALTER TABLE wal_events ADD CONSTRAINT wal_events_bounds CHECK (
            seq BETWEEN 1 AND 10000000
            AND epoch BETWEEN 0 AND 2147483647
            AND octet_length(payload) <= 16777216
            AND chain_version IN (1, 2, 3)) NOT VALID;
    END IF;
END
$event_bounds$;

-- The idempotency key an event carries, whatever its chain version (decision 71): rows of
-- chain version 3 store '' for no key and for the key of an intent's own position,
-- 'idem:<task>:<seq>' (wal_engine/ids.py), which is derived here; any other key is stored.
CREATE OR REPLACE FUNCTION wal_event_key(
    p_chain_version smallint, p_type text, p_task_id text, p_seq bigint, p_key text
) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_chain_version < 3 OR p_key IS DISTINCT FROM '' THEN p_key
                WHEN p_type IN ('tool_call_intended', 'llm_call_intended')
                    THEN 'idem:' || p_task_id || ':' || p_seq
           END
$$;

-- For SQL audits. The filter is the policy's own tenant (the login role's, else what
-- wal_trusted_tenant() allows): a tenant's role auditing in psql sees its events with no
-- setting (keyed on wal.tenant alone, it saw none), and a superuser, whom row security
-- does not filter, sees the tenant it names by SET wal.tenant and nothing without one.
-- Defined after wal_event_key (version 5). A row stored compressed (decision 71) shows a
-- NULL payload and payload_compressed true here: its content is read through the engine
-- (`wal-engine history --json`, `verify`), which holds the zstd codec.
CREATE OR REPLACE VIEW wal_events_json AS
    SELECT task_id, seq, type, version, epoch,
           wal_payload_json(payload) AS payload,
           wal_event_key(chain_version, type, task_id, seq, idempotency_key)
               AS idempotency_key,
           encode(hash, 'hex') AS hash, recorded_at, tenant,
           substring(payload FROM 1 FOR 1) = '\x01'::bytea AS payload_compressed
    FROM wal_events
    WHERE tenant = (SELECT coalesce(
        (SELECT m.tenant FROM wal_tenant_roles m
          WHERE m.role_name = session_user AND m.enabled),
        wal_trusted_tenant()));

-- Signals: counted per task (on its row, which wal_send_signal locks anyway) and per
-- tenant, count and payload bytes, against the database's caps (the tenant's may be set
-- by an administrator in wal_tenants). Counted from the stored rows once here (the engine
-- tables are locked while the schema is applied).
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS signal_count integer NOT NULL DEFAULT 0;
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS signal_bytes bigint NOT NULL DEFAULT 0;
ALTER TABLE wal_tenants ADD COLUMN IF NOT EXISTS signal_count bigint NOT NULL DEFAULT 0;
ALTER TABLE wal_tenants ADD COLUMN IF NOT EXISTS signal_bytes bigint NOT NULL DEFAULT 0;
ALTER TABLE wal_tenants ADD COLUMN IF NOT EXISTS signals_max bigint CHECK (signals_max >= 0);
ALTER TABLE wal_tenants ADD COLUMN IF NOT EXISTS signal_bytes_max bigint
    CHECK (signal_bytes_max >= 0);

UPDATE wal_tasks t SET signal_count = s.signals, signal_bytes = s.bytes
  FROM (SELECT tenant, task_id, count(*) AS signals, sum(octet_length(payload)) AS bytes
          FROM wal_signals GROUP BY tenant, task_id) AS s
 WHERE t.tenant = s.tenant AND t.task_id = s.task_id
   AND (t.signal_count, t.signal_bytes) IS DISTINCT FROM (s.signals::integer, s.bytes);
UPDATE wal_tenants k SET signal_count = s.signals, signal_bytes = s.bytes
  FROM (SELECT tenant, count(*) AS signals, sum(octet_length(payload)) AS bytes
          FROM wal_signals GROUP BY tenant) AS s
 WHERE k.tenant = s.tenant
   AND (k.signal_count, k.signal_bytes) IS DISTINCT FROM (s.signals, s.bytes);

-- Check one signal before it is stored (22023: bad input; WE008: a cap, DETAIL names it).
CREATE OR REPLACE FUNCTION wal_check_signal(p_name text, p_payload bytea, p_dedup_key text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_name IS NULL OR length(p_name) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'a signal name must be 1..200 characters' USING ERRCODE = '22023';
    END IF;
    IF p_dedup_key IS NOT NULL AND octet_length(p_dedup_key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'a dedup key must be 1..512 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_payload IS NULL OR octet_length(p_payload) > 1024 * 1024 THEN
        RAISE EXCEPTION 'a signal payload holds at most 1 MiB'
            USING ERRCODE = 'WE008', DETAIL = 'signal_payload_bytes';
    END IF;
END;
$$;

-- Count a stored signal against its task's and its tenant's caps; raising undoes the insert.
CREATE OR REPLACE FUNCTION wal_count_signal(p_task_id text, p_bytes bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    counted record;
BEGIN
    UPDATE wal_tasks t SET signal_count = t.signal_count + 1,
                           signal_bytes = t.signal_bytes + p_bytes
     WHERE t.tenant = my_tenant AND t.task_id = p_task_id
    RETURNING t.signal_count, t.signal_bytes INTO counted;
    IF counted.signal_count > 1000 OR counted.signal_bytes > 16 * 1024 * 1024 THEN
        RAISE EXCEPTION 'task % holds its most signals', p_task_id
            USING ERRCODE = 'WE008', DETAIL = 'signals_per_task';
    END IF;
    INSERT INTO wal_tenants AS k (tenant, signal_count, signal_bytes)
    VALUES (my_tenant, 1, p_bytes)
    ON CONFLICT (tenant) DO UPDATE SET signal_count = k.signal_count + 1,
                                       signal_bytes = k.signal_bytes + p_bytes
    RETURNING k.signal_count, k.signal_bytes, k.signals_max, k.signal_bytes_max INTO counted;
    IF counted.signal_count > coalesce(counted.signals_max, 1000000)
       OR counted.signal_bytes > coalesce(counted.signal_bytes_max, 4294967296) THEN
        RAISE EXCEPTION 'tenant % holds its most signals', my_tenant
            USING ERRCODE = 'WE008', DETAIL = 'signals_per_tenant';
    END IF;
END;
$$;

-- The texts of a cancellation (stored in its task_cancelled event).
CREATE OR REPLACE FUNCTION wal_check_cancel_text(p_reason text, p_requested_by text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF octet_length(p_reason) > 4096 OR octet_length(p_requested_by) > 4096 THEN
        RAISE EXCEPTION 'a cancellation reason or requester holds at most 4096 bytes'
            USING ERRCODE = 'WE008', DETAIL = 'cancel_text_bytes';
    END IF;
END;
$$;

-- Budgets are positive: a trigger on INSERT only (the runtime role may not UPDATE the
-- budget column, and a trigger on UPDATE would cost every status move).
CREATE OR REPLACE FUNCTION wal_check_budget() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    item record;
BEGIN
    IF jsonb_typeof(NEW.budget) <> 'object' THEN
        RAISE EXCEPTION 'a budget is an object' USING ERRCODE = '22023';
    END IF;
    FOR item IN SELECT key, value FROM jsonb_each(NEW.budget) LOOP
        IF jsonb_typeof(item.value) <> 'null' AND (jsonb_typeof(item.value) <> 'number'
                                                   OR item.value::numeric <= 0) THEN
            RAISE EXCEPTION 'budget % must be a positive number', item.key
                USING ERRCODE = '22023';
        END IF;
    END LOOP;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER wal_tasks_budget
    BEFORE INSERT ON wal_tasks
    FOR EACH ROW EXECUTE FUNCTION wal_check_budget();
-- ======================================================== end of history and caps (issue 16)

-- (Version 2 is recorded as version 3, below: a database records the newest version
-- applied to it, and a database of version 2 keeps its row.)

-- ================================================================ large values (version 3)
-- Version 3 stores large values in wal_blobs (table above, decision 61). A database of
-- version 2 gets the table, these triggers and the per-task counter when this file is
-- applied (`wal-engine migrate`, or any engine connecting as the owner); its rows need no
-- change: a row without "$blobs" is read as before. An engine of version 2 refuses a
-- database of version 3 (SchemaMismatch), since it would read a value moved to wal_blobs
-- as missing.
CREATE OR REPLACE TRIGGER wal_blobs_append_only
    BEFORE UPDATE OR DELETE ON wal_blobs
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_change();

CREATE OR REPLACE TRIGGER wal_blobs_no_truncate
    BEFORE TRUNCATE ON wal_blobs
    FOR EACH STATEMENT EXECUTE FUNCTION wal_refuse_change();

-- Stored (compressed) bytes of the task's large values, kept by wal_count_blob_bytes.
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS blob_bytes bigint NOT NULL DEFAULT 0;

-- Count the chunks a statement stored against their tasks' 4 GiB (WE008: a cap, DETAIL
-- names it; raising undoes the statement: the event is not appended either). One UPDATE
-- per statement, and only statements that store large values run it. Runs with the
-- owner's rights (security.sql): the app role may not update the counter.
CREATE OR REPLACE FUNCTION wal_count_blob_bytes() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    over text;
BEGIN
    WITH added AS (
        SELECT a.tenant, a.task_id, sum(octet_length(a.data)) AS bytes
          FROM wal_new_blobs a GROUP BY a.tenant, a.task_id
    ), counted AS (
        UPDATE wal_tasks t SET blob_bytes = t.blob_bytes + added.bytes
          FROM added WHERE t.tenant = added.tenant AND t.task_id = added.task_id
        RETURNING t.task_id, t.blob_bytes
    )
    SELECT c.task_id INTO over FROM counted c WHERE c.blob_bytes > 4294967296 LIMIT 1;
    IF over IS NOT NULL THEN
        RAISE EXCEPTION 'task % holds its most large values (4 GiB stored)', over
            USING ERRCODE = 'WE008', DETAIL = 'blob_bytes_per_task';
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER wal_blobs_count
    AFTER INSERT ON wal_blobs
    REFERENCING NEW TABLE AS wal_new_blobs
    FOR EACH STATEMENT EXECUTE FUNCTION wal_count_blob_bytes();

-- The counters of a migrated database (its tables are locked while the schema is applied).
UPDATE wal_tasks t SET blob_bytes = b.bytes
  FROM (SELECT tenant, task_id, sum(octet_length(data)) AS bytes FROM wal_blobs
         GROUP BY tenant, task_id) AS b
 WHERE t.tenant = b.tenant AND t.task_id = b.task_id AND t.blob_bytes <> b.bytes;

INSERT INTO wal_schema_version (version) VALUES (3) ON CONFLICT DO NOTHING;
-- ============================================================ end of large values (version 3)

-- ======================================================================= queues (issue 24)
-- Flow control (docs/architecture.md, decision 66). A task is submitted to a named queue
-- ('default' unless given); the claim (wal_claim_tasks, above) enforces the queue's limits.
-- wal_queues         one row per configured queue of a tenant: its global concurrency limit
--                    (leased tasks across every worker and host) and per-worker limit, NULL
--                    for none. 'default' exists without a row (no limits); a task may be
--                    submitted only to 'default' or a queue with a row (else UnknownQueue).
--                    Written only by wal_set_queue (SECURITY DEFINER); changed at run time,
--                    the next claim applies it.
-- wal_queue_changes  append-only audit of every change of a queue: who (the session's login
--                    role and the caller's own label), when, the limits before and after.
-- wal_tasks columns  queue, priority (higher first, then FIFO), partition_key (tasks of one
--                    key in one queue run one at a time in submission order) and dedup_id
--                    (unique among the live tasks of a queue: wal_tasks_dedup). Set by the
--                    submission, never updated (the runtime role has no UPDATE grant on them).
-- A database of version 3 gets the tables and columns when this file is applied; its tasks
-- are in 'default' with priority 0, which claims them as before.
CREATE TABLE IF NOT EXISTS wal_queues (
    tenant                 text NOT NULL DEFAULT current_setting('wal.tenant')
                           CONSTRAINT wal_queues_tenant_format
                           CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    queue                  text NOT NULL
                           CONSTRAINT wal_queues_name CHECK (queue ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    concurrency_max        integer CONSTRAINT wal_queues_concurrency CHECK (concurrency_max >= 1),
    worker_concurrency_max integer
                           CONSTRAINT wal_queues_worker_concurrency
                           CHECK (worker_concurrency_max >= 1),
    created_at             timestamptz NOT NULL DEFAULT now(),
    updated_at             timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wal_queues_pkey PRIMARY KEY (tenant, queue)
);

CREATE TABLE IF NOT EXISTS wal_queue_changes (
    tenant       text NOT NULL DEFAULT current_setting('wal.tenant'),
    change_id    bigserial NOT NULL,
    queue        text NOT NULL,
    changed_at   timestamptz NOT NULL DEFAULT now(),
    changed_by   name NOT NULL DEFAULT session_user,
    requested_by text CHECK (octet_length(requested_by) <= 256),
    before       jsonb,
    after        jsonb NOT NULL,
    CONSTRAINT wal_queue_changes_pkey PRIMARY KEY (tenant, change_id)
);

CREATE OR REPLACE TRIGGER wal_queue_changes_append_only
    BEFORE UPDATE OR DELETE ON wal_queue_changes
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_change();

CREATE OR REPLACE TRIGGER wal_queue_changes_no_truncate
    BEFORE TRUNCATE ON wal_queue_changes
    FOR EACH STATEMENT EXECUTE FUNCTION wal_refuse_change();

ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS queue text NOT NULL DEFAULT 'default';
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS priority integer NOT NULL DEFAULT 0;
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS partition_key text;
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS dedup_id text;

-- One check for the four (one expression to rebuild per statement, decision 39); the same
-- bounds as wal_engine/store/queues.py, which refuses bad input before anything is sent.
-- NOT VALID: the rows already stored hold the defaults, and are not re-read under the lock.
DO $queue_bounds$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                    WHERE conrelid = 'wal_tasks'::regclass AND conname = 'wal_tasks_queue_bounds')
    THEN
        ALTER TABLE wal_tasks ADD CONSTRAINT wal_tasks_queue_bounds CHECK (
            queue ~ '^[A-Za-z0-9_.:-]{1,64}$'
            AND priority BETWEEN -1000000 AND 1000000
            AND (partition_key IS NULL OR octet_length(partition_key) BETWEEN 1 AND 256)
            AND (dedup_id IS NULL OR octet_length(dedup_id) BETWEEN 1 AND 256)) NOT VALID;
    END IF;
END
$queue_bounds$;

-- A second live task with the same deduplication id in a queue is refused (23505 on this
-- index: DuplicateDedupId); once the first has ended, the id may be used again.
CREATE UNIQUE INDEX IF NOT EXISTS wal_tasks_dedup ON wal_tasks (tenant, queue, dedup_id)
    WHERE dedup_id IS NOT NULL AND status NOT IN ('COMPLETED', 'FAILED');
-- The claim's counts (leased tasks of a queue) and partition checks (live tasks of a key).
CREATE INDEX IF NOT EXISTS wal_tasks_leased_by_queue ON wal_tasks (tenant, queue)
    WHERE status IN ('RUNNING', 'CHECKPOINTED');
CREATE INDEX IF NOT EXISTS wal_tasks_partition_queued
    ON wal_tasks (tenant, queue, partition_key, created_at, task_id)
    WHERE partition_key IS NOT NULL AND status = 'QUEUED';
CREATE INDEX IF NOT EXISTS wal_tasks_partition_started ON wal_tasks (tenant, queue, partition_key)
    WHERE partition_key IS NOT NULL
      AND status IN ('RUNNING', 'CHECKPOINTED', 'WAITING', 'RESUMING');
-- The claim's order (wal_claim_tasks: due tasks by priority, then coalesce(wake_at,
-- created_at), task_id) per agent, as an index, so that a claim reads its first due rows
-- instead of sorting every queued task (with 20,000 queued the claim's scan took 16.3 ms,
-- bitmap of the whole queue and top-N sort, 0.03 ms with an index in that order; issue 23)
-- and reads only its own agents' (decision 74: with the order tenant-wide, a worker whose
-- agents had nothing due read the whole backlog of the other agents at every claim, 47-99
-- ms with 100,000 of theirs queued; kept beside this one, the tenant-wide index still won
-- the plan whenever the statistics had seen one agent only). A WAITING task with a wake
-- time sorts by it, after every due one; one waiting for a signal only is left out.
DROP INDEX IF EXISTS wal_tasks_due_by_tenant;
CREATE INDEX IF NOT EXISTS wal_tasks_due_by_agent
    ON wal_tasks (tenant, agent, priority DESC, (coalesce(wake_at, created_at)), task_id)
    WHERE status IN ('QUEUED', 'RESUMING') OR (status = 'WAITING' AND wake_at IS NOT NULL);

-- Row security: the log's policy (section "tenant policies", at the end).

-- Create a queue or change its limits, and record the change (when there is one) in
-- wal_queue_changes in the same transaction. A NULL limit leaves that limit as it is;
-- p_clear names the limits to remove ('concurrency_max', 'worker_concurrency_max').
-- 22023 for bad input, before anything is written. Runs with the owner's rights
-- (security.sql): the runtime role may not write wal_queues or wal_queue_changes itself.
CREATE OR REPLACE FUNCTION wal_set_queue(p_queue text, p_concurrency_max integer,
                                         p_worker_concurrency_max integer, p_clear text[],
                                         p_requested_by text)
RETURNS TABLE (queue text, concurrency_max integer, worker_concurrency_max integer,
               created boolean, changed boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    old wal_queues%ROWTYPE;
    new_concurrency integer;
    new_worker integer;
    was_new boolean := false;
BEGIN
    IF p_queue IS NULL OR p_queue !~ '^[A-Za-z0-9_.:-]{1,64}$' THEN
        RAISE EXCEPTION 'a queue name is 1..64 of A-Z a-z 0-9 _ . : -' USING ERRCODE = '22023';
    END IF;
    IF p_concurrency_max < 1 OR p_worker_concurrency_max < 1 THEN
        RAISE EXCEPTION 'a queue limit is at least 1' USING ERRCODE = '22023';
    END IF;
    IF NOT coalesce(p_clear, '{}') <@ ARRAY['concurrency_max', 'worker_concurrency_max'] THEN
        RAISE EXCEPTION 'only concurrency_max and worker_concurrency_max can be cleared'
            USING ERRCODE = '22023';
    END IF;
    IF octet_length(p_requested_by) > 256 THEN
        RAISE EXCEPTION 'a requester holds at most 256 bytes' USING ERRCODE = '22023';
    END IF;
    INSERT INTO wal_queues AS q (queue) VALUES (p_queue)
    ON CONFLICT (tenant, queue) DO NOTHING
    RETURNING true INTO was_new;
    SELECT * INTO old FROM wal_queues q
     WHERE q.tenant = my_tenant AND q.queue = p_queue FOR UPDATE;
    new_concurrency := CASE WHEN 'concurrency_max' = ANY (coalesce(p_clear, '{}')) THEN NULL
                            ELSE coalesce(p_concurrency_max, old.concurrency_max) END;
    new_worker := CASE WHEN 'worker_concurrency_max' = ANY (coalesce(p_clear, '{}')) THEN NULL
                       ELSE coalesce(p_worker_concurrency_max, old.worker_concurrency_max) END;
    was_new := coalesce(was_new, false);
    IF was_new OR (new_concurrency, new_worker)
                  IS DISTINCT FROM (old.concurrency_max, old.worker_concurrency_max) THEN
        UPDATE wal_queues q SET concurrency_max = new_concurrency,
                                worker_concurrency_max = new_worker, updated_at = now()
         WHERE q.tenant = my_tenant AND q.queue = p_queue;
        INSERT INTO wal_queue_changes (queue, requested_by, before, after)
        VALUES (p_queue, p_requested_by,
                CASE WHEN was_new THEN NULL
                     ELSE jsonb_build_object('concurrency_max', old.concurrency_max,
                                             'worker_concurrency_max',
                                             old.worker_concurrency_max) END,
                jsonb_build_object('concurrency_max', new_concurrency,
                                   'worker_concurrency_max', new_worker));
        RETURN QUERY SELECT p_queue, new_concurrency, new_worker, was_new, true;
        RETURN;
    END IF;
    RETURN QUERY SELECT p_queue, new_concurrency, new_worker, false, false;
END;
$$;
-- =================================================================== end of queues (issue 24)

-- Worker registrations
-- --------------------
-- wal_workers: one row per worker id and tenant, the agents it serves and when it last
-- said so (at start-up). Advisory only: nothing claims through it; `wal-engine submit`
-- reads it to warn about an agent that no worker has registered recently. Not part of
-- the log, so rows are updated in place. Its policy is the log's (the tenant of the login
-- role, else wal_trusted_tenant()): keyed on the setting alone, a tenant's role could
-- name another tenant and read its agents and worker ids, or forge a registration that
-- silences that tenant's `submit` warning.
CREATE TABLE IF NOT EXISTS wal_workers (
    tenant     text NOT NULL DEFAULT current_setting('wal.tenant'),
    worker_id  text NOT NULL,
    agents     text[] NOT NULL,
    seen_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wal_workers_pkey PRIMARY KEY (tenant, worker_id)
);
-- Row security: the log's policy (applied with the others at the end, "tenant policies").

-- Forget this tenant's worker registrations not renewed for a week. A running worker renews
-- its row hourly and `submit` reads a day back, so a week-old row is of a worker gone for
-- good; worker ids are per process, so without a prune every restart or deploy would leave
-- a row for ever. Called by every registration; runs with the owner's rights (security.sql)
-- so that runtime roles hold no table-level DELETE, and row security keeps it to the
-- caller's own tenant.
CREATE OR REPLACE FUNCTION wal_prune_workers() RETURNS integer
LANGUAGE sql AS $$
WITH pruned AS (DELETE FROM wal_workers
                 WHERE tenant = current_setting('wal.tenant', true)
                   AND seen_at < now() - interval '7 days'
                RETURNING 1)
SELECT count(*)::integer FROM pruned
$$;

-- ============================================================ schedules (issue 24)
-- wal_schedules: one row per schedule and tenant. What it submits (agent; input: the
-- canonical JSON bytes, redacted as a task's input is), when (a cron expression read in
-- time_zone, or every every_s seconds since 1970-01-01 UTC; exactly one), what a worker
-- does with ticks that came while none ran (catch_up: skip, one or all, all at most
-- catch_up_max at once), whether it is paused, and next_tick: the earliest tick not yet
-- fired (NULL: the expression matches no later time). The tick arithmetic is
-- wal_engine/runtime/ticks.py.
--
-- Exactly one task per tick: a worker fires a due schedule in one transaction on its own
-- connection (wal_engine/runtime/schedules.py): it locks the row (FOR UPDATE SKIP LOCKED:
-- other workers pass it by), inserts the tick's task with the id sched:<name>:<tick UTC>
-- (the task's own primary key refuses a second one), and moves next_tick on. A worker
-- that dies before its commit leaves neither the task nor the move; the next one fires
-- the same tick. Migrations lock this table first (EXCLUSIVE, queries.LOCK_ENGINE_TABLES),
-- the order a firing transaction takes its locks in.
--
-- Runtime roles: SELECT, INSERT, and UPDATE of every column but the tenant, the name and
-- created_at (security.sql); a schedule is deleted by wal_delete_schedule only (no
-- table-level DELETE, see "deletions with the owner's rights"). Row security is the
-- log's: the tenant of the login role, else wal_trusted_tenant().
CREATE TABLE IF NOT EXISTS wal_schedules (
    tenant       text NOT NULL DEFAULT current_setting('wal.tenant'),
    name         text NOT NULL CHECK (name ~ '^[A-Za-z0-9_.-]{1,100}$'),
    agent        text NOT NULL CHECK (length(agent) BETWEEN 1 AND 200),
    cron         text CHECK (length(cron) BETWEEN 1 AND 200),
    every_s      bigint CHECK (every_s BETWEEN 1 AND 31622400),
    time_zone    text NOT NULL DEFAULT 'UTC' CHECK (length(time_zone) BETWEEN 1 AND 100),
    input        bytea NOT NULL,
    catch_up     text NOT NULL CHECK (catch_up IN ('skip', 'one', 'all')),
    catch_up_max integer NOT NULL CHECK (catch_up_max BETWEEN 1 AND 1000),
    paused       boolean NOT NULL DEFAULT false,
    next_tick    timestamptz,
    last_tick    timestamptz,
    last_task_id text,
    last_error   text,
    -- Ticks fired (a task submitted, or found already there): with exactly-once ticks,
    -- the number of tasks whose ids name this schedule.
    ticks_fired  bigint NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wal_schedules_pkey PRIMARY KEY (tenant, name),
    CONSTRAINT wal_schedules_one_kind CHECK ((cron IS NULL) <> (every_s IS NULL))
);
CREATE INDEX IF NOT EXISTS wal_schedules_due ON wal_schedules (tenant, next_tick)
    WHERE NOT paused;
-- Row security: the log's policy (applied with the others at the end, "tenant policies").

-- Delete one of this tenant's schedules; whether it existed. Runs with the owner's rights
-- (security.sql) so that runtime roles hold no table-level DELETE; row security keeps it
-- to the caller's tenant. A worker firing the schedule holds its row: the delete waits
-- for that tick's commit.
CREATE OR REPLACE FUNCTION wal_delete_schedule(p_name text) RETURNS boolean
LANGUAGE sql AS $$
WITH deleted AS (DELETE FROM wal_schedules
                  WHERE tenant = current_setting('wal.tenant', true) AND name = p_name
                 RETURNING 1)
SELECT count(*) > 0 FROM deleted
$$;
-- ======================================================== end of schedules (issue 24)

-- ============================================================ child tasks (issue 24)
-- A task may spawn child tasks (ctx.spawn, wal_engine/runtime/children.py). A child is a
-- task whose row names its parent in parent_task_id with parent_seq NULL (a fork names
-- its parent with the seq it was forked at), always in the parent's tenant: it is
-- created on the parent's connection, and its key leads with the tenant. on_parent_end
-- is what happens to the child when its parent ends first: 'cancel' (the default) or
-- 'abandon'; written in the transaction that creates the child.
--
-- wal_task_ended (a trigger on the terminal move of any task, so in the transaction of
-- the terminal append itself):
--  * a child's ending puts the signal '~child:<child id>' (deduplicated on
--    'child:<child id>') in its parent's inbox, waking the parent if it waits for it:
--    no crash can fall between the child's ending and its parent's wake-up;
--  * a parent's ending cancels its children still running whose on_parent_end is
--    'cancel' (wal_cancel_task: terminal event, epoch bumped), which in turn cancels theirs.
--    A child's row locked by another transaction is waited for 25 ms at a time, 20 times
--    at most, a subtransaction each, never longer: the child's own ending holds its row
--    while it waits for the parent's (its wake-up signal), and an unbounded wait here
--    would deadlock; a child still locked after that is ending by itself.
ALTER TABLE wal_tasks ADD COLUMN IF NOT EXISTS on_parent_end text
    CHECK (on_parent_end IN ('cancel', 'abandon'));
CREATE INDEX IF NOT EXISTS wal_tasks_children ON wal_tasks (tenant, parent_task_id)
    WHERE parent_task_id IS NOT NULL AND parent_seq IS NULL;

CREATE OR REPLACE FUNCTION wal_task_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    child record;
    tries integer;
    previous_timeout text := current_setting('lock_timeout');
BEGIN
    IF NEW.parent_task_id IS NOT NULL AND NEW.parent_seq IS NULL THEN
        PERFORM wal_send_signal(
            NEW.parent_task_id, '~child:' || NEW.task_id,
            convert_to(jsonb_build_object('task_id', NEW.task_id, 'status', NEW.status)::text,
                       'UTF8'),
            'child:' || NEW.task_id);
    END IF;
    FOR child IN
        SELECT t.task_id FROM wal_tasks t
         WHERE t.tenant = NEW.tenant AND t.parent_task_id = NEW.task_id
           AND t.parent_seq IS NULL AND t.status NOT IN ('COMPLETED', 'FAILED')
           AND coalesce(t.on_parent_end, 'cancel') = 'cancel'
         ORDER BY t.task_id
         LIMIT 1000
    LOOP
        FOR tries IN 1..20 LOOP
            BEGIN
                -- A setting changed in a subtransaction that fails is undone with it.
                PERFORM set_config('lock_timeout', '25ms', true);
                PERFORM 1 FROM wal_tasks t
                 WHERE t.tenant = NEW.tenant AND t.task_id = child.task_id FOR UPDATE;
                PERFORM set_config('lock_timeout', previous_timeout, true);
                PERFORM wal_cancel_task(child.task_id, 'parent ended', NEW.task_id);
                EXIT;
            EXCEPTION WHEN lock_not_available OR unique_violation THEN
                -- Locked by a claim, a heartbeat or the child's own ending; or its worker
                -- took the next seq at that moment: try again.
                NULL;
            END;
        END LOOP;
    END LOOP;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS wal_task_ended ON wal_tasks;
CREATE TRIGGER wal_task_ended AFTER UPDATE OF status ON wal_tasks
    FOR EACH ROW
    WHEN (NEW.status IN ('COMPLETED', 'FAILED') AND OLD.status NOT IN ('COMPLETED', 'FAILED'))
    EXECUTE FUNCTION wal_task_ended();
-- ======================================================== end of child tasks (issue 24)

-- ============================================================= limiters (issue 24)
-- wal_limiters: named rate limits shared by every worker of a tenant, in requests per
-- period and/or tokens per period (tokens: the recorded input, output, or both, of an
-- LLM call). blocked_until is set by a provider's 429 with Retry-After: no grant before it.
-- wal_limiter_reservations: what a limiter has granted, one row per attempt of a call,
-- keyed by (task, call key): the call key is <call id>:<attempt> for an attempt whose
-- intent is not yet in the log, so a re-run that reaches the same attempt again finds its
-- grant made (no second count); an attempt sent again after a crash left it in doubt is
-- keyed by the new lease epoch too, since the provider may see it twice. tokens holds the
-- estimate until wal_limiter_settle replaces it with the usage the log recorded.
--
-- The window slides: a grant at t counts until t + period_s. wal_limiter_reserve locks the
-- limiter's row (grants of one limiter are serialised), prunes grants older than the
-- window, and either inserts the grant or returns how long until enough capacity leaves
-- the window: one statement, one round trip. A crashed worker's grants stay counted
-- until their window passes (the provider may have seen the call).
--
-- Runtime roles: SELECT, INSERT and UPDATE of the definition columns of wal_limiters (a
-- limiter is defined by engine.limiter); SELECT on the reservations. Grants, settlements,
-- blocks and deletions go through the SECURITY DEFINER functions below (security.sql).
-- Row security is the log's: the tenant of the login role, else wal_trusted_tenant().
-- SQLSTATE WE240: unknown limiter (DETAIL = its name).
CREATE TABLE IF NOT EXISTS wal_limiters (
    tenant              text NOT NULL DEFAULT current_setting('wal.tenant'),
    name                text NOT NULL CHECK (name ~ '^[A-Za-z0-9_.:/-]{1,100}$'),
    requests_per_period bigint CHECK (requests_per_period > 0),
    tokens_per_period   bigint CHECK (tokens_per_period > 0),
    token_kind          text NOT NULL DEFAULT 'both'
                        CHECK (token_kind IN ('input', 'output', 'both')),
    period_s            double precision NOT NULL CHECK (period_s > 0 AND period_s <= 86400),
    blocked_until       timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wal_limiters_pkey PRIMARY KEY (tenant, name),
    CONSTRAINT wal_limiters_some_limit
        CHECK (requests_per_period IS NOT NULL OR tokens_per_period IS NOT NULL)
);
CREATE TABLE IF NOT EXISTS wal_limiter_reservations (
    tenant      text NOT NULL DEFAULT current_setting('wal.tenant'),
    name        text NOT NULL,
    task_id     text NOT NULL,
    call_key    text NOT NULL,
    tokens      bigint NOT NULL CHECK (tokens >= 0),
    settled     boolean NOT NULL DEFAULT false,
    reserved_at timestamptz NOT NULL,
    CONSTRAINT wal_limiter_reservations_pkey PRIMARY KEY (tenant, name, task_id, call_key),
    CONSTRAINT wal_limiter_reservations_limiter FOREIGN KEY (tenant, name)
        REFERENCES wal_limiters (tenant, name) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS wal_limiter_reservations_window
    ON wal_limiter_reservations (tenant, name, reserved_at);
-- Row security: the log's policy (section "tenant policies", at the end).

-- Grant one attempt of a call p_tokens tokens (0 for a limiter of requests only) under
-- p_name, or say how long to wait (granted false, wait_ms > 0). A grant already made
-- under (p_task_id, p_call_key) is granted again without a second count.
CREATE OR REPLACE FUNCTION wal_limiter_reserve(p_name text, p_task_id text, p_call_key text,
                                               p_tokens bigint)
RETURNS TABLE (granted boolean, wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    lim record;
    t timestamptz;
    used_requests bigint;
    used_tokens bigint;
    leaves timestamptz;
    wait_until timestamptz;
BEGIN
    IF p_tokens IS NULL OR p_tokens < 0 THEN
        RAISE EXCEPTION 'a reservation''s tokens must be 0 or more' USING ERRCODE = '22023';
    END IF;
    SELECT * INTO lim FROM wal_limiters
     WHERE tenant = my_tenant AND name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown limiter %', p_name USING ERRCODE = 'WE240', DETAIL = p_name;
    END IF;
    IF lim.tokens_per_period IS NOT NULL AND p_tokens > lim.tokens_per_period THEN
        RAISE EXCEPTION 'an estimate of % tokens exceeds limiter %''s limit of % tokens',
                        p_tokens, p_name, lim.tokens_per_period USING ERRCODE = '22023';
    END IF;
    -- Read after the row lock: a grant committed while this call waited for it is older.
    t := clock_timestamp();
    PERFORM 1 FROM wal_limiter_reservations r
     WHERE r.tenant = my_tenant AND r.name = p_name AND r.task_id = p_task_id
       AND r.call_key = p_call_key AND r.reserved_at > t - make_interval(secs => lim.period_s);
    IF FOUND THEN
        RETURN QUERY SELECT true, 0::bigint;
        RETURN;
    END IF;
    IF lim.blocked_until IS NOT NULL AND lim.blocked_until > t THEN
        RETURN QUERY SELECT false,
            greatest(1, ceil(extract(epoch FROM lim.blocked_until - t) * 1000))::bigint;
        RETURN;
    END IF;
    DELETE FROM wal_limiter_reservations r
     WHERE r.tenant = my_tenant AND r.name = p_name
       AND r.reserved_at <= t - make_interval(secs => lim.period_s);
    SELECT count(*), coalesce(sum(r.tokens), 0) INTO used_requests, used_tokens
      FROM wal_limiter_reservations r WHERE r.tenant = my_tenant AND r.name = p_name;
    wait_until := NULL;
    IF lim.requests_per_period IS NOT NULL AND used_requests + 1 > lim.requests_per_period THEN
        -- The (used - limit + 1)-th oldest grant must leave the window first.
        SELECT r.reserved_at INTO leaves FROM wal_limiter_reservations r
         WHERE r.tenant = my_tenant AND r.name = p_name
         ORDER BY r.reserved_at, r.task_id, r.call_key
         OFFSET used_requests - lim.requests_per_period LIMIT 1;
        wait_until := leaves + make_interval(secs => lim.period_s);
    END IF;
    IF lim.tokens_per_period IS NOT NULL AND used_tokens + p_tokens > lim.tokens_per_period THEN
        -- The oldest grants whose tokens, leaving, make room for p_tokens.
        SELECT w.reserved_at INTO leaves FROM (
            SELECT r.reserved_at, sum(r.tokens) OVER (
                       ORDER BY r.reserved_at, r.task_id, r.call_key
                       ROWS UNBOUNDED PRECEDING) AS freed
              FROM wal_limiter_reservations r
             WHERE r.tenant = my_tenant AND r.name = p_name) w
         WHERE w.freed >= used_tokens + p_tokens - lim.tokens_per_period
         ORDER BY w.reserved_at LIMIT 1;
        wait_until := greatest(wait_until, leaves + make_interval(secs => lim.period_s));
    END IF;
    IF wait_until IS NOT NULL THEN
        RETURN QUERY SELECT false,
            greatest(1, ceil(extract(epoch FROM wait_until - t) * 1000))::bigint;
        RETURN;
    END IF;
    INSERT INTO wal_limiter_reservations (tenant, name, task_id, call_key, tokens, reserved_at)
    VALUES (my_tenant, p_name, p_task_id, p_call_key, p_tokens, t);
    RETURN QUERY SELECT true, 0::bigint;
END;
$$;

-- Replace a grant's estimate with the usage the log recorded for it: the input, output or
-- both tokens, as the limiter counts (idempotent; a grant already out of the window is
-- gone, and nothing is left to settle).
CREATE OR REPLACE FUNCTION wal_limiter_settle(p_name text, p_task_id text, p_call_key text,
                                              p_input bigint, p_output bigint)
RETURNS boolean
LANGUAGE sql AS $$
WITH settled AS (
    UPDATE wal_limiter_reservations r
       SET tokens = CASE l.token_kind WHEN 'input' THEN p_input
                                      WHEN 'output' THEN p_output
                                      ELSE p_input + p_output END,
           settled = true
      FROM wal_limiters l
     WHERE l.tenant = r.tenant AND l.name = r.name
       AND r.tenant = current_setting('wal.tenant', true) AND r.name = p_name
       AND r.task_id = p_task_id AND r.call_key = p_call_key
       AND p_input >= 0 AND p_output >= 0
    RETURNING 1)
SELECT count(*) > 0 FROM settled
$$;

-- A provider answered 429 with Retry-After: grant nothing under p_name for p_seconds
-- (a later block never shortens an earlier one). Returns the blocked-until time.
CREATE OR REPLACE FUNCTION wal_limiter_block(p_name text, p_seconds double precision)
RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    until timestamptz;
BEGIN
    IF p_seconds IS NULL OR NOT (p_seconds BETWEEN 0 AND 86400) THEN
        RAISE EXCEPTION 'a Retry-After must be 0..86400 seconds' USING ERRCODE = '22023';
    END IF;
    UPDATE wal_limiters
       SET blocked_until = greatest(coalesce(blocked_until, '-infinity'::timestamptz),
                                    clock_timestamp() + make_interval(secs => p_seconds)),
           updated_at = now()
     WHERE tenant = current_setting('wal.tenant', true) AND name = p_name
    RETURNING blocked_until INTO until;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown limiter %', p_name USING ERRCODE = 'WE240', DETAIL = p_name;
    END IF;
    RETURN until;
END;
$$;

-- Delete one of this tenant's limiters and its grants; whether it existed.
CREATE OR REPLACE FUNCTION wal_delete_limiter(p_name text) RETURNS boolean
LANGUAGE sql AS $$
WITH deleted AS (DELETE FROM wal_limiters
                  WHERE tenant = current_setting('wal.tenant', true) AND name = p_name
                 RETURNING 1)
SELECT count(*) > 0 FROM deleted
$$;
-- ========================================================= end of limiters (issue 24)

-- ============================================================ schema version 4
-- Version 4 holds what issues 22-24 added to version 3: worker prunes, schedules, child
-- tasks, rate limiters, queues, retention (its section follows). Code of version 3 connecting to a database of version 4 is
-- refused by its version check; code from this version on also refuses to apply its own
-- schema over a newer one (connection.apply_schema), which would put back older functions
-- (a five-parameter wal_claim_tasks beside the queue-aware one).
INSERT INTO wal_schema_version (version) VALUES (4) ON CONFLICT DO NOTHING;
-- ============================================================ schema version 5
-- Version 5 (decision 71) stores less per event: no prev_hash column (dropped from a
-- database of version 4 where the log is defined, above), and rows of chain version 3
-- whose idempotency key is derived (wal_event_key); the log's check admits chain version 3.
INSERT INTO wal_schema_version (version) VALUES (5) ON CONFLICT DO NOTHING;
-- ============================================================ retention (issue 23)
-- Finished tasks older than a policy leave the database through one sanctioned path
-- (docs/architecture.md decision 65; `wal-engine retention run`, wal_engine/audit/retention.py):
-- the task's rows are first written to a verifiable archive outside the database (JSON
-- lines: every event with its chain, its large values, a signed anchor over the heads),
-- read back and verified, and only then removed here, by wal_retention_remove, in one
-- transaction that also writes
--  * wal_retention_log: who (session and current role), when, which tasks, the archive's
--    name and sha256, the anchor's root and signing key;
--  * wal_archived_tasks: one tombstone per task: its id, agent, ending, head and every
--    idempotency key of its events and of wal_idempotency (whose rows are kept: a late
--    call with a key of an archived task still gets its recorded result).
-- A tombstoned task id is never created again: wal_refuse_archived_id (a BEFORE INSERT
-- trigger on wal_tasks) drops the row, so a late duplicate submission finds the id taken
-- (the store then raises TaskArchived) and a schedule's tick finds its task there.
--
-- Why the append-only triggers let these deletes through, and nobody else's: the DELETE
-- branch of wal_refuse_change passes a row of wal_events, wal_blobs or wal_signals only
-- when the transaction-local flag wal_engine.retention_id names a wal_retention_log row
-- written by this same transaction (its txid) and the row's task has a tombstone of that
-- log row. Setting the flag alone proves nothing (any role can set a custom setting):
-- the log and tombstone rows can be inserted by the owner only (no grant to runtime
-- roles), runtime roles hold no DELETE on any of these tables anyway, and the function
-- is not SECURITY DEFINER: it runs with its caller's rights, and only the owner (and
-- superusers) may EXECUTE it (security.sql grants it to nobody). UPDATE and TRUNCATE stay
-- refused for everyone.
CREATE TABLE IF NOT EXISTS wal_retention_log (
    tenant            text NOT NULL DEFAULT current_setting('wal.tenant')
                      CONSTRAINT wal_retention_log_tenant_format
                      CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    retention_id      bigserial NOT NULL,
    txid              xid8 NOT NULL DEFAULT pg_current_xact_id(),
    session_role      text NOT NULL DEFAULT session_user,
    acting_role       text NOT NULL DEFAULT current_user,
    removed_at        timestamptz NOT NULL DEFAULT now(),
    finished_before   timestamptz NOT NULL,
    tasks             integer NOT NULL CHECK (tasks BETWEEN 1 AND 10000),
    task_ids          text[] NOT NULL,
    events            bigint NOT NULL DEFAULT 0,
    archive_name      text NOT NULL CHECK (length(archive_name) BETWEEN 1 AND 1000),
    archive_sha256    bytea NOT NULL CHECK (octet_length(archive_sha256) = 32),
    anchor_root       bytea NOT NULL CHECK (octet_length(anchor_root) = 32),
    anchor_public_key text,
    CONSTRAINT wal_retention_log_pkey PRIMARY KEY (tenant, retention_id)
);
-- The month partitions the batch dropped whole (decision 70; version 5).
ALTER TABLE wal_retention_log ADD COLUMN IF NOT EXISTS partitions_dropped text[] NOT NULL
    DEFAULT '{}';

CREATE TABLE IF NOT EXISTS wal_archived_tasks (
    tenant           text NOT NULL DEFAULT current_setting('wal.tenant')
                     CONSTRAINT wal_archived_tasks_tenant_format
                     CHECK (tenant ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    task_id          text NOT NULL,
    agent            text NOT NULL,
    status           text NOT NULL CHECK (status IN ('COMPLETED', 'FAILED')),
    ending           text NOT NULL,
    head_seq         bigint NOT NULL,
    head_hash        bytea NOT NULL,
    finished_at      timestamptz NOT NULL,
    retention_id     bigint NOT NULL,
    idempotency_keys text[] NOT NULL DEFAULT '{}',
    CONSTRAINT wal_archived_tasks_pkey PRIMARY KEY (tenant, task_id)
);

CREATE OR REPLACE TRIGGER wal_retention_log_append_only
    BEFORE UPDATE OR DELETE ON wal_retention_log
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_change();
CREATE OR REPLACE TRIGGER wal_retention_log_no_truncate
    BEFORE TRUNCATE ON wal_retention_log
    FOR EACH STATEMENT EXECUTE FUNCTION wal_refuse_change();
CREATE OR REPLACE TRIGGER wal_archived_tasks_append_only
    BEFORE UPDATE OR DELETE ON wal_archived_tasks
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_change();
CREATE OR REPLACE TRIGGER wal_archived_tasks_no_truncate
    BEFORE TRUNCATE ON wal_archived_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION wal_refuse_change();

-- Row security: the log's policy (section "tenant policies", at the end).

-- A submission of an archived task id inserts nothing (the row is dropped, so the
-- statement's ON CONFLICT path reads as "the id is taken"); one index probe per new task.
CREATE OR REPLACE FUNCTION wal_refuse_archived_id() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM wal_archived_tasks a
                WHERE a.tenant = NEW.tenant AND a.task_id = NEW.task_id) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER wal_tasks_not_archived
    BEFORE INSERT ON wal_tasks
    FOR EACH ROW EXECUTE FUNCTION wal_refuse_archived_id();

-- Remove archived tasks: p_task_ids with the heads the archive holds. Refuses (WE009, the
-- task id in DETAIL) unless every task is still as archived: finished (COMPLETED or
-- FAILED) before p_finished_before (its ending event's recorded_at), its log ending at
-- the archived seq and hash, no child still running, not the child of a running parent
-- (which may still read its result). Locks the tasks in id order first. Returns the log
-- row's id and the number of events removed. Runs with the caller's rights: the owner's.
CREATE OR REPLACE FUNCTION wal_retention_remove(
    p_task_ids text[], p_head_seqs bigint[], p_head_hashes bytea[], p_finished_before timestamptz,
    p_archive_name text, p_archive_sha256 bytea, p_anchor_root bytea, p_anchor_public_key text)
RETURNS TABLE (retention_id bigint, events bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_tenant text := current_setting('wal.tenant', true);
    v_owner oid := (SELECT c.relowner FROM pg_class c WHERE c.oid = 'wal_events'::regclass);
    v_bad record;
    v_id bigint;
    v_events bigint;
    v_months text[];
    v_month text;
    v_table text;
    v_dropped text[] := '{}';
    v_kept text[];
BEGIN
    IF NOT pg_has_role(current_user, v_owner, 'MEMBER') THEN
        RAISE EXCEPTION 'retention removes tasks as the owner of the log only'
            USING ERRCODE = '42501';
    END IF;
    IF coalesce(v_tenant, '') = '' OR coalesce(cardinality(p_task_ids), 0) NOT BETWEEN 1 AND 10000
       OR cardinality(p_head_seqs) <> cardinality(p_task_ids)
       OR cardinality(p_head_hashes) <> cardinality(p_task_ids) THEN
        RAISE EXCEPTION 'retention needs a tenant and 1..10000 tasks with their heads'
            USING ERRCODE = '22023';
    END IF;
    PERFORM 1 FROM wal_tasks t
     WHERE t.tenant = v_tenant AND t.task_id = ANY (p_task_ids)
     ORDER BY t.task_id FOR UPDATE;
    SELECT a.task_id,
           CASE WHEN t.task_id IS NULL THEN 'is gone'
                WHEN t.status NOT IN ('COMPLETED', 'FAILED') THEN 'is ' || t.status
                WHEN e.seq IS DISTINCT FROM a.seq OR e.hash IS DISTINCT FROM a.hash
                    THEN 'has another head than its archive'
                WHEN e.recorded_at >= p_finished_before THEN 'finished after the cutoff'
                WHEN t.parent_seq IS NULL AND t.parent_task_id IS NOT NULL AND EXISTS (
                    SELECT 1 FROM wal_tasks p
                     WHERE p.tenant = v_tenant AND p.task_id = t.parent_task_id
                       AND p.status NOT IN ('COMPLETED', 'FAILED'))
                    THEN 'has a running parent'
                ELSE 'has a running child' END AS reason
      INTO v_bad
      FROM unnest(p_task_ids, p_head_seqs, p_head_hashes) AS a(task_id, seq, hash)
      LEFT JOIN wal_tasks t ON t.tenant = v_tenant AND t.task_id = a.task_id
      LEFT JOIN LATERAL (SELECT x.seq, x.hash, x.recorded_at FROM wal_events x
                          WHERE x.tenant = v_tenant AND x.task_id = a.task_id
                          ORDER BY x.seq DESC LIMIT 1) AS e ON true
     WHERE t.task_id IS NULL OR t.status NOT IN ('COMPLETED', 'FAILED')
        OR e.seq IS DISTINCT FROM a.seq OR e.hash IS DISTINCT FROM a.hash
        OR e.recorded_at >= p_finished_before
        OR (t.parent_seq IS NULL AND t.parent_task_id IS NOT NULL AND EXISTS (
                SELECT 1 FROM wal_tasks p
                 WHERE p.tenant = v_tenant AND p.task_id = t.parent_task_id
                   AND p.status NOT IN ('COMPLETED', 'FAILED')))
        OR EXISTS (SELECT 1 FROM wal_tasks c
                    WHERE c.tenant = v_tenant AND c.parent_task_id = a.task_id
                      AND c.parent_seq IS NULL AND c.status NOT IN ('COMPLETED', 'FAILED'))
     ORDER BY a.task_id
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'retention refused: task % %', v_bad.task_id, v_bad.reason
            USING ERRCODE = 'WE009', DETAIL = v_bad.task_id;
    END IF;
    SELECT count(*) INTO v_events FROM wal_events x
     WHERE x.tenant = v_tenant AND x.task_id = ANY (p_task_ids);
    -- The month partitions holding this batch's tasks that hold nothing else but archived
    -- tasks, of any tenant (decision 70): dropped whole at the end instead of deleting
    -- their rows. Locked here (only those partitions: archived months), rechecked under
    -- the lock.
    SELECT coalesce(array_agg(DISTINCT substr(x.tableoid::regclass::text,
                                              length('wal_events_p') + 1)), '{}')
      INTO v_months
      FROM wal_events x
     WHERE x.tenant = v_tenant AND x.task_id = ANY (p_task_ids)
       AND x.tableoid::regclass::text ~ '^wal_events_p[0-9]{6}$';
    FOREACH v_month IN ARRAY v_months LOOP
        CONTINUE WHEN wal_partition_blocker(v_month, p_task_ids) IS NOT NULL;
        -- No wait longer than 2 s for a lock from here on (55P03: the batch fails whole,
        -- nothing removed, and is retried).
        PERFORM set_config('lock_timeout', '2s', true);
        FOREACH v_table IN ARRAY wal_partitioned_tables() LOOP
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', v_table || '_p' || v_month);
        END LOOP;
        IF wal_partition_blocker(v_month, p_task_ids) IS NULL THEN
            v_dropped := v_dropped || ('wal_events_p' || v_month);
        END IF;
    END LOOP;
    INSERT INTO wal_retention_log AS l (tenant, finished_before, tasks, task_ids, events,
                                        archive_name, archive_sha256, anchor_root,
                                        anchor_public_key, partitions_dropped)
    VALUES (v_tenant, p_finished_before, cardinality(p_task_ids), p_task_ids, v_events,
            p_archive_name, p_archive_sha256, p_anchor_root, p_anchor_public_key,
            v_dropped)
    RETURNING l.retention_id INTO v_id;
    PERFORM set_config('wal_engine.retention_id', v_id::text, true);
    INSERT INTO wal_archived_tasks (tenant, task_id, agent, status, ending, head_seq,
                                    head_hash, finished_at, retention_id, idempotency_keys)
    SELECT v_tenant, t.task_id, t.agent, t.status, e.type, e.seq, e.hash, e.recorded_at, v_id,
           ARRAY(SELECT k FROM (SELECT wal_event_key(x.chain_version, x.type, x.task_id, x.seq,
                                                     x.idempotency_key) AS k
                                  FROM wal_events x
                                 WHERE x.tenant = v_tenant AND x.task_id = t.task_id
                                   AND wal_event_key(x.chain_version, x.type, x.task_id, x.seq,
                                                     x.idempotency_key) IS NOT NULL
                                UNION
                                SELECT i.key FROM wal_idempotency i
                                 WHERE i.tenant = v_tenant AND i.task_id = t.task_id) AS keys
                  ORDER BY k)
      FROM wal_tasks t
      CROSS JOIN LATERAL (SELECT x.seq, x.hash, x.type, x.recorded_at FROM wal_events x
                           WHERE x.tenant = v_tenant AND x.task_id = t.task_id
                           ORDER BY x.seq DESC LIMIT 1) AS e
     WHERE t.tenant = v_tenant AND t.task_id = ANY (p_task_ids);
    -- The rows in a partition dropped below are left to the drop (the month's partitions
    -- of the four tables hold the same tasks: one range of ids).
    SELECT coalesce(array_agg(DISTINCT x.task_id), '{}') INTO v_kept FROM wal_events x
     WHERE x.tenant = v_tenant AND x.task_id = ANY (p_task_ids)
       AND x.tableoid::regclass::text = ANY (v_dropped);
    DELETE FROM wal_signals s WHERE s.tenant = v_tenant AND s.task_id = ANY (p_task_ids);
    DELETE FROM wal_blobs b WHERE b.tenant = v_tenant AND b.task_id = ANY (p_task_ids)
       AND b.task_id <> ALL (v_kept);
    DELETE FROM wal_snapshot_segments g WHERE g.tenant = v_tenant AND g.task_id = ANY (p_task_ids)
       AND g.task_id <> ALL (v_kept);
    DELETE FROM wal_snapshots n WHERE n.tenant = v_tenant AND n.task_id = ANY (p_task_ids)
       AND n.task_id <> ALL (v_kept);
    DELETE FROM wal_events x WHERE x.tenant = v_tenant AND x.task_id = ANY (p_task_ids)
       AND x.task_id <> ALL (v_kept);
    DELETE FROM wal_tasks t WHERE t.tenant = v_tenant AND t.task_id = ANY (p_task_ids);
    -- Last: dropping a partition locks its partitioned table (every append waits until
    -- this transaction ends), so nothing runs after it but the commit; a lock not had in
    -- 2 s fails the batch whole (55P03, retried: nothing was removed).
    IF cardinality(v_dropped) > 0 THEN
        FOREACH v_month IN ARRAY v_dropped LOOP
            FOREACH v_table IN ARRAY wal_partitioned_tables() LOOP
                EXECUTE format('DROP TABLE %I',
                               v_table || '_p' || substr(v_month, length('wal_events_p') + 1));
            END LOOP;
        END LOOP;
    END IF;
    PERFORM set_config('wal_engine.retention_id', '', true);
    RETURN QUERY SELECT v_id, v_events;
END;
$$;
-- ======================================================== end of retention (issue 23)

-- ============================================================ tenant policies
-- Row security of the tables added after the log's own (worker registrations, schedules,
-- queues, limiters, retention): the same policy as the log's ($policies$ above), enabled
-- and forced, in one place. The whole schema applies in one transaction, so no table is
-- ever visible without it.
DO $more_policies$
DECLARE
    item text;
    session_tenant text := $tenant$(SELECT coalesce(
        (SELECT m.tenant FROM wal_tenant_roles m
          WHERE m.role_name = session_user AND m.enabled),
        wal_trusted_tenant()))$tenant$;
BEGIN
    FOREACH item IN ARRAY ARRAY['wal_workers', 'wal_schedules', 'wal_queues',
                                'wal_queue_changes', 'wal_limiters',
                                'wal_limiter_reservations', 'wal_retention_log',
                                'wal_archived_tasks'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', item);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', item);
        EXECUTE format('DROP POLICY IF EXISTS wal_tenant_isolation ON %I', item);
        EXECUTE format('CREATE POLICY wal_tenant_isolation ON %I '
                       'USING (tenant = %s) WITH CHECK (tenant = %s)',
                       item, session_tenant, session_tenant);
    END LOOP;
END;
$more_policies$;

-- ============================================================ schema version 5
-- Version 5 (docs/architecture.md decision 74, issue 23's scale measurements): a claim
-- moves its task row once (wal_emit_event) and reads its agents' due tasks through
-- wal_tasks_due_by_agent, and the status index is in task id order
-- (wal_tasks_by_tenant_status_id). Applying this text over a version 4 database replaces
-- those indexes and wal_claim_tasks; code of version 4 is refused by its version check.

-- ============================================================ partitioning (version 5)
-- The log's per-task tables (wal_events, wal_snapshots, wal_snapshot_segments, wal_blobs)
-- are partitioned by RANGE of task_id, one partition per calendar month (UTC), named
-- <table>_pYYYYMM, plus a DEFAULT partition <table>_default (docs/architecture.md decision
-- 70, docs/scaling.md "Partitioning"). The ids the engine mints are time-ordered
-- (wal_engine/ids.py new_task_id: "t-" and a UUIDv7's 32 hex digits, the first 12 the
-- milliseconds since 1970), so a month's partition holds the tasks created in that month,
-- all of their rows in the four tables, and every statement naming one task (all of them
-- filter on tenant and task_id equality) touches one partition of each table. Ids a caller
-- chooses land where their text sorts: mostly the default partition.
--   * wal_tasks is not partitioned: one small row per task, and the claim, the sweep and
--     the listings read it across tasks (partitioned by task they would read every
--     partition). wal_signals, wal_idempotency and the rest are small or keyed otherwise
--     (wal_idempotency by key, not by task).
--   * Partitions are created ahead (this month and the next three) by
--     wal_ensure_partitions, the owner's only: run when the schema is applied, at every
--     connect of an owner that migrates, and by `wal-engine retention run`. A month
--     nobody created in time is not lost: its tasks go to the default partition (and
--     when it is created later, wal_ensure_partitions moves them into it).
--   * Each partition has row security enabled with the tables' policy, not forced (the
--     owner reads a partition whole to decide whether retention may drop it), and no
--     privilege for anyone but the owner: the runtime roles reach rows through the
--     partitioned tables only, where the forced policies hold. The row triggers of the
--     partitioned tables are cloned onto every partition; TRUNCATE, a statement trigger,
--     is added to each partition of the append-only tables here.
--   * Retention drops a past month's four partitions whole when every task in them, of
--     every tenant, is archived (wal_retention_remove, section "retention"), instead of
--     deleting their rows; the batch's log row names them (partitions_dropped).

CREATE OR REPLACE FUNCTION wal_partitioned_tables() RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ARRAY['wal_events', 'wal_snapshots', 'wal_snapshot_segments', 'wal_blobs']
$$;

-- The first instant of a UTC month 'YYYYMM' (a timestamp without time zone read as UTC:
-- no session time zone enters).
CREATE OR REPLACE FUNCTION wal_month_start(p_month text) RETURNS timestamp
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT make_timestamp(left(p_month, 4)::integer, right(p_month, 2)::integer, 1, 0, 0, 0)
$$;

-- The first id of a month's range: 't-' and the 12 hex digits of the month's first
-- millisecond; the range ends at the next month's.
CREATE OR REPLACE FUNCTION wal_partition_bound(p_month text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT 't-' || lpad(to_hex((extract(epoch FROM wal_month_start(p_month)) * 1000)::bigint),
                        12, '0')
$$;

CREATE OR REPLACE FUNCTION wal_next_month(p_month text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT to_char(wal_month_start(p_month) + interval '1 month', 'YYYYMM')
$$;

-- A partition's privileges and policies: the owner of its partitioned table, no privilege
-- for anyone else, the tenant policy enabled (not forced), and TRUNCATE refused on the
-- append-only ones.
CREATE OR REPLACE FUNCTION wal_secure_partition(p_partition text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_partition regclass := p_partition::regclass;
    v_parent regclass := (SELECT i.inhparent FROM pg_inherits i WHERE i.inhrelid = v_partition);
    v_owner oid := (SELECT c.relowner FROM pg_class c WHERE c.oid = v_parent);
    session_tenant text := $tenant$(SELECT coalesce(
        (SELECT m.tenant FROM wal_tenant_roles m
          WHERE m.role_name = session_user AND m.enabled),
        wal_trusted_tenant()))$tenant$;
    grantee oid;
BEGIN
    IF (SELECT c.relowner FROM pg_class c WHERE c.oid = v_partition) <> v_owner THEN
        EXECUTE format('ALTER TABLE %I OWNER TO %I', p_partition, pg_get_userbyid(v_owner));
    END IF;
    FOR grantee IN SELECT DISTINCT a.grantee
                     FROM pg_class c, aclexplode(c.relacl) AS a
                    WHERE c.oid = v_partition AND a.grantee <> v_owner LOOP
        IF grantee = 0 THEN
            EXECUTE format('REVOKE ALL ON TABLE %I FROM PUBLIC', p_partition);
        ELSE
            EXECUTE format('REVOKE ALL ON TABLE %I FROM %I', p_partition,
                           pg_get_userbyid(grantee));
        END IF;
    END LOOP;
    EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', p_partition);
    EXECUTE format('ALTER TABLE %I NO FORCE ROW LEVEL SECURITY', p_partition);
    EXECUTE format('DROP POLICY IF EXISTS wal_tenant_isolation ON %I', p_partition);
    EXECUTE format('CREATE POLICY wal_tenant_isolation ON %I '
                   'USING (tenant = %s) WITH CHECK (tenant = %s)',
                   p_partition, session_tenant, session_tenant);
    IF v_parent IN ('wal_events'::regclass, 'wal_blobs'::regclass) THEN
        EXECUTE format('CREATE OR REPLACE TRIGGER %I BEFORE TRUNCATE ON %I '
                       'FOR EACH STATEMENT EXECUTE FUNCTION wal_refuse_change()',
                       p_partition || '_no_truncate', p_partition);
    END IF;
END;
$$;

-- Create the default partitions and the month partitions from p_from's month to
-- p_months_ahead months after it (UTC), those missing; each created partition with the
-- rows it took from the default partition (ids that fell in its month before it existed).
-- The owner's only (nobody is granted EXECUTE; DDL needs the owner's rights anyway).
CREATE OR REPLACE FUNCTION wal_ensure_partitions(p_months_ahead integer DEFAULT 3,
                                                 p_from timestamptz DEFAULT now())
RETURNS TABLE (partition text, rows_moved bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_table text;
    v_default text;
    v_month text;
    v_lo text;
    v_hi text;
    v_any boolean;
    i integer;
BEGIN
    IF p_months_ahead IS NULL OR p_months_ahead NOT BETWEEN 0 AND 120 THEN
        RAISE EXCEPTION 'months ahead must be 0..120' USING ERRCODE = '22023';
    END IF;
    FOREACH v_table IN ARRAY wal_partitioned_tables() LOOP
        CONTINUE WHEN (SELECT c.relkind FROM pg_class c WHERE c.oid = v_table::regclass) <> 'p';
        IF NOT pg_has_role(current_user, (SELECT c.relowner FROM pg_class c
                                           WHERE c.oid = v_table::regclass), 'MEMBER') THEN
            RAISE EXCEPTION 'partitions are created by the owner of the log only'
                USING ERRCODE = '42501';
        END IF;
        v_default := v_table || '_default';
        IF to_regclass(v_default) IS NULL THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF %I DEFAULT', v_default, v_table);
            partition := v_default;
            rows_moved := 0;
            RETURN NEXT;
        END IF;
        -- Created above, or converted from version 4 (section "partitioning (version 5)" near
        -- the top: its policy dropped): its privileges and policy. Else nothing (no lock).
        IF NOT EXISTS (SELECT 1 FROM pg_policy p WHERE p.polrelid = v_default::regclass
                                                   AND p.polname = 'wal_tenant_isolation') THEN
            PERFORM wal_secure_partition(v_default);
        END IF;
        FOR i IN 0..p_months_ahead LOOP
            v_month := to_char(date_trunc('month', p_from AT TIME ZONE 'UTC')
                               + make_interval(months => i), 'YYYYMM');
            partition := v_table || '_p' || v_month;
            CONTINUE WHEN to_regclass(partition) IS NOT NULL;
            v_lo := wal_partition_bound(v_month);
            v_hi := wal_partition_bound(wal_next_month(v_month));
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM ONLY %I WHERE task_id >= $1'
                           ' AND task_id < $2)', v_default) INTO v_any USING v_lo, v_hi;
            rows_moved := 0;
            -- Another owner's session creating the same month at the same moment: its table
            -- is the one (this call waited for it, then found the name taken).
            BEGIN
            -- Made apart, then attached: ATTACH locks the partitioned table SHARE UPDATE
            -- EXCLUSIVE, which appends to the other partitions do not wait for (CREATE TABLE
            -- ... PARTITION OF takes it ACCESS EXCLUSIVE). Either way the default partition
            -- is locked and scanned (none of its rows may belong to the new month).
            EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING ALL)', partition, v_table);
            IF v_any THEN
                -- Rows already there for this month (ids chosen by callers, or a database
                -- converted from version 4 whose random ids fall in the range): copied
                -- into the new table, deleted from the default partition (the trigger
                -- passes a row only with its identical copy there).
                EXECUTE format('INSERT INTO %I SELECT * FROM ONLY %I WHERE task_id >= $1'
                               ' AND task_id < $2', partition, v_default) USING v_lo, v_hi;
                GET DIAGNOSTICS rows_moved = ROW_COUNT;
                PERFORM set_config('wal_engine.partition_move', partition, true);
                EXECUTE format('DELETE FROM ONLY %I WHERE task_id >= $1 AND task_id < $2',
                               v_default) USING v_lo, v_hi;
                PERFORM set_config('wal_engine.partition_move', '', true);
            END IF;
            EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           v_table, partition, v_lo, v_hi);
            EXCEPTION WHEN duplicate_table THEN
                CONTINUE;
            END;
            PERFORM wal_secure_partition(partition);
            RETURN NEXT;
        END LOOP;
    END LOOP;
END;
$$;

-- Why a month's partitions may not be dropped: the first task in them (as 'tenant/task'),
-- of any tenant, that is not archived (no tombstone) and not in p_archiving (tasks of the
-- current tenant being archived by the caller), or a reason ('the current month', 'no
-- such partition'); NULL when every task in them is archived. Reads the partitions whole,
-- tenant by tenant (the tombstones are read through their forced policy, so the tenant
-- setting is moved to each tenant found, then back): the owner's only.
CREATE OR REPLACE FUNCTION wal_partition_blocker(p_month text, p_archiving text[])
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_tenant text := current_setting('wal.tenant', true);
    v_table text;
    v_partition text;
    v_found text;
    v_other text;
BEGIN
    IF p_month IS NULL OR p_month !~ '^[0-9]{6}$' THEN
        RAISE EXCEPTION 'a month is YYYYMM' USING ERRCODE = '22023';
    END IF;
    IF wal_month_start(wal_next_month(p_month)) > date_trunc('month', now() AT TIME ZONE 'UTC')
    THEN
        RETURN 'the current month or a later one';
    END IF;
    FOREACH v_table IN ARRAY wal_partitioned_tables() LOOP
        v_partition := v_table || '_p' || p_month;
        IF to_regclass(v_partition) IS NULL
           OR NOT EXISTS (SELECT 1 FROM pg_inherits i
                           WHERE i.inhrelid = to_regclass(v_partition)
                             AND i.inhparent = v_table::regclass) THEN
            RETURN 'no such partition';
        END IF;
        FOR v_other IN EXECUTE format('SELECT DISTINCT tenant FROM ONLY %I', v_partition) LOOP
            PERFORM set_config('wal.tenant', v_other, true);
            EXECUTE format('SELECT x.task_id FROM ONLY %I x WHERE x.tenant = $1'
                           ' AND NOT (x.tenant = $2 AND x.task_id = ANY ($3))'
                           ' AND NOT EXISTS (SELECT 1 FROM wal_archived_tasks a'
                           '                  WHERE a.tenant = $1 AND a.task_id = x.task_id)'
                           ' ORDER BY x.task_id LIMIT 1', v_partition)
                INTO v_found USING v_other, v_tenant, coalesce(p_archiving, '{}');
            PERFORM set_config('wal.tenant', coalesce(v_tenant, ''), true);
            IF v_found IS NOT NULL THEN
                RETURN v_other || '/' || v_found;
            END IF;
        END LOOP;
    END LOOP;
    RETURN NULL;
END;
$$;

-- Drop the past months whose four partitions hold no row at all (a month with no task,
-- or whose tasks all left task by task): nothing of the log goes with them, so no log row;
-- their names. Each is locked (at most 2 s, else left for the next call) and found empty
-- again under the lock. The owner's only, like wal_ensure_partitions.
CREATE OR REPLACE FUNCTION wal_drop_empty_partitions() RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    v_month text;
    v_table text;
    v_empty boolean;
    v_all boolean;
BEGIN
    IF NOT pg_has_role(current_user, (SELECT c.relowner FROM pg_class c
                                       WHERE c.oid = 'wal_events'::regclass), 'MEMBER') THEN
        RAISE EXCEPTION 'partitions are dropped by the owner of the log only'
            USING ERRCODE = '42501';
    END IF;
    FOR v_month IN SELECT substr(c.relname, length('wal_events_p') + 1)
                     FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                    WHERE i.inhparent = 'wal_events'::regclass
                      AND c.relname ~ '^wal_events_p[0-9]{6}$'
                    ORDER BY 1 LOOP
        CONTINUE WHEN wal_month_start(wal_next_month(v_month))
                      > date_trunc('month', now() AT TIME ZONE 'UTC');
        BEGIN
            PERFORM set_config('lock_timeout', '2s', true);
            v_all := true;
            FOREACH v_table IN ARRAY wal_partitioned_tables() LOOP
                IF to_regclass(v_table || '_p' || v_month) IS NULL THEN
                    v_all := false;
                    EXIT;
                END IF;
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', v_table || '_p' || v_month);
                EXECUTE format('SELECT NOT EXISTS (SELECT 1 FROM ONLY %I)',
                               v_table || '_p' || v_month) INTO v_empty;
                IF NOT v_empty THEN
                    v_all := false;
                    EXIT;
                END IF;
            END LOOP;
            IF v_all THEN
                FOREACH v_table IN ARRAY wal_partitioned_tables() LOOP
                    EXECUTE format('DROP TABLE %I', v_table || '_p' || v_month);
                END LOOP;
                RETURN NEXT 'wal_events_p' || v_month;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            CONTINUE;  -- In use: the next call sees it again.
        END;
    END LOOP;
END;
$$;

-- A database of version 4 converted above, and every fresh one: the default partitions,
-- and this month's and the next three.
SELECT count(*) FROM wal_ensure_partitions();

INSERT INTO wal_schema_version (version) VALUES (5) ON CONFLICT DO NOTHING;
-- ======================================================== end of partitioning (version 5)
