-- wal-engine security: roles, ownership and grants for least privilege. Idempotent.
--
-- Applied by wal_engine.security.roles.apply_security() after schema.sql, by a superuser (or a
-- role that may create roles and act as both roles below), and again after every migration:
-- re-creating a function resets its SECURITY DEFINER and search_path.
--
-- The role names and timeouts arrive as transaction-local settings (set_config(..., true))
-- and are quoted with format('%I' / '%L'); nothing here is built by string concatenation.
--
-- Map of the privileges
-- ---------------------
-- owner role (default engine_owner)   NOLOGIN. Owns the schema and every wal_* table, view
--                                     and function. Migrations run as it (SET ROLE). Even
--                                     it cannot UPDATE, DELETE or TRUNCATE wal_events or
--                                     wal_signals: the append-only triggers of schema.sql
--                                     refuse (WE002). It could DISABLE those triggers, and
--                                     a superuser can do anything: the hash chain plus an
--                                     external anchor (wal_engine.audit.anchor) make that evident.
-- application role (default          NOLOGIN since issue 16: the group that holds the
-- engine_app)                         runtime's privileges. Each tenant logs in as a role of
--                                     its own, a member of this group, provisioned by
--                                     wal_engine.security.tenants (wal-engine tenant create), mapped
--                                     to its tenant in wal_tenant_roles; row security keys on
--                                     that mapping (schema.sql). Not superuser, not
--                                     BYPASSRLS, owns nothing, not a member of the owner
--                                     role. A group without logins has no backends, so its
--                                     members cannot signal one another's sessions.
--   wal_events                        SELECT, INSERT: the log is append-only for it.
--   wal_events_json                   SELECT.
--   wal_tasks                         SELECT, INSERT; UPDATE of the head, status, wake and
--                                     lease-expiry columns only (status moves and
--                                     heartbeats are plain statements, decision 4 of
--                                     docs/architecture.md; the state-machine trigger
--                                     checks every status move). Never lease_epoch (the
--                                     fencing token), attempts, agent, budget or ids;
--                                     on_parent_end, set once as a child is created.
--   wal_idempotency                   SELECT, INSERT; UPDATE of the claim and outcome
--                                     columns; a released claim is deleted by
--                                     wal_release_key.
--   wal_snapshots                     SELECT, INSERT: derived data, pruned by
--                                     wal_save_snapshot and wal_delete_snapshots.
--   wal_snapshot_segments             SELECT, INSERT (likewise).
--   wal_blobs                         SELECT, INSERT: large values, append-only like the
--                                     log (triggers refuse UPDATE, DELETE, TRUNCATE); their
--                                     per-task count is kept by wal_count_blob_bytes (a
--                                     SECURITY DEFINER trigger).
--   wal_tenant_roles                  SELECT (row security: its own row only).
--   wal_archived_tasks                SELECT: the tenant's tombstones of archived tasks.
--   wal_retention_log                 nothing: written and read by the owner only.
--   partitions of the log's tables    nothing (decision 70): the runtime reaches rows
--   (<table>_pYYYYMM, <table>_default) through the partitioned tables only, where the
--                                     forced policies hold; each partition also has the
--                                     policy (enabled, not forced). wal_ensure_partitions,
--                                     wal_partition_blocker, wal_drop_empty_partitions: no
--                                     EXECUTE (the owner's).
--   wal_retention_remove              no EXECUTE, and not SECURITY DEFINER: retention
--                                     (`wal-engine retention run`) runs with the owner's
--                                     rights, the only ones allowed to delete archived
--                                     tasks' rows (schema.sql, section "retention").
--   table-level UPDATE, DELETE,       none on any table: with one of them, LOCK TABLE
--   TRUNCATE                          takes any mode (ACCESS EXCLUSIVE included) and could
--                                     stall every tenant; SELECT and INSERT allow only
--                                     ACCESS SHARE and ROW EXCLUSIVE, which conflict with
--                                     nothing the runtime takes (column UPDATE grants do
--                                     not count for LOCK TABLE).
--   advisory locks                    EXECUTE on pg_catalog's advisory-lock functions is
--                                     revoked from PUBLIC in this database and granted to
--                                     the owner: a runtime role can neither take the schema
--                                     lock nor block anything else on one.
--   wal_signals                       SELECT: signals are written by wal_send_signal only.
--   wal_tenants                       SELECT: task counts are kept by wal_count_task (a
--                                     SECURITY DEFINER trigger), caps set by the owner.
--   wal_workers                       SELECT, INSERT; UPDATE of agents and seen_at: the
--                                     advisory record of which agents workers serve; rows
--                                     a week old are deleted by wal_prune_workers only.
--   wal_schedules                     SELECT, INSERT; UPDATE of every column but the
--                                     tenant, the name and created_at (a schedule's
--                                     definition, pause flag and ticks: FOR UPDATE needs
--                                     it); deleted by wal_delete_schedule only.
--   wal_limiters                      SELECT, INSERT; UPDATE of the definition columns
--                                     (engine.limiter); blocked_until is set by
--                                     wal_limiter_block, a limiter deleted by
--                                     wal_delete_limiter only.
--   wal_limiter_reservations          SELECT: grants are written by wal_limiter_reserve
--                                     and wal_limiter_settle only.
--   row-level security                every table above but wal_transitions and
--                                     wal_schema_version is ENABLEd and FORCEd by schema.sql:
--                                     the app role (and the owner) see and write only the
--                                     rows of the tenant its login role is mapped to.
--   wal_queues, wal_queue_changes     SELECT: queues' limits are changed by wal_set_queue
--                                     (SECURITY DEFINER), which also writes the audit row.
--   wal_schema_version, wal_transitions  SELECT.
--   functions                         EXECUTE on wal_claim_tasks, wal_break_leases,
--                                     wal_send_signal, wal_cancel_task, wal_add_llm_spend,
--                                     wal_save_snapshot, wal_delete_snapshots,
--                                     wal_release_key, wal_prune_workers,
--                                     wal_delete_schedule, wal_limiter_reserve,
--                                     wal_limiter_settle, wal_limiter_block,
--                                     wal_delete_limiter (SECURITY DEFINER,
--                                     owned by the owner role, search_path fixed to this
--                                     schema then pg_temp): the only ways to change a
--                                     lease epoch. wal_emit is not executable by it.
--                                     EXECUTE on wal_event_hash and wal_wake_token (the
--                                     NOTIFY payload of a submission), on
--                                     wal_trusted_tenant (the policies call it), and on
--                                     wal_event_hash_v2 and wal_payload_json
--                                     (wal_events_json's decoder).
--   the database                      CONNECT. CREATE and TEMPORARY are revoked from
--                                     PUBLIC: a temporary table could otherwise shadow
--                                     wal_transitions for the invoker-rights trigger.
-- Any other wal_* table (an integration's, a test's) gets no grant: fail closed.

DO $security$
DECLARE
    owner_role  text := current_setting('wal_engine.owner_role');
    app_role    text := current_setting('wal_engine.app_role');
    schema_name text := current_schema();
    schema_oid  oid := (SELECT n.oid FROM pg_namespace n WHERE n.nspname = current_schema());
    fixed_path  text := format('%I, pg_temp', current_schema());
    item record;
BEGIN
    IF owner_role = app_role THEN
        RAISE EXCEPTION 'the owner and application roles must differ' USING ERRCODE = '22023';
    END IF;

    -- Roles ------------------------------------------------------------------------------
    BEGIN
        EXECUTE format('CREATE ROLE %I NOLOGIN', owner_role);
    EXCEPTION WHEN duplicate_object THEN
        NULL;  -- Roles are cluster-wide: another database of this cluster made it.
    END;
    EXECUTE format('ALTER ROLE %I NOLOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE '
                   'NOREPLICATION', owner_role);
    BEGIN
        EXECUTE format('CREATE ROLE %I NOLOGIN', app_role);
    EXCEPTION WHEN duplicate_object THEN
        NULL;
    END;
    -- NOLOGIN: tenants log in as roles of their own (wal_engine.security.tenants), members of it.
    EXECUTE format('ALTER ROLE %I NOLOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE '
                   'NOREPLICATION', app_role);
    IF pg_has_role(app_role, owner_role, 'MEMBER') THEN
        RAISE EXCEPTION 'role % is a member of the owner role %', app_role, owner_role
            USING ERRCODE = '42501';
    END IF;
    -- The group's own defaults would apply to no session (a member's sessions take the
    -- member's): the engine sets what it depends on at connection start (decision 35).
    EXECUTE format('ALTER ROLE %I RESET ALL', app_role);

    -- Database and schema ---------------------------------------------------------------------
    EXECUTE format('REVOKE CREATE, TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), app_role);
    EXECUTE format('ALTER SCHEMA %I OWNER TO %I', schema_name, owner_role);
    EXECUTE format('REVOKE ALL ON SCHEMA %I FROM PUBLIC', schema_name);
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', schema_name, app_role);
    -- Objects the owner role creates later are not readable or executable by everyone.
    EXECUTE format('ALTER DEFAULT PRIVILEGES FOR ROLE %I REVOKE EXECUTE ON FUNCTIONS '
                   'FROM PUBLIC', owner_role);
    EXECUTE format('ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA %I REVOKE ALL ON TABLES '
                   'FROM PUBLIC', owner_role, schema_name);

    -- Ownership, and no privilege left to anyone but the owner --------------------------------
    -- (Sequences owned by a column follow their table.)
    FOR item IN
        SELECT c.relname, c.relkind FROM pg_class c
         WHERE c.relnamespace = schema_oid AND c.relkind IN ('r', 'p', 'v', 'm')
           AND c.relname LIKE 'wal\_%'
         ORDER BY c.relname
    LOOP
        EXECUTE format('ALTER %s %I OWNER TO %I',
                       CASE item.relkind WHEN 'v' THEN 'VIEW'
                                         WHEN 'm' THEN 'MATERIALIZED VIEW'
                                         ELSE 'TABLE' END,
                       item.relname, owner_role);
        EXECUTE format('REVOKE ALL ON TABLE %I FROM PUBLIC, %I', item.relname, app_role);
    END LOOP;
    FOR item IN
        SELECT p.oid::regprocedure AS signature FROM pg_proc p
         WHERE p.pronamespace = schema_oid AND p.proname LIKE 'wal\_%'
         ORDER BY 1
    LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO %I', item.signature, owner_role);
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC, %I', item.signature, app_role);
    END LOOP;

    -- The application role's grants -----------------------------------------------------------
    EXECUTE format('GRANT SELECT ON wal_schema_version, wal_transitions, wal_events_json, '
                   'wal_signals, wal_tenants TO %I', app_role);
    EXECUTE format('GRANT SELECT, INSERT ON wal_events TO %I', app_role);
    EXECUTE format('GRANT SELECT, INSERT ON wal_tasks TO %I', app_role);
    EXECUTE format('GRANT UPDATE (head_seq, head_hash, status, status_path, updated_at, '
                   'wake_at, waiting_signal, lease_owner, lease_expires_at, on_parent_end) '
                   'ON wal_tasks TO %I',
                   app_role);
    -- No table-level DELETE (nor UPDATE, TRUNCATE): see the map above, LOCK TABLE.
    EXECUTE format('GRANT SELECT, INSERT ON wal_snapshots TO %I', app_role);
    EXECUTE format('GRANT SELECT, INSERT ON wal_snapshot_segments TO %I', app_role);
    -- Large values: written with their event, never changed (triggers of schema.sql).
    EXECUTE format('GRANT SELECT, INSERT ON wal_blobs TO %I', app_role);
    EXECUTE format('GRANT SELECT, INSERT ON wal_idempotency TO %I', app_role);
    -- Retention (issue 23): a tenant reads its own tombstones (a submission of an archived
    -- id is refused by a trigger that reads them); the retention log is the owner's only.
    EXECUTE format('GRANT SELECT ON wal_archived_tasks TO %I', app_role);
    EXECUTE format('GRANT SELECT ON wal_tenant_roles TO %I', app_role);
    EXECUTE format('GRANT UPDATE (state, owner, epoch, result, error, claimed_at, expires_at, '
                   'completed_at) ON wal_idempotency TO %I', app_role);
    -- Worker registrations (advisory: which agents workers serve, read by `submit`).
    EXECUTE format('GRANT SELECT, INSERT, UPDATE (agents, seen_at) ON wal_workers TO %I',
                   app_role);

    -- Schedules (issue 24): no table-level UPDATE or DELETE (LOCK TABLE, see the map).
    EXECUTE format('GRANT SELECT, INSERT, UPDATE (agent, cron, every_s, time_zone, input, '
                   'catch_up, catch_up_max, paused, next_tick, last_tick, last_task_id, '
                   'last_error, ticks_fired, updated_at) ON wal_schedules TO %I', app_role);

    -- Limiters (issue 24): definitions by the app role; grants, settlements, blocks and
    -- deletions by the SECURITY DEFINER functions below.
    EXECUTE format('GRANT SELECT, INSERT, UPDATE (requests_per_period, tokens_per_period, '
                   'token_kind, period_s, updated_at) ON wal_limiters TO %I', app_role);
    EXECUTE format('GRANT SELECT ON wal_limiter_reservations TO %I', app_role);

    -- Functions: the lease-changing ones run with the owner's rights and a fixed path ---------
    FOR item IN
        SELECT p.oid::regprocedure AS signature, p.proname FROM pg_proc p
         WHERE p.pronamespace = schema_oid
           AND p.proname IN ('wal_claim_tasks', 'wal_break_leases', 'wal_send_signal',
                             'wal_cancel_task', 'wal_count_task', 'wal_add_llm_spend',
                             'wal_save_snapshot', 'wal_delete_snapshots', 'wal_release_key',
                             'wal_prune_workers', 'wal_delete_schedule',
                             'wal_limiter_reserve', 'wal_limiter_settle',
                             'wal_limiter_block', 'wal_delete_limiter',
                             'wal_count_blob_bytes')
         ORDER BY 1
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %s',
                       item.signature, fixed_path);
        -- The counting triggers run on the app role's INSERT without its EXECUTE.
        IF item.proname NOT IN ('wal_count_task', 'wal_count_blob_bytes') THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', item.signature, app_role);
        END IF;
    END LOOP;
    -- Helpers and triggers keep the caller's rights but never look names up in a schema the
    -- caller could write to.
    FOR item IN
        SELECT p.oid::regprocedure AS signature FROM pg_proc p
         WHERE p.pronamespace = schema_oid
           AND p.proname IN ('wal_emit', 'wal_emit_event', 'wal_check_status_move',
                             'wal_refuse_change',
                             'wal_wake_token', 'wal_trusted_tenant',
                             'wal_refuse_archived_id', 'wal_retention_remove',
                             'wal_secure_partition', 'wal_ensure_partitions',
                             'wal_partition_blocker', 'wal_partition_bound',
                             'wal_next_month', 'wal_partitioned_tables',
                             'wal_month_start', 'wal_drop_empty_partitions')
         ORDER BY 1
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', item.signature, fixed_path);
    END LOOP;
    FOR item IN
        SELECT p.oid::regprocedure AS signature FROM pg_proc p
         WHERE p.pronamespace = schema_oid
           AND p.proname IN ('wal_event_hash', 'wal_wake_token', 'wal_trusted_tenant')
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', item.signature, app_role);
    END LOOP;

    -- Advisory locks (issue 16) ------------------------------------------------------------
    -- Anyone may take any advisory lock by default; a runtime role holding the schema lock
    -- stalled every connect. Function privileges are per database: here only the owner
    -- (migrations, the LangGraph set-up) and superusers keep them.
    FOR item IN
        SELECT p.oid::regprocedure AS signature FROM pg_proc p
         WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proname LIKE 'pg\_%advisory%'
         ORDER BY 1
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', item.signature);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', item.signature, owner_role);
    END LOOP;

    -- History and caps (issue 16 section of schema.sql) ----------------------------------
    -- The cap checks run inside wal_send_signal / wal_cancel_task (as the owner) and the
    -- budget trigger on the app role's INSERT: fixed path, no grant. The chain-2 hash and
    -- the payload and key decoders of wal_events_json are the app role's to call, like
    -- wal_event_hash (a view's functions run with the querying role's rights).
    FOR item IN
        SELECT p.oid::regprocedure AS signature, p.proname FROM pg_proc p
         WHERE p.pronamespace = schema_oid
           AND p.proname IN ('wal_event_hash_v2', 'wal_payload_json', 'wal_event_key',
                             'wal_check_signal',
                             'wal_count_signal', 'wal_check_cancel_text', 'wal_check_budget')
         ORDER BY 1
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', item.signature, fixed_path);
        IF item.proname IN ('wal_event_hash_v2', 'wal_payload_json', 'wal_event_key') THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', item.signature, app_role);
        END IF;
    END LOOP;

    -- Queues (issue 24, the queues section of schema.sql) ----------------------------------
    -- The runtime role reads its tenant's queues and their audit; it changes them only
    -- through wal_set_queue, which writes the change and its audit row together.
    EXECUTE format('GRANT SELECT ON wal_queues, wal_queue_changes TO %I', app_role);
    FOR item IN
        SELECT p.oid::regprocedure AS signature FROM pg_proc p
         WHERE p.pronamespace = schema_oid AND p.proname = 'wal_set_queue'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %s',
                       item.signature, fixed_path);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', item.signature, app_role);
    END LOOP;
END;
$security$;
