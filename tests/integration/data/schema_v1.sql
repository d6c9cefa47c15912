-- wal-engine schema, version 1. Idempotent: applying it twice changes nothing.
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
--                     is the exact canonical JSON bytes the chain hash covers (bytea), so a
--                     verifier recomputes every hash from the row; wal_events_json shows it
--                     as jsonb for SQL audits.
-- wal_snapshots       derived checkpoints (task_id, seq) -> encoded AgentState; can always be
--                     rebuilt from wal_events.
-- wal_idempotency     the side-effect gateway: key -> state, result, owner, epoch, times.
-- wal_signals         inbox of signals (webhooks, approvals) for tasks; consumption is
--                     recorded in the log (signal_received events), so rows never change.
--
-- Functions
-- ---------
-- wal_event_hash(...)        the chain hash, identical to wal_engine/chain.py:event_hash.
-- wal_check_status_move()    trigger: every status move walks legal transitions only.
-- wal_refuse_change()        trigger: the events table is append-only.
-- wal_emit(...)              append one event written by the database itself (claims,
--                            orphaning, wake-ups) to a task whose row the caller has locked.
-- wal_claim_tasks(...)       claim up to n due tasks in one statement (FOR UPDATE SKIP LOCKED).
-- wal_break_leases(...)      orphan tasks whose lease expired (database clock), NOTIFY.
-- wal_send_signal(...)       put a signal in the inbox; wake the task if it waits for it.
-- wal_cancel_task(...)       cancel from outside: terminal event, epoch bumped (fences).
--
-- Engine errors raised in SQL use custom SQLSTATEs (class WE), mapped to Python exceptions in
-- wal_engine/store/sqlstate.py:
--   WE001 illegal status transition (COLUMN = from status, CONSTRAINT = to status)
--   WE002 append-only table changed
--   WE003 head moved backwards / after a terminal status
--   WE004 unknown task

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
    task_id          text PRIMARY KEY CHECK (task_id ~ '^[A-Za-z0-9_.:-]{1,128}$'),
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
    updated_at       timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS wal_tasks_claimable ON wal_tasks (created_at)
    WHERE status IN ('QUEUED', 'RESUMING');
CREATE INDEX IF NOT EXISTS wal_tasks_waking ON wal_tasks (wake_at)
    WHERE status = 'WAITING';
CREATE INDEX IF NOT EXISTS wal_tasks_leased ON wal_tasks (lease_expires_at)
    WHERE status IN ('RUNNING', 'CHECKPOINTED');
CREATE INDEX IF NOT EXISTS wal_tasks_by_status ON wal_tasks (status, created_at);

CREATE TABLE IF NOT EXISTS wal_events (
    task_id         text NOT NULL,
    seq             bigint NOT NULL CHECK (seq >= 1),
    -- The closed vocabulary is enforced where events are decoded; a regex here cost 10 µs
    -- per insert (a third of the table's checks, measured), for no extra guarantee.
    type            text NOT NULL CHECK (length(type) BETWEEN 1 AND 64),
    version         smallint NOT NULL CHECK (version >= 1),
    epoch           bigint NOT NULL CHECK (epoch >= 0),
    payload         bytea NOT NULL,
    idempotency_key text,
    prev_hash       bytea NOT NULL CHECK (octet_length(prev_hash) = 32),
    hash            bytea NOT NULL CHECK (octet_length(hash) = 32),
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, seq)
);

CREATE OR REPLACE VIEW wal_events_json AS
    SELECT task_id, seq, type, version, epoch,
           convert_from(payload, 'UTF8')::jsonb AS payload,
           idempotency_key, encode(hash, 'hex') AS hash, recorded_at
    FROM wal_events;

CREATE TABLE IF NOT EXISTS wal_snapshots (
    task_id      text NOT NULL,
    seq          bigint NOT NULL CHECK (seq >= 1),
    state        bytea NOT NULL,
    state_format smallint NOT NULL DEFAULT 1,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, seq)
);

CREATE TABLE IF NOT EXISTS wal_idempotency (
    key          text PRIMARY KEY CHECK (length(key) BETWEEN 1 AND 512),
    task_id      text,
    state        text NOT NULL CHECK (state IN ('running', 'completed', 'failed')),
    owner        text,
    epoch        bigint NOT NULL DEFAULT 0,
    result       bytea,
    error        text,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    completed_at timestamptz
);

CREATE TABLE IF NOT EXISTS wal_signals (
    signal_id bigserial PRIMARY KEY,
    task_id   text NOT NULL,
    name      text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    payload   bytea NOT NULL,
    dedup_key text,
    sent_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (task_id, dedup_key)
);

CREATE INDEX IF NOT EXISTS wal_signals_by_task ON wal_signals (task_id, name, signal_id);

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
BEGIN
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

-- Append one event written by the database itself to a task the caller has locked FOR
-- UPDATE. Moves the head (and the status, when new_status is not NULL) and returns the
-- new seq. The payload is JSON text built by the caller; its bytes are what is hashed.
CREATE OR REPLACE FUNCTION wal_emit(
    p_task_id text, p_type text, p_payload jsonb, p_epoch bigint, p_new_status text
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    head record;
    body bytea := convert_to(p_payload::text, 'UTF8');
    next_seq bigint;
    next_hash bytea;
BEGIN
    -- The log's last event is the head (the task row's copy is as of its last status
    -- move). A writer racing for the same seq makes the INSERT below fail on the primary
    -- key, which the callers treat as "try again later".
    SELECT e.seq AS head_seq, e.hash AS head_hash INTO head FROM wal_events e
     WHERE e.task_id = p_task_id ORDER BY e.seq DESC LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown task %', p_task_id USING ERRCODE = 'WE004';
    END IF;
    next_seq := head.head_seq + 1;
    next_hash := wal_event_hash(head.head_hash, p_task_id, next_seq, p_type, 1, p_epoch, body);
    INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, prev_hash, hash)
    VALUES (p_task_id, next_seq, p_type, 1, p_epoch, body, head.head_hash, next_hash);
    UPDATE wal_tasks
       SET head_seq = next_seq, head_hash = next_hash,
           status = coalesce(p_new_status, status),
           status_path = CASE WHEN p_new_status IS NULL THEN NULL ELSE ARRAY[p_new_status] END,
           updated_at = now()
     WHERE task_id = p_task_id;
    RETURN next_seq;
END;
$$;

-- Claim up to p_limit due tasks for p_worker in one statement: QUEUED, RESUMING, and
-- WAITING tasks whose wake time has come (database clock), of the agents in p_agents (all
-- agents when NULL): a worker never takes a task it has no code for. Bumps each task's lease epoch
-- (the fencing token) and records the claim in the log.
-- (Dropped first: CREATE OR REPLACE cannot change a function's result columns.)
DROP FUNCTION IF EXISTS wal_claim_tasks(text, integer, bigint);
DROP FUNCTION IF EXISTS wal_claim_tasks(text, integer, bigint, text[]);
CREATE FUNCTION wal_claim_tasks(p_worker text, p_limit integer, p_lease_ttl_ms bigint,
                                p_agents text[] DEFAULT NULL)
RETURNS TABLE (task_id text, agent text, lease_epoch bigint, head_seq bigint,
               head_hash bytea, attempts integer, started_at timestamptz,
               database_now timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    due record;
    new_epoch bigint;
    claim_type text;
BEGIN
    FOR due IN
        SELECT t.task_id, t.status, t.lease_epoch, t.attempts, t.waiting_signal
          FROM wal_tasks t
         WHERE (t.status IN ('QUEUED', 'RESUMING')
                OR (t.status = 'WAITING' AND t.wake_at <= now()))
           AND (p_agents IS NULL OR t.agent = ANY (p_agents))
         ORDER BY coalesce(t.wake_at, t.created_at), t.task_id
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    LOOP
        new_epoch := due.lease_epoch + 1;
        IF due.status = 'WAITING' THEN
            PERFORM wal_emit(due.task_id, 'task_woken',
                             jsonb_build_object('reason', CASE WHEN due.waiting_signal IS NULL
                                                               THEN 'timer' ELSE 'timeout' END),
                             due.lease_epoch, 'RESUMING');
        END IF;
        claim_type := CASE WHEN due.status = 'QUEUED' THEN 'task_claimed' ELSE 'task_resumed' END;
        UPDATE wal_tasks t
           SET lease_epoch = new_epoch, lease_owner = p_worker,
               lease_expires_at = now() + make_interval(secs => p_lease_ttl_ms / 1000.0),
               wake_at = NULL, waiting_signal = NULL, attempts = due.attempts + 1,
               started_at = coalesce(t.started_at, now())
         WHERE t.task_id = due.task_id;
        PERFORM wal_emit(due.task_id, claim_type,
                         jsonb_build_object('worker_id', p_worker, 'attempt', due.attempts + 1),
                         new_epoch, 'RUNNING');
        RETURN QUERY SELECT t.task_id, t.agent, t.lease_epoch, t.head_seq, t.head_hash,
                            t.attempts, t.started_at, now()
                       FROM wal_tasks t WHERE t.task_id = due.task_id;
    END LOOP;
END;
$$;

-- Orphan up to p_limit tasks whose lease expired (database clock): record task_orphaned,
-- bump the epoch so the presumed-dead owner is fenced at once, and NOTIFY idle workers.
CREATE OR REPLACE FUNCTION wal_break_leases(p_limit integer)
RETURNS TABLE (task_id text, previous_owner text, previous_epoch bigint)
LANGUAGE plpgsql AS $$
DECLARE
    stale record;
BEGIN
    FOR stale IN
        SELECT t.task_id, t.lease_owner, t.lease_epoch
          FROM wal_tasks t
         WHERE t.status IN ('RUNNING', 'CHECKPOINTED') AND t.lease_expires_at < now()
         ORDER BY t.lease_expires_at
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    LOOP
        BEGIN
            UPDATE wal_tasks t
               SET lease_epoch = stale.lease_epoch + 1, lease_owner = NULL,
                   lease_expires_at = NULL
             WHERE t.task_id = stale.task_id;
            PERFORM wal_emit(stale.task_id, 'task_orphaned',
                             jsonb_build_object('previous_owner', stale.lease_owner,
                                                'previous_epoch', stale.lease_epoch),
                             stale.lease_epoch + 1, 'RESUMING');
        EXCEPTION WHEN unique_violation THEN
            -- The presumed-dead owner appended at that very moment: it is alive after
            -- all. Leave the task alone; if its lease stays expired, the next sweep takes it.
            CONTINUE;
        END;
        PERFORM pg_notify('wal_engine_wake', stale.task_id);
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
    task record;
    new_id bigint;
BEGIN
    SELECT t.status, t.waiting_signal, t.lease_epoch INTO task
      FROM wal_tasks t WHERE t.task_id = p_task_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown task %', p_task_id USING ERRCODE = 'WE004';
    END IF;
    INSERT INTO wal_signals (task_id, name, payload, dedup_key)
    VALUES (p_task_id, p_name, p_payload, p_dedup_key)
    ON CONFLICT (task_id, dedup_key) DO NOTHING
    RETURNING signal_id INTO new_id;
    IF new_id IS NULL THEN
        SELECT s.signal_id INTO new_id FROM wal_signals s
         WHERE s.task_id = p_task_id AND s.dedup_key = p_dedup_key;
        RETURN new_id;
    END IF;
    IF task.status = 'WAITING' AND task.waiting_signal = p_name THEN
        UPDATE wal_tasks t SET wake_at = NULL, waiting_signal = NULL
         WHERE t.task_id = p_task_id;
        PERFORM wal_emit(p_task_id, 'task_woken', jsonb_build_object('reason', 'signal'),
                         task.lease_epoch, 'RESUMING');
        PERFORM pg_notify('wal_engine_wake', p_task_id);
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
    task record;
BEGIN
    SELECT t.status, t.lease_epoch INTO task FROM wal_tasks t WHERE t.task_id = p_task_id
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
     WHERE t.task_id = p_task_id;
    PERFORM wal_emit(p_task_id, 'task_cancelled',
                     jsonb_build_object('reason', p_reason, 'requested_by', p_requested_by),
                     task.lease_epoch + 1, 'FAILED');
    PERFORM pg_notify('wal_engine_done', p_task_id);
    RETURN true;
END;
$$;

INSERT INTO wal_schema_version (version) VALUES (1) ON CONFLICT DO NOTHING;
